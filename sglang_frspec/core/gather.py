"""Building a rank's hot head and exchanging its logits under a shard plan (torch only).

Every collective goes through an ``all_gather`` callable with the signature of
``torch.distributed.all_gather_into_tensor(output, input)``: ``output`` is ``[tp * n, ...]``,
rank-major. Every rank calls it with the same shapes, also when it has no hot ids, so no rank
is left waiting.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import torch

from sglang_frspec.core.plan import HotShardPlan

AllGather = Callable[[torch.Tensor, torch.Tensor], None] | None  # None: a group of one
EXCHANGES = ("full", "topk")


def topk_packet_applies(k: int, num_hot: int) -> bool:
    """Whether the top-k exchange is exact for a top-k of ``num_hot`` columns: it needs a column
    outside the top-k to carry the rest of the probability mass, so 0 < k < H."""
    return 0 < k < num_hot


def _check_topk(k: int, num_hot: int) -> None:
    if not topk_packet_applies(k, num_hot):
        raise ValueError(f"top-k exchange needs 0 < k < H, got k={k}, H={num_hot}")


def _gather(local: torch.Tensor, tp_size: int, all_gather: AllGather) -> torch.Tensor:
    """All-gather ``local`` [n, ...] into a rank-major [tp, n, ...] tensor."""
    if tp_size == 1:
        return local.unsqueeze(0)
    local = local.contiguous()
    out = local.new_empty((tp_size * local.shape[0], *local.shape[1:]))
    all_gather(out, local)
    return out.view(tp_size, *local.shape)


BUILD_CHUNK_BYTES = 32 << 20  # transient buffers of one row exchange step (start-up, refresh, swaps)
RowReader = Callable[[torch.Tensor, torch.Tensor], None]  # read(local rows int64, dest [n, hidden])


def shard_row_reader(shard_weight: torch.Tensor) -> RowReader:
    """A reader of plain rows: ``read(rows, dest)`` copies ``shard_weight[rows]`` into ``dest``."""

    def read(rows: torch.Tensor, dest: torch.Tensor) -> None:
        torch.index_select(shard_weight, 0, rows.to(shard_weight.device), out=dest)

    return read


def build_local_head(
    shard_weight: torch.Tensor,
    plan: HotShardPlan,
    rank: int,
    all_gather: AllGather,
    *,
    out: torch.Tensor | None = None,
    chunk_bytes: int = BUILD_CHUNK_BYTES,
) -> torch.Tensor:
    """This rank's ``[plan.width, hidden]`` hot head, taken from its vocab shard of the target.

    ``shard_weight`` is the rank's local rows of the target LM head. Under the local layout the
    rank copies the hot rows it owns; under the balanced layout the owned rows are exchanged in
    fixed-size steps and the rank keeps its equal slice of the hot order (``place_hot_rows``).
    ``out`` (a previous head) is refilled in place. Unused slots are zero rows, whose logits are
    never read. Apart from the head itself, no step holds more than ``chunk_bytes``.
    """
    if out is None:
        out = shard_weight.new_zeros((plan.width, shard_weight.shape[1]))
    place_hot_rows(shard_row_reader(shard_weight), plan.hot_ids, plan, rank, all_gather, out,
                   chunk_bytes=chunk_bytes)  # fmt: skip
    return out


def place_hot_rows(
    read_rows: RowReader,
    ids: torch.Tensor,
    plan: HotShardPlan,
    rank: int,
    all_gather: AllGather,
    out: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    chunk_bytes: int = BUILD_CHUNK_BYTES,
) -> int:
    """Write the row of ``ids[i]`` at hot position ``positions[i]`` (default ``i``; ascending)
    into ``out``, this rank's hot head, for every position this rank computes. Every rank calls
    it with the same CPU ``ids`` and ``positions``, which need not be sorted by id.

    The rank whose vocab shard holds an id reads its row (``read_rows(local rows, dest)``).
    Under the balanced layout it sends the row to the rank that computes the position: step s
    all-gathers every rank's owned rows ``[s*C, (s+1)*C)`` (in the order of ``ids``), the same
    number of steps on every rank, idle ones included, so no rank waits alone. Under the local
    layout (and on one rank) a rank computes only positions whose ids it holds: no collective.
    Apart from ``out``, no step holds more than ``chunk_bytes``, whatever the skew and the TP
    size: the transient of a start-up or refresh that runs after the KV cache is allocated, or of
    an adaptive decision, stays bounded. Returns the bytes this rank's all-gathers received.
    """
    exchange = plan.layout != "local" and plan.tp_size > 1
    sources = range(plan.tp_size) if exchange else range(rank, rank + 1)
    owned = [int(((ids >= s) & (ids < e)).sum()) for s, e in (plan.shard_ranges[r] for r in sources)]
    hidden = out.shape[1]
    rows_per_step = min(max(owned), _rows_per_step(len(sources), hidden, out.element_size(), chunk_bytes))
    if not rows_per_step:
        return 0
    first, end = plan.offsets[rank], plan.offsets[rank] + plan.counts[rank]
    bounds = torch.tensor([first, end])
    # One send and one receive buffer for all steps: a backend that keeps a step's tensors
    # alive until its work object goes (gloo) cannot make steps pile up.
    send = out.new_empty((rows_per_step, hidden))
    received = send.new_empty((len(sources) * rows_per_step, hidden)) if exchange else send
    by_source = received.view(len(sources), rows_per_step, hidden)
    chunks = [_owned_indices(ids, *plan.shard_ranges[r], rows_per_step) for r in sources]
    empty = torch.zeros(0, dtype=torch.int64)
    steps = -(-max(owned) // rows_per_step)
    for _ in range(steps):
        step = [next(chunk, empty) for chunk in chunks]
        sent = step[rank - sources.start]
        if sent.numel():
            read_rows(ids[sent] - plan.shard_ranges[rank][0], send[: sent.numel()])
        if exchange:
            all_gather(received, send)
        for source, indices in enumerate(step):
            # The positions sent ascend, so the ones this rank computes are one run of them.
            sent_positions = indices if positions is None else positions[indices]
            lo, hi = torch.searchsorted(sent_positions, bounds).tolist()
            if lo < hi:
                slots = (sent_positions[lo:hi] - first).to(out.device)
                out.index_copy_(0, slots, by_source[source, lo:hi])
    return steps * received.numel() * received.element_size() if exchange else 0


def _rows_per_step(sources: int, hidden: int, itemsize: int, chunk_bytes: int) -> int:
    """Rows per exchange step so that its send and receive buffers and row indices fit in chunk_bytes."""
    per_row = (sources + 1) * hidden * itemsize + 24 * sources  # + up to three int64 indices per source
    return max(1, chunk_bytes // per_row)


def _owned_indices(ids: torch.Tensor, start: int, end: int, size: int) -> Iterator[torch.Tensor]:
    """Indices i (ascending) of the ids in ``[start, end)``, ``size`` at a time, found by
    scanning ``size`` ids at a time (so it never holds more than ``2 * size`` indices)."""
    pending = torch.zeros(0, dtype=torch.int64)
    for first in range(0, ids.numel(), size):
        window = ids[first : first + size]
        pending = torch.cat([pending, torch.nonzero((window >= start) & (window < end)).flatten() + first])
        if pending.numel() >= size:
            yield pending[:size]
            pending = pending[size:]
    if pending.numel():
        yield pending


def merge_topk_packets(rank_major: torch.Tensor, k: int, num_hot: int) -> torch.Tensor:
    """Float32 ``[T, H]`` logits from every rank's top-k packet, ``rank_major`` ``[T, tp, 2k+1]``.

    The global top-k values land at their hot columns; every other column gets one fill value
    that carries exactly the remaining probability mass. A rank with fewer than k hot ids pads
    its packet with fillers (value -inf at hot index 0), which a row with fewer than k values
    above -inf may pick: they are written with ``amax`` over a fill that never exceeds a picked
    value, so a filler changes no column (a plain scatter let it overwrite hot column 0) and the
    result does not depend on the write order (identical on every rank, also on CUDA).
    """
    num_rows, tp_size = rank_major.shape[:2]
    cand_values = rank_major[:, :, :k].reshape(num_rows, tp_size * k)
    cand_indices = rank_major[:, :, k : 2 * k].reshape(num_rows, tp_size * k)
    top_values, picked = cand_values.topk(k, dim=1)
    top_indices = cand_indices.gather(1, picked).long()
    # Everything outside the global top-k: candidates not picked, plus each rank's rest.
    unpicked = cand_values.scatter(1, picked, -math.inf)
    others = torch.cat([unpicked, rank_major[:, :, 2 * k]], dim=1)
    fill = torch.logsumexp(others, dim=1) - math.log(num_hot - k)
    # Rounding must not lift the fill above the k-th value (it can only tie it).
    fill = torch.minimum(fill, top_values[:, -1])
    logits = fill[:, None].expand(num_rows, num_hot).contiguous()
    return logits.scatter_reduce_(1, top_indices, top_values, reduce="amax")


class HotLogitsExchange:
    """Turns each rank's ``[T, width]`` local logits into identical ``[T, H]`` hot logits."""

    def __init__(self, plan: HotShardPlan, rank: int, device: torch.device | str = "cpu"):
        self.plan = plan
        self.rank = rank
        self.num_hot = plan.num_hot
        self.count = plan.counts[rank]
        self.offset = plan.offsets[rank]
        # Index tensors live on the device once, so the runtime path never syncs with the host.
        self._column_ranks = plan.column_ranks.to(device)
        self._column_slots = plan.column_slots.to(device)

    def full(self, local: torch.Tensor, all_gather: AllGather) -> torch.Tensor:
        """Padded all-gather of every rank's local logits, compacted to hot order: [T, H]."""
        tp_size, num_rows = self.plan.tp_size, local.shape[0]
        if tp_size == 1:
            return local[:, : self.num_hot]
        rank_major = _gather(local, tp_size, all_gather).permute(1, 0, 2)  # [T, tp, width]
        if self.plan.compaction_is_slice:
            return rank_major.reshape(num_rows, tp_size * self.plan.width)[:, : self.num_hot]
        return rank_major[:, self._column_ranks, self._column_slots]

    def topk(self, local: torch.Tensor, k: int, all_gather: AllGather) -> torch.Tensor:
        """Exchange only each rank's top-k (value, hot index) and the log-sum-exp of the rest.

        Returns float32 ``[T, H]`` logits holding the exact global top-k values at their
        columns and, everywhere else, one fill value chosen so that the other columns carry
        exactly the remaining probability mass. Softmax, top-k and argmax over the result give
        the same top-k probabilities and ids as the full logits. The remaining mass is summed
        from positive terms only (never ``1 - top mass``), so it stays accurate when the
        distribution is peaked.
        """
        packet = self.topk_packet(local, k)
        rank_major = _gather(packet, self.plan.tp_size, all_gather).permute(1, 0, 2)
        return merge_topk_packets(rank_major, k, self.num_hot)

    def topk_packet(self, local: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's packet: the single-pass Triton kernel on CUDA when triton imports, else
        ``topk_packet_reference``."""
        kernels = self._triton_kernels() if local.is_cuda else None
        if kernels is None:
            return self.topk_packet_reference(local, k)
        _check_topk(k, self.num_hot)
        return kernels.topk_packet(local, self.count, self.offset, k)

    @staticmethod
    @functools.cache
    def _triton_kernels():
        try:
            import sglang_frspec.kernels as kernels
        except ImportError:  # no triton: the torch reference
            return None
        return kernels

    def topk_packet_reference(self, local: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's share of the top-k exchange: [T, 2k+1] (top-k values, hot indices, rest LSE).

        The torch reference of ``kernels.topk_packet``. Ties are broken by the lower column, so
        the packet is a function of the logits alone (``torch.topk`` leaves ties unspecified).
        """
        _check_topk(k, self.num_hot)
        num_rows = local.shape[0]
        mine = local[:, : self.count].float()
        values = mine.new_full((num_rows, k), -math.inf)
        indices = mine.new_zeros((num_rows, k))
        rest_lse = mine.new_full((num_rows, 1), -math.inf)
        if self.count:
            kept = min(k, self.count)
            top_slots = self._ordered_top_slots(mine, kept)
            values[:, :kept] = mine.gather(1, top_slots)
            # Hot indices < 2**24 are exact in float32, so one float packet carries all three.
            indices[:, :kept] = (top_slots + self.offset).float()
            rest = mine.scatter(1, top_slots, -math.inf)
            rest_lse = torch.logsumexp(rest, dim=1, keepdim=True)
        return torch.cat([values, indices, rest_lse], dim=1)

    @staticmethod
    def _ordered_top_slots(mine: torch.Tensor, kept: int) -> torch.Tensor:
        """Columns of the ``kept`` largest values, by value then lower column (int64 [T, kept]).

        Two float top-k passes (an int64 key top-k over the whole row is 5x slower on CPU): the
        first finds the k-th value, the second the lowest columns holding it; the <= 2k
        candidates are then ordered by a distinct (value bits, column) key.
        """
        top_values, top_slots = mine.topk(kept, dim=1)
        kth = top_values[:, -1:]
        column_score = torch.arange(mine.shape[1], 0, -1, device=mine.device, dtype=torch.float32)
        tie_slots = torch.where(mine == kth, column_score, 0.0).topk(kept, dim=1).indices
        num_above = (top_values > kth).sum(1, keepdim=True)
        slot_rank = torch.arange(kept, device=mine.device)
        slots = torch.cat([top_slots, tie_slots], dim=1)
        valid = torch.cat([top_values > kth, slot_rank < kept - num_above], dim=1)
        bits = mine.gather(1, slots).view(torch.int32)
        ordered_bits = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # signed order == float order
        keys = torch.where(valid, (ordered_bits << 31) | (2**31 - 1 - slots), torch.iinfo(torch.int64).min)
        return slots.gather(1, keys.topk(kept, dim=1).indices)
