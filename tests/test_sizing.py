"""``sglang-frspec size``: the sizing model against independent computations, and its CLI."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_frspec.cli import main
from sglang_frspec.core import plan_hot_shards, vocab_shard_ranges
from sglang_frspec.maps import MapBuildError, TokenCounts
from sglang_frspec.maps.sizing import (
    HeadCostModel,
    acceptance_rate,
    calibrated_cost_model,
    chain_accept_length,
    estimate_sizes,
    recommend,
)

VOCAB = 5000


def zipf_counts(vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Zipf-like counts over a shuffled id order (frequent ids are not the small ones)."""
    gen = torch.Generator().manual_seed(seed)
    counts = (1e6 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1).long()
    return counts[torch.randperm(vocab, generator=gen)]


@given(st.floats(1.0, 5.0), st.integers(1, 4))
def test_acceptance_rate_inverts_the_chain_accept_length(accept, steps):
    accept = min(accept, steps + 1.0)
    alpha = acceptance_rate(accept, steps)
    assert 0.0 <= alpha <= 1.0
    assert chain_accept_length(alpha, steps) == pytest.approx(accept, abs=1e-9)


def test_chain_accept_length_is_the_geometric_sum():
    assert chain_accept_length(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert chain_accept_length(0.0, 3) == 1.0 and chain_accept_length(1.0, 3) == 4.0


@pytest.mark.parametrize("layout", ["local", "balanced"])
def test_estimates_match_the_counts_and_the_plan(layout):
    counts = zipf_counts()
    sizes = [64, 500, 2048, VOCAB]
    estimates = estimate_sizes(
        counts, VOCAB, 256, 4, sizes, accept_length=2.5, draft_steps=3, layout=layout, head_share=0.2
    )
    ranked = sorted(range(VOCAB), key=lambda i: (-int(counts[i]), i))  # independent top-N
    full_columns = max(end - start for start, end in vocab_shard_ranges(VOCAB, 4))
    alpha = acceptance_rate(2.5, 3)
    assert [e.size for e in estimates] == sizes
    for e in estimates:
        top = torch.tensor(ranked[: e.size])
        assert e.coverage == pytest.approx(float(counts[top].sum() / counts.sum()))
        assert e.columns == plan_hot_shards(top, VOCAB, 4, layout=layout).width
        assert e.head_mib == e.columns * 256 * 2 / 2**20
        assert e.head_cost == pytest.approx(e.columns / full_columns)
        assert e.step_time == pytest.approx(1 - 0.2 * (1 - e.columns / full_columns))
        assert e.accept_length == pytest.approx(chain_accept_length(alpha * e.coverage, 3))
        assert e.speedup == pytest.approx(e.accept_length / e.step_time / 2.5)
    assert estimates[-1].coverage == 1.0 and estimates[-1].accept_length == pytest.approx(2.5)


def test_accepted_draft_counts_give_the_drafts_kept():
    """Serving counts: acceptance scales with the share of accepted drafts a map keeps, not with its
    coverage. Drafts here are accepted mostly on frequent ids, so a small map keeps more of them than
    it covers of the committed tokens."""
    counts = zipf_counts()
    accepted = counts * counts // counts.max()  # skewed further towards the frequent ids
    sizes = [32, 256, VOCAB]
    estimates = estimate_sizes(
        counts, VOCAB, 64, 2, sizes, accept_length=2.4, draft_steps=3, accepted=accepted, head_share=0.2
    )
    ranked = sorted(range(VOCAB), key=lambda i: (-int(counts[i]), i))
    alpha = acceptance_rate(2.4, 3)
    for e in estimates:
        top = torch.tensor(ranked[: e.size])
        assert e.drafts_kept == pytest.approx(float(accepted[top].sum() / accepted.sum()))
        assert e.accept_length == pytest.approx(chain_accept_length(alpha * e.drafts_kept, 3))
    assert estimates[0].drafts_kept > estimates[0].coverage
    assert estimates[-1].drafts_kept == 1.0 and estimates[-1].accept_length == pytest.approx(2.4)
    without = estimate_sizes(counts, VOCAB, 64, 2, sizes, accept_length=2.4, draft_steps=3, head_share=0.2)
    assert [e.drafts_kept for e in without] == [e.coverage for e in without]
    assert estimates[0].accept_length > without[0].accept_length


def test_given_maps_are_modelled_but_not_recommended():
    counts = zipf_counts()
    gen = torch.Generator().manual_seed(3)
    scattered = torch.randperm(VOCAB, generator=gen)[:700].sort().values
    estimates = estimate_sizes(
        counts, VOCAB, 64, 4, [700], accept_length=2.0, draft_steps=3, token_maps={"mine.pt": scattered}
    )
    top, mine = estimates
    assert (top.token_map, mine.token_map, mine.size) == (None, "mine.pt", 700)
    assert mine.coverage == pytest.approx(float(counts[scattered].sum() / counts.sum()))
    assert mine.columns == plan_hot_shards(scattered, VOCAB, 4, layout="balanced").width
    assert mine.coverage < top.coverage and mine.speedup < top.speedup  # the top 700 cover the most
    assert recommend(estimates) is top
    assert recommend([mine]) is mine  # nothing else to recommend


def test_recommend_takes_the_best_speedup_and_the_smaller_size_on_a_tie():
    counts = zipf_counts()
    estimates = estimate_sizes(
        counts, VOCAB, 256, 2, [128, 256, 1024, 4096], accept_length=3.0, draft_steps=3, head_share=0.3
    )
    best = recommend(estimates)
    assert best.speedup == max(e.speedup for e in estimates)
    assert 1024 <= best.size < VOCAB  # too small loses acceptance, too large saves nothing
    same = estimate_sizes(
        counts, VOCAB, 256, 2, [4096, VOCAB], accept_length=3.0, draft_steps=3, head_share=0.0
    )
    assert recommend(same).size == VOCAB  # no head cost to save: the whole vocab keeps acceptance


def test_no_head_share_ranks_sizes_by_coverage():
    estimates = estimate_sizes(
        zipf_counts(), VOCAB, 64, 2, [16, 64, 256, 1024], accept_length=2.0, draft_steps=2, head_share=0.0
    )
    assert [e.step_time for e in estimates] == [1.0] * 4
    assert sorted(estimates, key=lambda e: e.speedup) == sorted(estimates, key=lambda e: e.coverage)


def test_calibration_fits_fixed_plus_per_row_cost(tmp_path):
    """Timings that are exactly 7 us + 0.002 us/row give back that model; packet, Triton and
    exchange variants are not head GEMMs and are left out."""
    rows = [
        (1, "(a) stock", 16000),
        (1, "(b) local", 9000),
        (1, "(b) balanced", 4000),
        (8, "(b) balanced", 4000),
    ]
    results = [
        {"tp": 2, "rows": r, "variant": v, "head_rows": n, "median_us": 7.0 + 0.002 * n * (r if r > 1 else 1)}
        for r, v, n in rows
    ]
    for variant in ("(b) balanced packet torch", "(b) balanced triton gemv", "(b) balanced+topk"):
        results.append({"tp": 2, "rows": 1, "variant": variant, "head_rows": 4000, "median_us": 99.0})
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"results": results}))
    model = calibrated_cost_model(path, tp=2)
    assert model.fixed == pytest.approx(7.0) and model.per_row == pytest.approx(0.002)
    with pytest.raises(MapBuildError, match="no measurement at tp=4; rerun it with --tp 4"):
        calibrated_cost_model(path, tp=4)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(MapBuildError, match="not a bench_head_gemm.py --json file"):
        calibrated_cost_model(tmp_path / "bad.json", tp=2)


