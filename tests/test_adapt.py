"""Adaptive hot set: decayed scores, which ids swap, and the in-place head rows (in one process,
and on real gloo groups where rows cross ranks); the adapter on a quantized ModelOpt FP8 head."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import build_local_head, plan_from_ranges, vocab_shard_ranges
from sglang_frspec.core.adapt import (
    MARGIN_SHIFT,
    MIN_MARGIN,
    SCORE_SHIFT,
    SwapGroup,
    choose_swaps,
    decay_scores,
    swap_groups,
)
from sglang_frspec.core.gather import _rows_per_step, place_hot_rows, shard_row_reader
from sglang_frspec.core.options import ADAPT_ENV, ADAPT_INTERVAL_ENV
from sglang_frspec.demo.fixtures import perm_fixture
from tests import rank_cases_adapt
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_graphs import eagle_map_server_args
from tests.rank_cases_quantized import fp8_checkpoint

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


def test_ties_among_the_weakest_go_to_the_fewest_committed_then_the_lowest_positions():
    """Equal scores leave the map fewest all-time commits first (a score decays to 0: an id used
    long ago ties with one never used), then lowest position first, the same on every device (a
    top-k's order among ties is unspecified), so which rank computes an incoming id is known."""
    hot = torch.arange(100, 164)
    group = (SwapGroup(0, 64, (0, VOCAB)),)
    scores = torch.zeros(VOCAB, dtype=torch.int64)
    scores[hot[::2]] = 9 << SCORE_SHIFT  # even positions in use; odd ones all at 0
    scores[[700, 701, 702]] = 50 << SCORE_SHIFT
    swaps = choose_swaps(scores, hot, group, torch.zeros(0, dtype=torch.int64), 8)
    assert swaps.positions.tolist() == [1, 3, 5]
    committed = torch.zeros(VOCAB, dtype=torch.int64)
    committed[hot[1:9:2]] = 7  # positions 1, 3, 5, 7: committed long ago, decayed to 0 since
    committed[hot[::2]] = 30
    swaps = choose_swaps(scores, hot, group, torch.zeros(0, dtype=torch.int64), 8, committed=committed)
    assert swaps.positions.tolist() == [9, 11, 13]


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
    # Balanced: any id may take any position, whichever shard holds its row.
    assert swap_groups(plan_from_ranges(plan.hot_ids, ranges, "balanced")) == (SwapGroup(0, 5, (0, VOCAB)),)
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
        reader = shard_row_reader(full[start:end])  # local: no collective
        place_hot_rows(reader, swaps.ids_in, plan, rank, None, head, positions=swaps.positions)
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


def test_rows_in_any_order_land_at_their_positions_in_small_steps():
    """One rank, ids in no particular order (as after swaps), a step of a few rows: every position
    of the head holds its id's row."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(VOCAB, 16, generator=gen)
    ids = torch.randperm(VOCAB, generator=gen)[:45]
    plan = plan_from_ranges(ids.sort().values, vocab_shard_ranges(VOCAB, 1), "balanced")
    plan.hot_ids.copy_(ids)  # unsorted, as the adapter leaves it
    head = torch.full((plan.width, 16), float("nan"))
    place_hot_rows(shard_row_reader(full), plan.hot_ids, plan, 0, None, head, chunk_bytes=1000)
    assert _rows_per_step(1, 16, 4, 1000) == 6  # eight steps
    assert torch.equal(head, full[ids])


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 3])
def test_balanced_swaps_move_rows_across_ranks(tp):
    """Balanced layout on a real gloo group, a map held by rank 0's shard alone: the traffic moves
    to the other shards, every swapped-in row lives on another rank than the position that takes
    it (or some do), and after the swaps (in steps of a few rows, every all-gather within the step
    budget) and after a weight refresh over the swapped, unsorted ids each rank's head equals the
    independent ``W[new hot ids]`` of its slice, at the same address."""
    vocab, hidden = VOCAB, 16
    ranges = vocab_shard_ranges(vocab, tp)
    gen = torch.Generator().manual_seed(tp)
    hot = torch.randperm(ranges[0][1], generator=gen)[:60].sort().values
    plan = plan_from_ranges(hot, ranges, "balanced")
    scores = torch.zeros(vocab, dtype=torch.int64)
    scores[hot[::3]] = 5 << SCORE_SHIFT  # a third of the map stays in use
    scores[ranges[0][1] :: 13] = 40 << SCORE_SHIFT  # the new traffic, on the other shards only
    swaps = choose_swaps(scores, plan.hot_ids, swap_groups(plan), torch.zeros(0, dtype=torch.int64), 30)
    assert len(swaps) == 30 and bool((swaps.ids_in >= ranges[0][1]).all())
    holders = plan.column_ranks[swaps.positions]
    assert set(holders.tolist()) == set(range(tp))  # rank 0 takes rows it does not hold, too
    chunk = 4 * ((tp + 1) * hidden * 4 + 24 * tp)  # four rows a step
    payload = {"vocab": vocab, "hidden": hidden, "hot": hot.tolist(), "chunk_bytes": chunk,
               "positions": swaps.positions.tolist(), "ids_in": swaps.ids_in.tolist()}  # fmt: skip
    results = run_tp_group(rank_cases_adapt.swapped_rows, tp, payload)
    new_hot = hot.clone()
    new_hot[swaps.positions] = swaps.ids_in
    # The checkpoints of rank_cases._target_head, before (seed 0) and after (seed 1) the update.
    old_full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    new_full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1))
    owned = [int(((swaps.ids_in >= s) & (swaps.ids_in < e)).sum()) for s, e in ranges]
    for rank, result in enumerate(results):
        first, count = plan.offsets[rank], plan.counts[rank]
        assert torch.equal(result["swapped"][:count], old_full[new_hot[first : first + count]]), rank
        assert torch.equal(result["refreshed"][:count], new_full[new_hot[first : first + count]]), rank
        assert result["in_place"]
        # Every rank ran the same steps, each within the budget: 4 rows from each rank.
        assert result["gathered"] == [tp * 4 * hidden * 4] * -(-max(owned) // 4), rank
        assert result["returned"] == sum(result["gathered"])  # what the adapter logs
        assert _rows_per_step(tp, hidden, 4, chunk) == 4


@pytest.mark.multirank
@pytest.mark.parametrize(("vocab", "hidden"), [(128, 64), (1000, 64)], ids=["square", "non-square"])
def test_the_adapter_swaps_dequantized_rows_into_an_fp8_head(vocab, hidden):
    """A real ModelOpt FP8 head at TP=2, stored transposed ([hidden, rows per rank]); square when
    rows per rank equal hidden (the shape a plain head has, so a shape check passes it and raw
    float8 columns would be copied without the scale). Under both layouts the committed ids are
    swapped in and every rank's head equals the independent dequantization of its new hot ids."""
    ranges = vocab_shard_ranges(vocab, 2)
    hot = [*range(0, ranges[0][1], 3)][:12] + [*range(ranges[1][0], ranges[1][1], 3)][:12]  # both shards
    committed = [ranges[1][0] + 1, ranges[1][0] + 5, 2, 4]  # two ids from each shard, outside the map
    payload = {"vocab": vocab, "hidden": hidden, "hot": hot, "committed": committed}
    results = run_tp_group(rank_cases_adapt.fp8_head_adapts, 2, payload)
    quantized, scale, dequantized = fp8_checkpoint(vocab, hidden, seed=0)
    rows_per_rank = ranges[0][1]
    assert results[0]["stored"] == (hidden, rows_per_rank) and results[0]["dtype"] == torch.float8_e4m3fn
    assert (hidden == rows_per_rank) == (vocab == 128)
    for layout in ("local", "balanced"):
        hot_ids = results[0][layout]["hot_ids"]
        assert set(committed) <= set(hot_ids.tolist()), layout  # all four swapped in
        for result in results:
            case = result[layout]
            assert torch.equal(case["hot_ids"], hot_ids) and case["swapped"] == 4
            first, count = case["columns"]
            assert torch.equal(case["head"][:count], dequantized[hot_ids[first : first + count]]), layout


@pytest.mark.multirank
def test_the_start_up_swap_and_refresh_keep_the_draft_ids_and_the_plan_in_step():
    """At TP=2, through the plugin's start-up (``hot_token_id`` a tensor of its own, as on a GPU,
    where it lives on the device and the plan on the host), an adaptive swap and a weight refresh:
    both the draft's ``hot_token_id`` and the plan's ids (which the refresh re-reads rows of) hold
    the swapped-in ids, and every rank's head rows are the updated target rows of those ids."""
    ranges = vocab_shard_ranges(VOCAB, 2)
    hot = [*range(0, ranges[0][1], 7)][:20] + [*range(ranges[1][0], ranges[1][1], 7)][:20]  # both shards
    committed = [ranges[1][0] + 1, ranges[1][0] + 3, 2, 4]  # two ids from each shard, outside the map
    perm = perm_fixture()
    payload = {"vocab": VOCAB, "hidden": 32, "steps": 2, "max_running": 4, "map_ids": hot,
               "committed": committed}  # fmt: skip
    results = run_tp_group(rank_cases_adapt.start_up_swap_refresh, 2, payload,
                           server_args=eagle_map_server_args(perm.draft, perm.token_map("hot"), 2),
                           env={ADAPT_ENV: "1", ADAPT_INTERVAL_ENV: "1"})  # fmt: skip
    # The target's head as rank_cases._target_head loads it (seed 0), after the update.
    updated = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(0)) * 1.5
    for result in results:
        ids = result["hot_token_id"]
        assert set(committed) <= set(ids.tolist())
        assert torch.equal(result["plan_ids"], ids)
        first, count = result["columns"]
        assert torch.equal(result["head"][:count], updated[ids[first : first + count]])
