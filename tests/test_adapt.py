"""Adaptive hot set, the pure part: decayed scores, which ids swap, and the in-place head rows."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import build_local_head, plan_from_ranges, vocab_shard_ranges
from sglang_frspec.core.adapt import (
    MARGIN_SHIFT,
    MIN_MARGIN,
    SCORE_SHIFT,
    SwapGroup,
    apply_swaps_to_local_head,
    choose_swaps,
    decay_scores,
    swap_groups,
)

VOCAB = 1000


def test_scores_halve_then_add_what_was_committed_since():
    scores = torch.tensor([0, 7, 100, 3]) << SCORE_SHIFT
    decay_scores(scores, torch.tensor([5, 0, 1, 0]))
    half = SCORE_SHIFT - 1
    assert scores.tolist() == [5 << SCORE_SHIFT, 7 << half, 51 << SCORE_SHIFT, 3 << half]
    once = torch.tensor([1]) << SCORE_SHIFT
    for _ in range(SCORE_SHIFT):
        decay_scores(once, torch.tensor([0]))
    assert once.item() == 1  # a token committed once still leads the never-committed


def test_frequent_outside_ids_replace_the_weakest_inside_ones_eos_stays():
    hot = torch.tensor([2, 10, 11, 12, 13])  # position order; 2 is EOS
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    scores[[10, 11, 12, 13]] = torch.tensor([50, 0, 9, 40]) << SCORE_SHIFT
    scores[[500, 600, 700]] = torch.tensor([30, 11, 9]) << SCORE_SHIFT  # 9 does not beat 9 + margin
    swaps = choose_swaps(scores, hot, (SwapGroup(0, 5, (0, VOCAB)),), torch.tensor([2]), max_swaps=8)
    # 500 replaces 11 (score 0); the next weakest is 12 (9: EOS is protected), and 600's 11 does
    # not beat 9 by the margin (a quarter of 9, at least MIN_MARGIN): one swap only.
    assert (swaps.positions.tolist(), swaps.ids_in.tolist(), swaps.ids_out.tolist()) == ([2], [500], [11])
    scores[600] = (9 << SCORE_SHIFT) + max(MIN_MARGIN << SCORE_SHIFT, (9 << SCORE_SHIFT) >> MARGIN_SHIFT) + 1
    swaps = choose_swaps(scores, hot, (SwapGroup(0, 5, (0, VOCAB)),), torch.tensor([2]), max_swaps=8)
    assert sorted(zip(swaps.ids_out.tolist(), swaps.ids_in.tolist())) == [(11, 500), (12, 600)]
    assert swaps.positions.tolist() == [2, 3]  # ascending positions
    capped = choose_swaps(scores, hot, (SwapGroup(0, 5, (0, VOCAB)),), torch.tensor([2]), max_swaps=1)
    assert capped.ids_in.tolist() == [500]  # the best first


def test_nothing_to_swap():
    hot = torch.tensor([1, 2, 3])
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    scores[hot] = 10 << SCORE_SHIFT
    group = (SwapGroup(0, 3, (0, VOCAB)),)
    assert len(choose_swaps(scores, hot, group, torch.zeros(0, dtype=torch.int64), 4)) == 0


def test_local_groups_swap_within_each_ranks_vocab_shard():
    ranges = vocab_shard_ranges(VOCAB, 2)  # [0, 512), [512, 1000)
    plan = plan_from_ranges(torch.tensor([3, 4, 5, 600, 601]), ranges, "local")
    groups = swap_groups(plan)
    assert groups == (SwapGroup(0, 3, ranges[0]), SwapGroup(3, 5, ranges[1]))
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    scores[[700, 701, 702]] = 100 << SCORE_SHIFT  # all on rank 1: only rank 1's two positions can take them
    swaps = choose_swaps(scores, plan.hot_ids, groups, torch.zeros(0, dtype=torch.int64), max_swaps=8)
    assert swaps.positions.tolist() == [3, 4] and set(swaps.ids_in.tolist()) <= {700, 701, 702}
    assert swaps.ids_out.tolist() == [600, 601]
    with pytest.raises(ValueError, match="only under the local layout"):
        swap_groups(plan_from_ranges(plan.hot_ids, ranges, "balanced"))
    one_rank = plan_from_ranges(plan.hot_ids, vocab_shard_ranges(VOCAB, 1), "balanced")
    assert swap_groups(one_rank) == (SwapGroup(0, 5, (0, VOCAB)),)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_swapped_rows_equal_the_rows_of_the_new_ids(tp):
    gen = torch.Generator().manual_seed(tp)
    full = torch.randn(VOCAB, 16, generator=gen)
    ranges = vocab_shard_ranges(VOCAB, tp)
    plan = plan_from_ranges(torch.randperm(VOCAB, generator=gen)[:60].sort().values, ranges, "local")
    heads = [full[plan.hot_ids[o : o + c]].clone() for o, c in zip(plan.offsets, plan.counts)]
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[plan.hot_ids] = False
    scores[torch.nonzero(outside).flatten()[::7]] = 50 << SCORE_SHIFT  # spread over every shard
    swaps = choose_swaps(scores, plan.hot_ids, swap_groups(plan), torch.zeros(0, dtype=torch.int64), 12)
    assert len(swaps) == 12
    new_hot = plan.hot_ids.clone()
    new_hot[swaps.positions] = swaps.ids_in
    for rank, head in enumerate(heads):
        start, end = ranges[rank]
        addr = head.data_ptr()
        apply_swaps_to_local_head(head, full[start:end], plan, rank, swaps)
        run = new_hot[plan.offsets[rank] : plan.offsets[rank] + plan.counts[rank]]
        assert bool(((run >= start) & (run < end)).all())  # still this rank's own rows
        assert torch.equal(head, full[run]) and head.data_ptr() == addr  # in place


@pytest.mark.parametrize("tp", [1, 3])
def test_a_weight_refresh_after_swaps_rebuilds_the_current_set(tp):
    """The adapter rewrites the plan's hot ids in place with hot_token_id, so the refresh of a
    weight update (build_local_head over the plan, into the same head) reads the rows of the ids
    served now, from the new weights."""
    gen = torch.Generator().manual_seed(tp)
    old, new = torch.randn(VOCAB, 16, generator=gen), torch.randn(VOCAB, 16, generator=gen)
    ranges = vocab_shard_ranges(VOCAB, tp)
    plan = plan_from_ranges(torch.randperm(VOCAB, generator=gen)[:40].sort().values, ranges, "local")
    heads = [build_local_head(old[s:e], plan, r, None) for r, (s, e) in enumerate(ranges)]
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[plan.hot_ids] = False
    scores[torch.nonzero(outside).flatten()[::11]] = 50 << SCORE_SHIFT
    swaps = choose_swaps(scores, plan.hot_ids, swap_groups(plan), torch.zeros(0, dtype=torch.int64), 8)
    assert len(swaps) == 8
    plan.hot_ids.index_copy_(0, swaps.positions, swaps.ids_in)  # what the adapter does
    for rank, (start, end) in enumerate(ranges):
        addr = heads[rank].data_ptr()
        build_local_head(new[start:end], plan, rank, None, out=heads[rank])  # the refresh
        first, count = plan.offsets[rank], plan.counts[rank]
        assert torch.equal(heads[rank][:count], new[plan.hot_ids[first : first + count]])
        assert heads[rank].data_ptr() == addr
