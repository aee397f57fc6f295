"""Building a rank's hot head and exchanging its logits under a shard plan (torch only).

Every collective goes through an ``all_gather`` callable with the signature of
``torch.distributed.all_gather_into_tensor(output, input)``: ``output`` is ``[tp * n, ...]``,
rank-major. Every rank calls it with the same shapes, also when it has no hot ids, so no rank
is left waiting.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from sglang_frspec.core.plan import HotShardPlan, plan_from_ranges

AllGather = Callable[[torch.Tensor, torch.Tensor], None] | None  # None: a group of one
EXCHANGES = ("full", "topk")


def _gather(local: torch.Tensor, tp_size: int, all_gather: AllGather) -> torch.Tensor:
    """All-gather ``local`` [n, ...] into a rank-major [tp, n, ...] tensor."""
    if tp_size == 1:
        return local.unsqueeze(0)
    local = local.contiguous()
    out = local.new_empty((tp_size * local.shape[0], *local.shape[1:]))
    all_gather(out, local)
    return out.view(tp_size, *local.shape)


def build_local_head(
    shard_weight: torch.Tensor, plan: HotShardPlan, rank: int, all_gather: AllGather
) -> torch.Tensor:
    """This rank's ``[plan.width, hidden]`` hot head, taken from its vocab shard of the target.

    ``shard_weight`` is the rank's local rows of the target LM head. Under the local layout the
    rank keeps the hot rows it owns; under the balanced layout the owned rows are exchanged
    once (one all-gather) and the rank keeps its equal slice of the hot order. Unused slots
    are zero rows, whose logits are never read.
    """
    owned = shard_weight[plan.owned_rows(rank).to(shard_weight.device)]
    head = shard_weight.new_zeros((plan.width, shard_weight.shape[1]))
    first, count = plan.offsets[rank], plan.counts[rank]
    if plan.layout == "local":
        head[:count] = owned
        return head
    source = plan_from_ranges(plan.hot_ids, plan.shard_ranges, "local")
    padded = shard_weight.new_zeros((source.width, shard_weight.shape[1]))
    padded[: owned.shape[0]] = owned
    gathered = _gather(padded, plan.tp_size, all_gather).flatten(0, 1)
    positions = source.gather_columns[first : first + count].to(gathered.device)
    head[:count] = gathered[positions]
    return head


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
        num_rows = local.shape[0]
        gathered = _gather(packet, self.plan.tp_size, all_gather)
        rank_major = gathered.permute(1, 0, 2)  # [T, tp, 2k+1]
        num_candidates = self.plan.tp_size * k
        cand_values = rank_major[:, :, :k].reshape(num_rows, num_candidates)
        cand_indices = rank_major[:, :, k : 2 * k].reshape(num_rows, num_candidates)
        top_values, picked = cand_values.topk(k, dim=1)
        top_indices = cand_indices.gather(1, picked).long()
        # Everything outside the global top-k: candidates not picked, plus each rank's rest.
        unpicked = cand_values.scatter(1, picked, -math.inf)
        others = torch.cat([unpicked, rank_major[:, :, 2 * k]], dim=1)
        fill = torch.logsumexp(others, dim=1) - math.log(self.num_hot - k)
        # Rounding must not lift the fill above the k-th value (it can only tie it).
        fill = torch.minimum(fill, top_values[:, -1])
        logits = fill[:, None].expand(num_rows, self.num_hot).contiguous()
        return logits.scatter_(1, top_indices, top_values)

    def topk_packet(self, local: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's share of the top-k exchange: [T, 2k+1] (top-k values, hot indices, rest LSE)."""
        if not 0 < k < self.num_hot:
            raise ValueError(f"top-k exchange needs 0 < k < H, got k={k}, H={self.num_hot}")
        num_rows = local.shape[0]
        mine = local[:, : self.count].float()
        values = mine.new_full((num_rows, k), -math.inf)
        indices = mine.new_zeros((num_rows, k))
        rest_lse = mine.new_full((num_rows, 1), -math.inf)
        if self.count:
            kept = min(k, self.count)
            top_values, top_slots = mine.topk(kept, dim=1)
            values[:, :kept] = top_values
            # Hot indices < 2**24 are exact in float32, so one float packet carries all three.
            indices[:, :kept] = (top_slots + self.offset).float()
            rest = mine.scatter(1, top_slots, -math.inf)
            rest_lse = torch.logsumexp(rest, dim=1, keepdim=True)
        return torch.cat([values, indices, rest_lse], dim=1)
