"""Adaptive hot set: which ids to swap so the map follows the committed tokens (torch only).

Scores are decayed counts of the committed tokens: at each decision every score is halved and
the tokens committed since the last decision are added, in fixed point (integers, so every rank
that computes them gets the same; 16 fraction bits, so a token committed once stays ahead of the
never-committed ones for 16 decisions). Within each *swap group* (a run of hot positions and the
vocab range its ids must come from), an id outside the map replaces the weakest id inside when its score beats
that id's by a margin; protected ids (EOS) never leave. The number of hot ids, every group's
share of positions and every tensor's shape stay fixed: a swap rewrites one position in place.

Groups say where a new id's row can come from. Under the balanced layout (and on one rank) the
whole map is one group over the whole vocab: any id can take any hot position, and the rank whose
vocab shard holds its row sends it to the rank that computes the position (``place_hot_rows``).
Under the local layout rank r computes the hot positions of its own vocab shard and exchanges no
rows, so a swap group is (rank r's positions, rank r's vocab range): each rank's number of hot
positions stays what the start-up map gave it, and traffic that moves into a shard with no weak
ids to replace cannot be followed there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_frspec.core.errors import UnsupportedSetupError
from sglang_frspec.core.options import ADAPT_ENV
from sglang_frspec.core.plan import HotShardPlan

SCORE_SHIFT = 16  # fraction bits of a score
MIN_MARGIN = 1  # committed tokens (decayed) an incoming id must lead by, at the least
MARGIN_SHIFT = 2  # ... and a quarter of the outgoing id's score: no churn between near-equals


@dataclass(frozen=True)
class SwapGroup:
    """Hot positions ``[first, end)`` whose ids may only be replaced by ids in ``vocab_range``."""

    first: int
    end: int
    vocab_range: tuple[int, int]


@dataclass(frozen=True)
class Swaps:
    """One decision: hot position ``positions[i]`` changes from ``ids_out[i]`` to ``ids_in[i]``."""

    positions: torch.Tensor  # int64 [n], ascending
    ids_in: torch.Tensor  # int64 [n]
    ids_out: torch.Tensor  # int64 [n]

    def __len__(self) -> int:
        return int(self.positions.numel())


def check_adaptation_setup(pd_mode: str | None, dp_attention: bool) -> None:
    """Refuse the setups whose ranks could not run every decision together: a prefill or
    decode node (``pd_mode``), DP attention. The launcher and every scheduler check it."""
    if pd_mode is not None:
        raise UnsupportedSetupError(
            f"{ADAPT_ENV}=1 cannot serve a prefill/decode deployment (this node is {pd_mode}): the "
            "hot ids would change on one node and not on the other, which then reads the hot "
            f"indices it receives as other tokens. Unset {ADAPT_ENV} on PD nodes."
        )
    if dp_attention:
        raise UnsupportedSetupError(
            f"{ADAPT_ENV}=1 cannot be combined with DP attention (--attn-dp-size > 1, or "
            "--enable-dp-attention): each attention-DP group commits other tokens and an idle one "
            "runs no verify step, so the ranks of the LM head's group would not decide together "
            f"(they would hang). Unset {ADAPT_ENV} or serve without DP attention."
        )


def swap_groups(plan: HotShardPlan) -> tuple[SwapGroup, ...]:
    """The swap groups of a plan: one over the whole vocab, or one per rank under the local layout."""
    if plan.layout != "local" or plan.tp_size == 1:
        return (SwapGroup(0, plan.num_hot, (0, plan.shard_ranges[-1][1])),)
    return tuple(
        SwapGroup(offset, offset + count, vocab_range)
        for offset, count, vocab_range in zip(plan.offsets, plan.counts, plan.shard_ranges)
    )


def decay_scores(scores: torch.Tensor, committed_since: torch.Tensor) -> None:
    """``scores = scores / 2 + committed_since`` in fixed point, in place (int64 [V])."""
    scores.bitwise_right_shift_(1).add_(committed_since << SCORE_SHIFT)


def choose_swaps(
    scores: torch.Tensor,
    hot_ids: torch.Tensor,
    groups: tuple[SwapGroup, ...],
    protected: torch.Tensor,
    max_swaps: int,
    committed: torch.Tensor | None = None,
) -> Swaps:
    """The swaps of one decision: at most ``max_swaps`` in all, the largest gains first.

    ``scores`` int64 [V] decayed counts (``decay_scores``); ``hot_ids`` int64 [H], the current id
    at each hot position; ``protected`` int64 ids that never leave the map; ``committed`` int64
    [V] all-time counts, which order ids of equal score (a score decays to 0 in fixed point, so an
    id committed long ago ties with one never committed): the fewer first, then the lower position.
    The order is the same on every device (a top-k's order among ties is not), so which rank
    computes an incoming id is predictable.
    """
    never_out = torch.iinfo(torch.int64).max
    positions, ids_in, gains = [], [], []
    for group in groups:
        start, end = group.vocab_range
        inside = hot_ids[group.first : group.end]
        inside_scores = scores[inside].masked_fill(torch.isin(inside, protected), never_out)
        outside_scores = scores[start:end].clone()
        outside_scores[inside - start] = -1  # already in the map
        n = min(max_swaps, inside.numel(), end - start - inside.numel())
        if n <= 0:
            continue
        best_out, best_out_at = outside_scores.topk(n)
        # The weakest first: by score, then all-time count, then position (stable sorts).
        order = torch.arange(inside.numel(), device=inside.device)
        if committed is not None:
            order = committed[inside].sort(stable=True).indices
        weak_in_at = order[inside_scores[order].sort(stable=True).indices[:n]]
        weak_in = inside_scores[weak_in_at]
        margin = torch.clamp(weak_in >> MARGIN_SHIFT, min=MIN_MARGIN << SCORE_SHIFT)
        # best_out descends and weak_in ascends, so the swaps that pay are a prefix.
        pays = (best_out > weak_in + margin) & (weak_in != never_out)
        count = int(pays.cumprod(0).sum())
        positions.append(group.first + weak_in_at[:count])
        ids_in.append(start + best_out_at[:count])
        gains.append(best_out[:count] - weak_in[:count])
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64, device=hot_ids.device)
        return Swaps(empty, empty, empty)
    # The best gains over all groups (ties: the earlier group first), then in position order.
    kept = torch.cat(gains).argsort(descending=True, stable=True)[:max_swaps]
    kept_positions, kept_ids = torch.cat(positions)[kept], torch.cat(ids_in)[kept]
    order = kept_positions.argsort()
    kept_positions, kept_ids = kept_positions[order], kept_ids[order]
    return Swaps(kept_positions, kept_ids, hot_ids[kept_positions])
