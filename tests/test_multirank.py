"""The plugin's draft logits on real SGLang gloo TP groups, against the single-rank reference."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_frspec.core import canonical_hot_ids, vocab_shard_ranges
from sglang_frspec.demo.fixtures import perm_fixture
from tests import rank_cases
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_graphs import eagle_map_server_args

pytestmark = pytest.mark.multirank

VOCAB, HIDDEN, ROWS, TOPK = 5003, 48, 6, 4  # 5003: not a multiple of 64


FILE_IDS = [2, 300, 5, 9, 5, 17, 2, 40]  # a map file's ids, unsorted with duplicates
# Each case: one map per rank of a TP=2 group, and the group's PD mode.
AGREEMENT_CASES = {
    "different maps": {"maps": [list(range(10, 200)), list(range(10, 201))], "mode": "null"},
    # Rank 1 loads a permuted copy of rank 0's map, off PD and on a PD decode node.
    "file order, null": {"maps": [FILE_IDS, FILE_IDS[::-1]], "mode": "null"},
    "file order, decode": {"maps": [FILE_IDS, FILE_IDS[::-1]], "mode": "decode"},
    "bad map on rank 1": {"maps": [list(range(10, 200)), [5, VOCAB + 7]], "mode": "null"},
}


@pytest.fixture(scope="module")
def agreement() -> dict[str, list[str]]:
    """Each case of ``AGREEMENT_CASES``, run in turn on one TP=2 group: each rank runs the plugin's
    start-up with its own map's ids (``rank_cases.agree``); per case, each rank's error text, or
    "agreed"."""
    perm = perm_fixture()
    server_args = eagle_map_server_args(perm.draft, perm.token_map("hot"), 2)
    payload = {"vocab": VOCAB, "hidden": HIDDEN, "steps": 2, "max_running": 4, "cases": AGREEMENT_CASES}
    results = run_tp_group(rank_cases.agree, 2, payload, server_args=server_args)
    return {name: [r[name] for r in results] for name in AGREEMENT_CASES}


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


def nan_as_neg_inf(logits: torch.Tensor) -> torch.Tensor:
    return logits.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)


def lower_index_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The exchange's rule, computed independently: the k largest logits, ties to the lower hot
    index, NaN ranked as -inf (a stable sort), as int64 [rows, k] hot indices."""
    return torch.sort(nan_as_neg_inf(logits), dim=1, descending=True, stable=True).indices[:, :k]


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: whether two [rows, k] index tensors hold the same set."""
    return (a.sort(1).values == b.sort(1).values).all(1)


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
            want_i = lower_index_topk(full, TOPK)  # exact ties (common in bf16): the lower index
            got_p, got_i = torch.softmax(got, -1).topk(TOPK, dim=-1)
            assert bool(_same_ids(got_i, want_i).all()), key
            assert torch.equal(got.gather(1, want_i), full.gather(1, want_i)), key
            torch.testing.assert_close(got_p, torch.softmax(full, -1).gather(1, got_i), rtol=1e-4, atol=1e-6,
                                       msg=str(key))  # fmt: skip
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


def test_ranks_with_different_maps_fail_together_naming_both_digests(agreement):
    maps = AGREEMENT_CASES["different maps"]["maps"]
    digests = [canonical_hot_ids(torch.tensor(m), VOCAB).digest[:16] for m in maps]
    for error in agreement["different maps"]:
        assert "different token maps" in error
        assert all(d in error for d in digests)


@pytest.mark.parametrize("mode", ["null", "decode"])
def test_ranks_of_a_pd_node_agree_on_the_map_files_order(agreement, mode):
    """Rank 1 loads a permuted copy of rank 0's map. Off PD the plugin uses the sorted ids only: the
    ranks agree. A PD node ships and reads positions in the file: both ranks refuse, naming why."""
    errors = agreement[f"file order, {mode}"]
    if mode == "null":
        assert errors == ["agreed", "agreed"]
        return
    for error in errors:
        assert "prefill/decode: the TP ranks loaded the same hot ids in different orders" in error
        assert "Copy one map file to every rank of every prefill and decode node" in error


def test_one_rank_with_a_bad_map_fails_every_rank(agreement):
    for error in agreement["bad map on rank 1"]:
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
            # The NaN row: all NaN in the full logits; in the top-k exchange's NaN outside its
            # top-k (NaN ranks as -inf there). SGLang's softmax is NaN everywhere for both, so
            # the draft picks the same ids from either.
            assert bool(torch.softmax(logits[1], -1).isnan().all()), key
            assert int(logits[1].isnan().sum()) >= len(hot) - TOPK, key
            assert torch.equal(picked[1], results[0][(layout, "full")]["picked"][1]), key
            # Zero, all -inf and fewer-than-k-finite rows come out as the reference: the top-k
            # packet holds every finite value, and its fill is -inf (0 for the zero row).
            torch.testing.assert_close(logits[[0, 2, 3]], reference[[0, 2, 3]], rtol=1e-5, atol=1e-4,
                                       msg=str(key))  # fmt: skip
            if exchange == "full":
                torch.testing.assert_close(logits[4:], reference[4:], rtol=1e-5, atol=1e-4, msg=str(key))
            else:  # ordinary rows: the reference's top-k values at their columns
                want = reference[4:].topk(TOPK, dim=-1)
                torch.testing.assert_close(logits[4:].gather(1, want.indices), want.values, msg=str(key))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Float tensors as their bits (NaN equals NaN of the same bits), others as they are."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _tie_rows(num_hot: int) -> dict[str, torch.Tensor]:
    """[rows, H] float32 logits where ties, the fill and NaN matter, by kind."""
    gen = torch.Generator().manual_seed(7)

    def randn(rows: int) -> torch.Tensor:
        return torch.randn(rows, num_hot, generator=gen)

    def where(rows: torch.Tensor, fraction: float, value: float) -> torch.Tensor:
        return rows.masked_fill(torch.rand(rows.shape, generator=gen) < fraction, value)

    signed_zero = -1.0 - torch.rand(8, num_hot, generator=gen)  # six zeros on top, both signs
    for row in signed_zero:
        row[torch.randperm(num_hot, generator=gen)[:6]] = torch.tensor([0.0, -0.0]).repeat(3)
    neg_inf = torch.cat([where(randn(10), 0.7, -math.inf), where(randn(4), 0.995, -math.inf)])
    neg_inf[-1] = -math.inf
    neg_inf[-1, [3, num_hot - 2]] = 1.5  # two finite logits, fewer than k
    negative_nan = torch.tensor(-math.inf) * 0.0  # what x86 gives for 0 * inf: a NaN with the sign bit
    nan = torch.cat([where(randn(4), 0.2, math.nan), where(randn(4), 0.2, negative_nan.item()), randn(4)])
    nan[-4] = -math.inf
    nan[-4, [0, 5, 300]] = torch.tensor([math.nan, 1.0, 1.0])  # a NaN the top-k takes (as -inf)
    nan[-3, 7] = math.nan  # one NaN
    nan[-2] = math.nan
    nan[-2, [1, 40]] = 2.0  # NaN but two columns
    nan[-1] = math.nan  # all NaN
    return {
        "bf16": (randn(120) * 2).to(torch.bfloat16).float(),  # exact ties at the k-th in some rows
        "grid": torch.randint(0, 8, (40, num_hot), generator=gen).float() * 0.25,  # ties everywhere
        # Near-uniform float32: the fill rounds onto the k-th value, or nearer than softmax resolves.
        "near_uniform": torch.cat([0.3 + 3e-8 * randn(40), 0.01 + 1e-7 * randn(40)]),
        "signed_zero": signed_zero,
        "neg_inf": neg_inf,
        "nan": nan,
    }


@pytest.mark.parametrize("tp", [2, 3])
def test_topk_exchange_ties_near_uniform_and_nan_rows(tp):
    """The top-k exchange against the full one on rows where the choice among equal values or
    the fill decides: its picks are the k largest logits, ties to the lower hot index (the
    merge once broke cross-rank ties by rank order), never a fill column (the fill could round
    onto the k-th value, and softmax merges logits closer than ~1e-7), and NaN rows stay NaN
    under SGLang's softmax, with the full exchange's picks."""
    gen = torch.Generator().manual_seed(tp)
    ids = torch.randperm(VOCAB, generator=gen)[:600].sort().values
    kinds = _tie_rows(len(ids))
    logits = torch.cat(list(kinds.values()))
    kind_of = [name for name, rows in kinds.items() for _ in range(rows.shape[0])]
    ks = (1, 4)
    payload = {"vocab": VOCAB, "ids": ids.tolist(), "logits": logits, "ks": ks}
    results = run_tp_group(rank_cases.exchange_ties, tp, payload)
    has_nan = logits.isnan().any(1)
    rule_kth = nan_as_neg_inf(logits).gather(1, lower_index_topk(logits, max(ks)))
    grid_kinds = torch.tensor([kind in ("bf16", "grid", "signed_zero", "neg_inf") for kind in kind_of])
    for layout in ("local", "balanced"):
        for k in ks:
            case = results[0][(layout, k)]
            for other in results[1:]:  # bit-identical on every rank, NaNs included
                for name, value in case.items():
                    assert torch.equal(_bits(value), _bits(other[(layout, k)][name])), (layout, k, name)
            assert torch.equal(_bits(case["full"]), _bits(logits))
            got, rule = case["topk"], lower_index_topk(logits, k)
            kth = rule_kth[:, k - 1]
            ordinary = ~has_nan & (kth > -math.inf)
            # The draft's picks are the rule's ids, with the full logits' values at them.
            same = _same_ids(case["topk_picks"], rule)
            assert bool(same[ordinary].all()), (layout, k, [kind_of[i] for i in (~same & ordinary).nonzero()])
            assert torch.equal(got.gather(1, rule)[~has_nan], logits.gather(1, rule)[~has_nan])
            # Every other column holds one fill, at least FILL_GAP below the k-th value.
            fill = got.scatter(1, rule, -math.inf).amax(1)
            assert bool((fill[ordinary] <= kth[ordinary] - 2**-20).all()), (layout, k)
            torch.testing.assert_close(torch.softmax(got, -1).gather(1, rule)[ordinary],
                                       torch.softmax(logits, -1).gather(1, rule)[ordinary],
                                       rtol=1e-5, atol=1e-9)  # fmt: skip
            # Fewer than k finite logits: the top-k holds them all, and the row is the full one.
            assert torch.equal(got[~has_nan & ~ordinary], logits[~has_nan & ~ordinary])
            # Top-1 (the CPU draft's argmax, first of equal maxima) as the full exchange's.
            assert torch.equal(case["topk_argmax"][~has_nan], case["full_argmax"][~has_nan]), (layout, k)
            # Against the full exchange's own top-k: on value grids, the same values, and the same
            # ids unless values tie at the k-th (torch.topk breaks those ties as it likes).
            full_picks, picks = case["full_picks"], case["topk_picks"]
            picked_values = [logits.gather(1, p).sort(1).values for p in (full_picks, picks)]
            on_grid = grid_kinds & ordinary
            assert torch.equal(picked_values[0][on_grid], picked_values[1][on_grid]), (layout, k)
            tied_at_kth = (logits == kth[:, None]).sum(1) > (logits.gather(1, rule) == kth[:, None]).sum(1)
            assert bool(_same_ids(full_picks, picks)[on_grid & ~tied_at_kth].all()), (layout, k)
            # NaN rows: NaN outside the top-k (softmax NaN everywhere, as for the full logits), the
            # top-k of the other values (NaN as -inf) at their columns, and the full exchange's picks.
            nan_rows = got[has_nan]
            rule_nan = rule[has_nan]
            assert torch.equal(nan_rows.gather(1, rule_nan),
                               nan_as_neg_inf(logits[has_nan]).gather(1, rule_nan))  # fmt: skip
            assert bool(nan_rows.scatter(1, rule_nan, math.nan).isnan().all()), (layout, k)
            assert bool(torch.softmax(nan_rows, -1).isnan().all()), (layout, k)
            assert torch.equal(full_picks[has_nan], picks[has_nan]), (layout, k)
