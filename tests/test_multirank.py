"""The plugin's draft logits on real SGLang gloo TP groups, against the single-rank reference."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import canonical_hot_ids, vocab_shard_ranges
from tests import rank_cases
from tests.harness.tp_group import run_tp_group

pytestmark = pytest.mark.multirank

VOCAB, HIDDEN, ROWS, TOPK = 5003, 48, 6, 4  # 5003: not a multiple of 64


def _maps(tp: int) -> dict[str, list[int]]:
    """Skewed, uniform and adversarial maps for this TP size."""
    gen = torch.Generator().manual_seed(tp)
    ranges = vocab_shard_ranges(VOCAB, tp)
    first_end, last_start = ranges[0][1], ranges[-1][0]
    # BPE-like skew: frequent (hot) tokens concentrate at low ids.
    weights = 1.0 / (torch.arange(VOCAB, dtype=torch.float64) + 50.0)
    skewed = torch.multinomial(weights, 600, replacement=False, generator=gen)
    boundaries = [i for s, e in ranges for i in (s, s + 1, e - 1) if s < e]
    return {
        "skewed": skewed.tolist(),
        "uniform": torch.randperm(VOCAB, generator=gen)[:500].tolist(),
        # One rank holds every hot id, the others none (idle ranks still join collectives).
        "all_on_rank0": torch.randperm(first_end, generator=gen)[:300].tolist(),
        "all_on_last": (last_start + torch.randperm(VOCAB - last_start, generator=gen)[:77]).tolist(),
        # Ids at 0, V-1 and every shard boundary, listed unsorted with duplicates.
        "adversarial": [VOCAB - 1, *boundaries, 0, 0, VOCAB - 1],
        # H <= topk: the top-k packet cannot apply, the processor must fall back to the full gather.
        "topk_equals_h": [VOCAB - 1, 2, 777, first_end][:TOPK],
        "below_topk": [VOCAB - 1, 0, 0],
    }


def _expected_exchange(requested: str, ids: list[int]) -> str:
    """The exchange the processor must run: top-k only where 0 < topk < H."""
    return requested if 0 < TOPK < len(set(ids)) else "full"


def _owned_counts(ids: list[int], ranges) -> list[int]:
    """Distinct ids inside each SGLang shard range, counted directly."""
    distinct = set(ids)
    return [sum(start <= i < end for i in distinct) for start, end in ranges]


def _check_group(results: list[dict], tp: int, dtype: str, maps: dict[str, list[int]]) -> None:
    assert [r["rank"] for r in results] == list(range(tp))
    assert results[0]["ranges"] == vocab_shard_ranges(VOCAB, tp)  # SGLang's shards == our math
    cases = [key for key in results[0] if isinstance(key, tuple)]
    assert len(cases) == len(maps) * 2 * 2
    for key in cases:
        name, layout, exchange = key
        # The exchange named in the case really ran (a silent fallback to full would pass below).
        assert [r[key]["exchange"] for r in results] == [_expected_exchange(exchange, maps[name])] * tp, key
        logits = [r[key]["logits"] for r in results]
        reference = results[0][key]["reference"]
        for other in logits[1:]:  # bit-identical on every rank
            assert torch.equal(logits[0], other), key
        got = logits[0]
        assert got.dtype == torch.float32 and got.is_contiguous(), key
        assert got.shape == reference.shape, key
        if exchange == "full":
            if dtype == "float32":
                torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-4, msg=str(key))
            else:
                scale = reference.abs().max().item()
                torch.testing.assert_close(got, reference, rtol=1e-2, atol=8e-3 * scale, msg=str(key))
        elif _expected_exchange(exchange, maps[name]) == "full":  # the fallback is the full gather
            assert torch.equal(got, results[0][(name, layout, "full")]["logits"]), key
        else:  # the top-k packet must reproduce the full logits' top-k exactly
            full = results[0][(name, layout, "full")]["logits"]
            want_p, want_i = torch.softmax(full, -1).topk(TOPK, dim=-1)
            got_p, got_i = torch.softmax(got, -1).topk(TOPK, dim=-1)
            # Same ids, except that exact ties (common in bf16) may break either way.
            assert torch.equal(full.gather(1, got_i), full.gather(1, want_i)), key
            assert (got_i == want_i).float().mean() > 0.9, key
            torch.testing.assert_close(got_p, want_p, rtol=1e-4, atol=1e-6, msg=str(key))
        counts = results[0][key]["counts"]
        if layout == "local":  # each rank computes exactly the hot ids of its own shard
            assert list(counts) == _owned_counts(maps[name], results[0]["ranges"]), key
        else:  # equal slices of the hot order
            assert sum(counts) == len(set(maps[name])) and max(counts) - min(counts) <= 1, key
            assert {r[key]["local_rows"] for r in results} == {max(counts)}, key


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_hot_logits_match_single_rank_reference(tp):
    maps = _maps(tp)
    results = run_tp_group(
        rank_cases.hot_logits,
        tp,
        {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "rows": ROWS,
            "topk": TOPK,
            "maps": maps,
            "layouts": ["local", "balanced"],
            "exchanges": ["full", "topk"],
        },
    )
    _check_group(results, tp, "float32", maps)
    # The skewed map really is skewed under the local layout (that is what balanced fixes).
    local = results[0][("skewed", "local", "full")]["counts"]
    assert max(local) > 1.5 * sum(local) / tp


def test_hot_logits_bf16_and_idle_rows():
    results = run_tp_group(
        rank_cases.hot_logits,
        2,
        {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "rows": ROWS,
            "topk": TOPK,
            "maps": _maps(2),
            "layouts": ["local", "balanced"],
            "exchanges": ["full", "topk"],
            "dtype": "bfloat16",
        },
    )
    _check_group(results, 2, "bfloat16", _maps(2))
    idle = run_tp_group(
        rank_cases.hot_logits,
        2,
        {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "rows": 0,
            "topk": TOPK,
            "maps": _maps(2),
            "layouts": ["local", "balanced"],
            "exchanges": ["full", "topk"],
        },
    )
    for key in [k for k in idle[0] if isinstance(k, tuple)]:
        assert idle[0][key]["logits"].shape == (0, len(set(_maps(2)[key[0]])))


def test_ranks_with_different_maps_fail_together_naming_both_digests():
    maps = [list(range(10, 200)), list(range(10, 201))]
    errors = run_tp_group(rank_cases.agree, 2, {"vocab": VOCAB, "maps": maps})
    digests = [canonical_hot_ids(torch.tensor(m), VOCAB).digest[:16] for m in maps]
    for error in errors:
        assert "different token maps" in error
        assert all(d in error for d in digests)


def test_one_rank_with_a_bad_map_fails_every_rank():
    maps = [list(range(10, 200)), [5, VOCAB + 7]]
    errors = run_tp_group(rank_cases.agree, 2, {"vocab": VOCAB, "maps": maps})
    for error in errors:
        assert "TP rank 1 of 2" in error and f">= the target's vocab size {VOCAB}" in error


def test_dp_lm_head_shards_over_the_attention_tp_group():
    """tp=4 with 2 DP-attention ranks and --enable-dp-lm-head: attention-TP groups of 2."""
    hot = _maps(2)["skewed"]
    results = run_tp_group(
        rank_cases.dp_lm_head_logits,
        4,
        {"vocab": VOCAB, "hidden": HIDDEN, "map": hot},
        server_args={"enable_dp_attention": True, "dp_size": 2, "enable_dp_lm_head": True},
    )
    assert [(r["attn_dp_rank"], r["shard_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["group"] == "attn_tp" and r["ranges"] == vocab_shard_ranges(VOCAB, 2)
        for layout in ("local", "balanced"):
            torch.testing.assert_close(r[layout], r["reference"], rtol=1e-5, atol=1e-4)
    for group in (results[:2], results[2:]):  # identical within each attention-TP group
        assert torch.equal(group[0]["local"], group[1]["local"])
        assert torch.equal(group[0]["balanced"], group[1]["balanced"])


@pytest.mark.parametrize("rows_per_dp_rank", [[3, 2], [4, 0]], ids=["both-busy", "one-idle"])
def test_dp_attention_without_dp_lm_head_gathers_rows_over_the_tp_group(rows_per_dp_rank):
    """tp=4 with 2 DP-attention ranks, head sharded over all 4 ranks: hidden rows are gathered
    across DP ranks for the head, and each rank gets back the hot logits of its own rows."""
    hot = _maps(4)["skewed"]
    results = run_tp_group(
        rank_cases.dp_attention_logits,
        4,
        {"vocab": VOCAB, "hidden": HIDDEN, "map": hot, "rows_per_dp_rank": rows_per_dp_rank},
        server_args={"enable_dp_attention": True, "dp_size": 2},
    )
    assert [r["attn_dp_rank"] for r in results] == [0, 0, 1, 1]
    for r in results:
        assert r["group"] == "tp" and r["ranges"] == vocab_shard_ranges(VOCAB, 4)
        assert r["reference"].shape[0] == rows_per_dp_rank[r["attn_dp_rank"]]
        torch.testing.assert_close(r["local/full"], r["reference"], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(r["balanced/full"], r["reference"], rtol=1e-5, atol=1e-4)
        for layout in ("local", "balanced"):  # the top-k exchange keeps the top-2 ids and probabilities
            topk = r[f"{layout}/topk"]
            if topk.shape[0]:
                assert torch.equal(topk.topk(2).indices, r["reference"].topk(2).indices)
                torch.testing.assert_close(
                    topk.softmax(-1).topk(2).values, r["reference"].softmax(-1).topk(2).values
                )


def test_degenerate_rows_give_every_rank_the_same_in_range_picks():
    """Zero, NaN, all -inf rows and rows with fewer than k finite logits, at TP=2 with one rank
    holding fewer than k hot ids (so its top-k packet carries fillers). A filler (value -inf)
    once overwrote hot column 0 when a row's top-k had to take -inf candidates."""
    ranges = vocab_shard_ranges(VOCAB, 2)
    ids = [0, 5, 9, 17, 40, 41, 300, ranges[1][0] + 3]  # rank 1 holds 1 < TOPK hot ids (local)
    finite_ids = [0, 9]  # row 3: 2 < TOPK finite logits, one of them hot column 0
    results = run_tp_group(
        rank_cases.degenerate_rows,
        2,
        {"vocab": VOCAB, "hidden": HIDDEN, "topk": TOPK, "ids": ids, "finite_ids": finite_ids},
    )
    reference, hot = results[0]["reference"], results[0]["hot"]
    assert torch.isnan(reference[1]).all() and torch.isneginf(reference[2]).all()
    assert torch.isfinite(reference[3]).sum() == len(finite_ids)
    assert results[0][("local", "topk")]["counts"] == (7, 1)  # the rank with fewer than k ids
    for layout in ("local", "balanced"):
        for exchange in ("full", "topk"):
            key = (layout, exchange)
            assert [r[key]["exchange"] for r in results] == [exchange] * 2, key
            logits, picked = results[0][key]["logits"], results[0][key]["picked"]
            for other in results[1:]:  # identical on every rank, NaNs included
                assert torch.equal(other[key]["logits"].nan_to_num(), logits.nan_to_num()), key
                assert torch.equal(other[key]["picked"], picked), key
            assert picked.shape == (6, TOPK) and bool(((picked >= 0) & (picked < len(hot))).all()), key
            assert torch.isnan(logits[1]).all(), key
            # Zero, all -inf and fewer-than-k-finite rows come out as the reference: the top-k
            # packet holds every finite value, and its fill is -inf (0 for the zero row).
            torch.testing.assert_close(logits[[0, 2, 3]], reference[[0, 2, 3]], rtol=1e-5, atol=1e-4,
                                       msg=str(key))  # fmt: skip
            if exchange == "full":
                torch.testing.assert_close(logits[4:], reference[4:], rtol=1e-5, atol=1e-4, msg=str(key))
            else:  # ordinary rows: the reference's top-k values at their columns
                want = reference[4:].topk(TOPK, dim=-1)
                torch.testing.assert_close(logits[4:].gather(1, want.indices), want.values, msg=str(key))