def test_a_fixed_head_cost_makes_small_maps_save_less():
    counts = zipf_counts()
    linear = estimate_sizes(counts, VOCAB, 64, 1, [256], accept_length=2.0, draft_steps=3)[0]
    fixed = estimate_sizes(
        counts, VOCAB, 64, 1, [256], accept_length=2.0, draft_steps=3, cost_model=HeadCostModel(1000.0, 1.0)
    )[0]
    assert fixed.head_cost > linear.head_cost
    full_columns = max(end - start for start, end in vocab_shard_ranges(VOCAB, 1))
    assert fixed.head_cost == pytest.approx((1000 + linear.columns) / (1000 + full_columns))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accept_length": 5.0}, "between 1 and --draft-steps \\+ 1 \\(4\\)"),
        ({"head_share": 1.0}, "--head-share 1.0: must be in \\[0, 1\\)"),
        ({"sizes": [0]}, "size 0: must be between 1"),
        ({"vocab_size": 100}, "do not fit --vocab-size 100: counted with another tokenizer"),
    ],
)
def test_bad_inputs_name_the_problem(kwargs, message):
    args = {"accept_length": 2.0, "sizes": [64], "vocab_size": VOCAB} | kwargs
    with pytest.raises(MapBuildError, match=message):
        estimate_sizes(zipf_counts(), args.pop("vocab_size"), 64, 2, args.pop("sizes"), draft_steps=3, **args)


