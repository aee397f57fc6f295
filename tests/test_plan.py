"""Shard plans against SGLang's own VocabParallelEmbedding, and the plan's invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_frspec.core import (
    TokenMapError,
    plan_from_ranges,
    plan_hot_shards,
    vocab_shard_ranges,
)

VOCAB_TP_PAIRS = [
    (128256, 1),
    (128256, 2),
    (128256, 4),
    (128256, 8),
    (151936, 3),
    (151936, 8),
    (152064, 7),
    (32000, 2),
    (32000, 6),
    (1010, 2),
    (5003, 3),
    (65, 2),
    (100, 8),
    (64, 64),
    (248320, 4),
    (50257, 5),
    (7, 3),
]


def sglang_ranges(vocab: int, tp: int, padding: int = 64) -> tuple:
    """Each rank's original-vocab range, read from a real ParallelLMHead built as that rank."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    ranges = []
    for rank in range(tp):
        with get_parallel().override(tp_rank=rank, tp_size=tp):
            shard = ParallelLMHead(vocab, 1, padding_size=padding).shard_indices
        ranges.append((shard.org_vocab_start_index, shard.org_vocab_end_index))
    return tuple(ranges)


@pytest.mark.parametrize(("vocab", "tp"), VOCAB_TP_PAIRS)
def test_ranges_match_sglang(vocab, tp):
    assert vocab_shard_ranges(vocab, tp) == sglang_ranges(vocab, tp)


@pytest.mark.parametrize("padding", [16, 128])
def test_ranges_match_sglang_with_other_padding(padding):
    for vocab, tp in [(5003, 3), (151936, 3), (1010, 2)]:
        assert vocab_shard_ranges(vocab, tp, padding) == sglang_ranges(vocab, tp, padding)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 300_000), tp=st.integers(1, 16))
def test_ranges_match_sglang_random(vocab, tp):
    assert vocab_shard_ranges(vocab, tp) == sglang_ranges(vocab, tp)


@pytest.mark.parametrize(("vocab", "tp"), [(128256, 4), (128256, 8), (151936, 3), (5003, 3)])
def test_plan_edges_land_on_the_owning_rank(vocab, tp):
    """owned_rows against SGLang's own loader: each rank's ParallelLMHead is loaded from a
    checkpoint whose row i holds i, so the local rows the plan names must hold the rank's ids."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    ranges = sglang_ranges(vocab, tp)
    edges = sorted({0, vocab - 1} | {i for s, e in ranges for i in (s, e - 1) if s < e})
    plan = plan_hot_shards(edges, vocab, tp, layout="local")
    checkpoint = torch.arange(vocab, dtype=torch.float64).unsqueeze(1)  # exact ids up to 2**53
    for rank, (start, end) in enumerate(ranges):
        with get_parallel().override(tp_rank=rank, tp_size=tp):
            head = ParallelLMHead(vocab, 1, params_dtype=torch.float64)
            head.weight_loader(head.weight, checkpoint)
        rows = plan.owned_rows(rank)
        assert head.weight[rows, 0].long().tolist() == [i for i in edges if start <= i < end], rank


def test_llama3_example_from_the_reference_table():
    # The anchors' Llama-3 TP=4 estimate: 19273/8142/4745/608 hot ids per rank.
    ranges = vocab_shard_ranges(128256, 4)
    counts = [19273, 8142, 4745, 608]
    ids = torch.cat([torch.arange(s, s + n) for (s, _), n in zip(ranges, counts)])
    local = plan_hot_shards(ids, 128256, 4, layout="local")
    assert local.counts == tuple(counts) and local.width == 19280
    assert local.imbalance == pytest.approx(2.35, abs=0.01)
    balanced = plan_hot_shards(ids, 128256, 4, layout="balanced")
    assert balanced.counts == (8192,) * 4 and balanced.width == 8192
    assert balanced.compaction_is_slice and balanced.imbalance == 1.0
    assert local.gathered_bytes_per_row(2) == 4 * 19280 * 2


def test_plan_canonicalises_frspec_lists():
    plan = plan_hot_shards([9, 2, 2, 7, 0], 10, 2)
    assert plan.hot_ids.tolist() == [0, 2, 7, 9]


@pytest.mark.parametrize("bad", [[-1, 3], [3, 10], [0, 12, 13]])
def test_plan_rejects_out_of_range_ids(bad):
    with pytest.raises(TokenMapError, match="vocab size 10|negative"):
        plan_hot_shards(bad, 10, 2)


@st.composite
def plan_inputs(draw):
    vocab = draw(st.integers(1, 40_000))
    tp = draw(st.integers(1, 8))
    padding = draw(st.sampled_from([8, 16, 64, 128]))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=300))
    layout = draw(st.sampled_from(["local", "balanced"]))
    return vocab, tp, padding, ids, layout


@settings(max_examples=300, deadline=None)
@given(plan_inputs())
def test_plan_invariants(inputs):
    vocab, tp, padding, ids, layout = inputs
    plan = plan_hot_shards(ids, vocab, tp, padding_size=padding, layout=layout)
    hot = plan.hot_ids
    assert hot.tolist() == sorted(set(ids))
    # The shard ranges tile the vocab in rank order.
    assert plan.shard_ranges[0][0] == 0 and plan.shard_ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(plan.shard_ranges, plan.shard_ranges[1:]))
    # Every hot id is owned by exactly one rank (its vocab shard) and computed by exactly one.
    owners = [sum(s <= i < e for s, e in plan.shard_ranges) for i in hot.tolist()]
    assert owners == [1] * len(hot)
    assert list(plan.owned_counts) == [sum(s <= i < e for i in set(ids)) for s, e in plan.shard_ranges]
    assert sum(plan.counts) == plan.num_hot
    assert all(0 <= c <= plan.width for c in plan.counts)
    # Compaction restores hot order from a rank-major gather, and never picks a padding slot.
    gathered = torch.full((tp, plan.width), -1, dtype=torch.int64)
    for rank in range(tp):
        first, count = plan.offsets[rank], plan.counts[rank]
        gathered[rank, :count] = hot[first : first + count]
    assert torch.equal(gathered.flatten()[plan.gather_columns], hot)
    assert plan.compaction_is_slice == torch.equal(plan.gather_columns, torch.arange(plan.num_hot))
    if layout == "local":
        assert plan.counts == plan.owned_counts and plan.width % 8 == 0
    else:
        assert max(plan.counts) - min(plan.counts) <= 1
        assert all(plan.width - c <= 1 for c in plan.counts)  # at most one padding slot per rank


def test_plan_from_ranges_rejects_ids_outside_the_ranges():
    with pytest.raises(ValueError, match="outside every shard range"):
        plan_from_ranges(torch.tensor([1, 50]), ((0, 10), (10, 20)))
