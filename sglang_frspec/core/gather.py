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


def build_head_from_table(
    table: torch.Tensor, plan: HotShardPlan, rank: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's ``[plan.width, hidden]`` hot head from a ``[V, hidden]`` table that every rank
    holds whole: the rows of the hot columns it computes, taken locally by global id.

    Under either layout the head ``build_local_head`` would build from the rank's slice of the
    table, without its row exchange: no row needs to cross ranks, so no collective runs (at
    start-up or at a refresh). ``out`` is refilled in place; unused slots stay zero rows.
    """
    table = table.detach()  # an nn.Embedding's weight requires grad; the head is a plain copy
    if out is None:
        out = table.new_zeros((plan.width, table.shape[1]))
    first, count = plan.offsets[rank], plan.counts[rank]
    ids = plan.hot_ids[first : first + count].to(table.device)
    torch.index_select(table, 0, ids, out=out[:count])
    return out


# The fill sits at least this far below the k-th value (in logits): SGLang picks from softmax
# probabilities, where logits closer than about 1e-7 can round to one probability, and a tie
# there goes to the lower column, which may be a fill column. 2**-20 keeps the fill's
# exp(x - max) at least 8 float32 ulps below the k-th's.
FILL_GAP = 2.0**-20


def _order_keys(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys ordered by value, then lower column (float32 values without NaN,
    -0.0 equal to 0.0; int64 columns < 2**31): the packets' order, and the Triton kernel's."""
    bits = torch.where(values == 0, 0.0, values).view(torch.int32)
    ordered_bits = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # signed order == float order
    return (ordered_bits << 31) | (2**31 - 1 - columns)


def merge_topk_packets(rank_major: torch.Tensor, k: int, num_hot: int) -> torch.Tensor:
    """Float32 ``[T, H]`` logits from every rank's top-k packet, ``rank_major`` ``[T, tp, 2k+1]``.

    The global top-k are the k largest candidates by value, ties to the lower hot index (the
    packets' own order, so the result does not depend on which rank holds a column). They land
    at their hot columns; every other column gets one fill value that carries the remaining
    probability mass, kept at least ``FILL_GAP`` (or one float32 step) below the k-th value so
    no consumer can rank a fill column with or above a picked one; where that cap applies (the
    rest nearly as large as the k-th value), the rest mass is low by at most a relative
    ``FILL_GAP``, or one float32 step of the k-th value above 16 (the fill's own rounding).
    A NaN rest (a NaN logit on some rank) makes the fill NaN.

    A rank with fewer than k hot ids pads its packet with fillers (value -inf at hot index 0),
    which a row with fewer than k values above -inf may pick. The picks are written with
    ``amax`` over the picked values only, so a filler never overwrites a real value at hot
    column 0 (a plain scatter did) and the result does not depend on the write order (identical
    on every rank, also on CUDA). A filler is picked only when the k-th value is -inf, so the
    fill is -inf as well (NaN in a row with a NaN).
    """
    num_rows, tp_size = rank_major.shape[:2]
    cand_values = rank_major[:, :, :k].reshape(num_rows, tp_size * k)
    cand_indices = rank_major[:, :, k : 2 * k].reshape(num_rows, tp_size * k).long()
    # Keys, not torch.topk over the values: that breaks ties by candidate position (rank-major).
    picked = _order_keys(cand_values, cand_indices).topk(k, dim=1).indices
    top_values = cand_values.gather(1, picked)
    top_indices = cand_indices.gather(1, picked)
    # Everything outside the global top-k: candidates not picked, plus each rank's rest.
    unpicked = cand_values.scatter(1, picked, -math.inf)
    others = torch.cat([unpicked, rank_major[:, :, 2 * k]], dim=1)
    fill = torch.logsumexp(others, dim=1) - math.log(num_hot - k)
    kth = top_values[:, -1]
    # Mathematically the fill is at most the k-th value; rounding can lift it to or above it.
    below_kth = torch.minimum(kth - FILL_GAP, torch.nextafter(kth, torch.full_like(kth, -math.inf)))
    fill = torch.minimum(fill, below_kth)  # -inf stays -inf; NaN stays NaN
    logits = fill[:, None].expand(num_rows, num_hot).contiguous()
    return logits.scatter_reduce_(1, top_indices, top_values, reduce="amax", include_self=False)


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
        columns (ties to the lower hot index) and, everywhere else, one fill value below them
        that carries the remaining probability mass (``merge_topk_packets``). Softmax, top-k and
        argmax over the result give the full logits' top-k probabilities and those ids (README:
        what "exact" means under ties). The remaining mass is summed from positive terms only
        (never ``1 - top mass``), so it stays accurate when the distribution is peaked.
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

        The torch reference of ``kernels.topk_packet``. The top-k is by value, ties to the lower
        column (``torch.topk`` leaves ties unspecified), -0.0 equal to 0.0 (written as 0.0), NaN
        ranked as -inf (written as -inf); a NaN anywhere in the row makes the rest LSE NaN, so
        the merged row stays NaN outside its top-k, as a softmax over the full logits would be.
        """
        _check_topk(k, self.num_hot)
        num_rows = local.shape[0]
        mine = local[:, : self.count].float()
        values = mine.new_full((num_rows, k), -math.inf)
        indices = mine.new_zeros((num_rows, k))
        rest_lse = mine.new_full((num_rows, 1), -math.inf)
        if self.count:
            kept = min(k, self.count)
            ranked = mine.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            top_slots = self._ordered_top_slots(ranked, kept)
            top_values = ranked.gather(1, top_slots)
            values[:, :kept] = torch.where(top_values == 0, 0.0, top_values)
            # Hot indices < 2**24 are exact in float32, so one float packet carries all three.
            indices[:, :kept] = (top_slots + self.offset).float()
            rest_lse = torch.logsumexp(mine.scatter(1, top_slots, -math.inf), dim=1, keepdim=True)
            # A NaN the top-k took (as -inf) poisons the rest as well.
            picked_nan = mine.gather(1, top_slots).isnan().any(1, keepdim=True)
            rest_lse = rest_lse.masked_fill(picked_nan, math.nan)
        return torch.cat([values, indices, rest_lse], dim=1)

    @staticmethod
    def _ordered_top_slots(ranked: torch.Tensor, kept: int) -> torch.Tensor:
        """Columns of the ``kept`` largest values of ``ranked`` (no NaN), by value then lower
        column (int64 [T, kept]).

        Two float top-k passes (an int64 key top-k over the whole row is 5x slower on CPU): the
        first finds the k-th value, the second the lowest columns holding it; the <= 2k
        candidates are then ordered by ``_order_keys``.
        """
        top_values, top_slots = ranked.topk(kept, dim=1)
        kth = top_values[:, -1:]
        column_score = torch.arange(ranked.shape[1], 0, -1, device=ranked.device, dtype=torch.float32)
        tie_slots = torch.where(ranked == kth, column_score, 0.0).topk(kept, dim=1).indices
        num_above = (top_values > kth).sum(1, keepdim=True)
        slot_rank = torch.arange(kept, device=ranked.device)
        slots = torch.cat([top_slots, tie_slots], dim=1)
        valid = torch.cat([top_values > kth, slot_rank < kept - num_above], dim=1)
        keys = torch.where(valid, _order_keys(ranked.gather(1, slots), slots), torch.iinfo(torch.int64).min)
        return slots.gather(1, keys.topk(kept, dim=1).indices)