def test_counts_past_the_vocab_fit_when_never_counted(tmp_path, capsys):
    """A tokenizer may add tokens past the model's vocab (Gemma 3's <image_soft_token> at id 262144
    of 262144-id text models): corpus counts then span one id more, never counted."""
    counts = torch.cat([zipf_counts(), torch.zeros(1, dtype=torch.int64)])
    estimates = estimate_sizes(counts, VOCAB, 64, 2, [64, VOCAB], accept_length=2.0, draft_steps=3)
    reference = estimate_sizes(counts[:VOCAB], VOCAB, 64, 2, [64, VOCAB], accept_length=2.0, draft_steps=3)
    assert estimates == reference
    path = str(tmp_path / "counts.pt")
    TokenCounts(counts, 10, None, (2,), ("corpus.txt",), "text").save(path)
    args = ["size", "--counts", path, "--vocab-size", str(VOCAB), "--hidden", "64", "--tp", "2", "--json"]
    assert main(args) == 0
    assert [s["size"] for s in json.loads(capsys.readouterr().out)["sizes"]][-2:] == [4096, VOCAB]
    counts[VOCAB] = 1
    with pytest.raises(MapBuildError, match=f"ids \\[{VOCAB}\\] past it were counted"):
        estimate_sizes(counts, VOCAB, 64, 2, [64], accept_length=2.0, draft_steps=3)


def _counts_file(tmp_path) -> str:
    path = str(tmp_path / "counts.pt")
    TokenCounts(zipf_counts(), 10, None, (2,), ("corpus.txt",), "text").save(path)
    return path


def test_cli_prints_the_table_and_the_recommendation(tmp_path, capsys):
    counts = _counts_file(tmp_path)
    args = ["size", "--counts", counts, "--vocab-size", str(VOCAB), "--hidden", "4096", "--tp", "2"]
    assert main([*args, "--plot", str(tmp_path / "size.png")]) == 0
    text = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = next(s for s in report["sizes"] if s["size"] == report["recommended"])
    assert f"{best['size']:>8} {best['coverage']:>8.2%}" in text and "<- recommended" in text
    assert [s["size"] for s in report["sizes"]] == [64, 128, 256, 512, 1024, 2048, 4096, VOCAB]
    assert (tmp_path / "size.png").stat().st_size > 10_000


def test_cli_on_serving_counts_takes_their_accept_length_and_steps(tmp_path, capsys):
    counts = zipf_counts()
    path = str(tmp_path / "served.counts.pt")
    served = {"verify_rows": 100, "accept_length": 2.25, "num_steps": 2, "topk": 1, "hot_ids": 4096}
    TokenCounts(counts, 0, None, (2,), ("served",), "", accepted=counts // 2, speculative=served).save(path)
    token_map = str(tmp_path / "map.pt")
    torch.save(torch.arange(300, 0, -1), token_map)
    args = ["size", "--counts", path, "--vocab-size", str(VOCAB), "--hidden", "64", "--tp", "2"]
    assert main([*args, "--sizes", "256", "--map", token_map, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["accept_length"], report["draft_steps"]) == (2.25, 2)
    assert "accepted drafts kept" in report["acceptance"] and "4096-id map" in report["acceptance"]
    assert [(s["size"], s["token_map"]) for s in report["sizes"]] == [(256, None), (300, token_map)]
    assert main([*args, "--sizes", "256", "--map", token_map, "--accept-length", "3.0"]) == 0
    text = capsys.readouterr().out
    assert "accept length 3 over 2 steps" in text and text.count(token_map) == 1
    torch.save(torch.tensor([1, VOCAB + 3]), token_map)
    assert main([*args, "--map", token_map]) == 2
    assert f"id(s) >= the target's vocab size {VOCAB}" in capsys.readouterr().err


def test_cli_refuses_a_bad_accept_length(tmp_path, capsys):
    args = [
        "size",
        "--counts",
        _counts_file(tmp_path),
        "--vocab-size",
        str(VOCAB),
        "--hidden",
        "64",
        "--tp",
        "2",
    ]
    assert main([*args, "--accept-length", "0.5"]) == 2
    assert "must be between 1 and --draft-steps + 1" in capsys.readouterr().err
