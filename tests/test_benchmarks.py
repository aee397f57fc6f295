"""The benchmark scripts run end to end in a smoke mode (tiny sizes); timings are not checked."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


sys.path.insert(0, str(BENCH))
import cycle_profile  # noqa: E402
from common import local_path, median_interval, shown_path, shown_paths  # noqa: E402


@pytest.mark.parametrize(
    ("n", "ranks"), [(5, (1, 5)), (6, (1, 6)), (10, (2, 9)), (30, (10, 21)), (100, (40, 61))]
)
def test_median_interval_is_the_binomial_order_statistic_interval(n, ranks):
    """Textbook 95% ranks (1-based) of the distribution-free median interval; shuffled input."""
    samples = [float(x) for x in range(1, n + 1)][::-1]
    assert median_interval(samples) == tuple(float(r) for r in ranks)


def test_results_show_paths_relative_to_the_repository_or_a_named_root(monkeypatch, tmp_path):
    """What results print for a path: never absolute (they read the same on every machine), the
    fixture cache's folders under ``<cache>``, and back to this machine's path for a map."""
    monkeypatch.setenv("SGLANG_FRSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", "/home/someone")
    tmp = Path(tempfile.gettempdir())
    cases = {
        BENCH / "common.py": "benchmarks/common.py",
        BENCH.parent: ".",
        tmp_path / "cache" / "fixtures" / "perm-1" / "target": "<cache>/perm-1/target",
        tmp / "run-1" / "logs": "<tmp>/run-1/logs",
        "/home/someone/maps/m.pt": "~/maps/m.pt",
        "/srv/data/logs": ".../logs",
    }
    for path, shown in cases.items():
        assert shown_path(path) == shown, path
        if shown.startswith(("<", "~")):
            assert local_path(shown) == str(path)
    assert local_path("code_128") == "code_128"  # a fixture map's name
    data = {"log_dir": str(tmp / "run-1" / "logs"), "maps": ["code_128", BENCH / "m.pt"], "tp": [1, 2]}
    assert shown_paths(data) == {
        "log_dir": "<tmp>/run-1/logs",
        "maps": ["code_128", "benchmarks/m.pt"],
        "tp": [1, 2],
    }


def run(script: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.multirank
def test_bench_draft_head_smoke(tmp_path):
    out = run("bench_draft_head.py", "--tp", "2", "--vocab", "5003", "--hot", "700", "--hidden", "64",
              "--rows", "1", "4", "--repeats", "2", "--iters", "1", "--json", str(tmp_path / "r.json"),
              "--plot", str(tmp_path / "r.png"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "r.json").read_text())
    variants = {r["variant"] for r in data["results"]}
    assert variants == {"(a) stock full vocab", "(c) tp1 fr-spec head", "(b) local/full", "(b) local/topk",
                        "(b) local/auto", "(b) balanced/full", "(b) balanced/topk",
                        "(b) balanced/auto"}  # fmt: skip
    # auto runs what the rule picks for each row count (on CPU: topk), and gathers its bytes.
    auto = {r["rows"]: r for r in data["results"] if r["variant"] == "(b) balanced/auto"}
    topk = {r["rows"]: r for r in data["results"] if r["variant"] == "(b) balanced/topk"}
    assert {rows: r["exchange"] for rows, r in auto.items()} == {1: "topk", 4: "topk"}
    assert all(
        auto[rows]["bytes_per_step"] == topk[rows]["bytes_per_step"] == rows * 2 * 9 * 4 for rows in auto
    )
    assert data["facts"]["(b) balanced/full"]["columns"] == [350, 350]
    assert sum(data["facts"]["(b) local/full"]["columns"]) == 700
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "gathered B/step" in out.stdout


def _cycle(ms: float, verify: float, rank: int = 0, mode: str = "DECODE", bs: int = 1) -> dict:
    """A decode cycle's record as the profiling plugin writes it: phase path -> [ms, calls]."""
    phases = {"recv requests": [1.0, 1], "run batch": [ms - 2.0, 1], "run batch > draft": [30.0, 1],
              "run batch > draft > forward 1": [10.0, 1], "run batch > draft > forward 2": [12.0, 1],
              "run batch > verify": [verify + 5.0, 1], "run batch > verify > forward 1": [verify, 1],
              "run batch > draft extend": [20.0, 1],
              "run batch > draft extend > forward 1": [18.0, 1]}  # fmt: skip
    return {"rank": rank, "mode": mode, "bs": bs, "ms": ms, "hook_us": 2.0, "phases": phases}


def test_cycle_profile_averages_phases_and_predicts_tokens_per_s(tmp_path):
    """Rank 0's full-batch decode cycles only, averaged phase by phase from whole lines (a line
    still being written waits), own times, the table, the cost model and its GPU substitution,
    against figures worked out by hand."""
    lines = [_cycle(100.0, 40.0), _cycle(99.0, 40.0, rank=1), _cycle(300.0, 40.0, mode="EXTEND"),
             _cycle(100.0, 40.0, bs=2), _cycle(120.0, 50.0)]  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "1.jsonl").write_text(text[:-30])
    log = cycle_profile.CycleLog(tmp_path)
    assert len(log.read_new()) == 4
    (tmp_path / "1.jsonl").write_text(text)
    records = log.read_new()
    assert records == lines[4:] and log.read_new() == []
    summary = cycle_profile.summarize_cycles(lines, batch_size=1, rank=0)
    assert summary["cycles"] == 2 and summary["cycle_ms"] == 110.0
    assert summary["phases_ms"]["run batch > verify > forward 1"] == 45.0
    assert summary["top_level_ms"] == 109.0 and summary["covered"] == pytest.approx(109 / 110)
    assert summary["profiler_overhead_ms"] == pytest.approx(9 * 2.0 / 1e3)  # 9 timed calls x 2 us
    assert cycle_profile.self_ms(summary, "run batch > draft") == 8.0  # 30 less its two steps
    assert cycle_profile.draft_steps_ms(summary) == [10.0, 12.0]
    plain = {"cycle_ms": 50.0, "phases_ms": {"run batch > forward 1": 40.0}}
    assert cycle_profile.predicted_ratio(2.5, plain["cycle_ms"], summary["cycle_ms"]) == 2.5 * 50 / 110
    # GPU: the verify costs plain's forward (40, not 45), the draft extend one draft step (11, not 18).
    assert cycle_profile.gpu_cycle(summary, plain) == {
        "plain_with_rest": 50.0,
        "cycle_with_rest": 110.0 - 45.0 + 40.0 - 18.0 + 11.0,
        "plain_forwards_only": 40.0,
        "cycle_forwards_only": 40.0 + 22.0 + 11.0,
    }
    table = cycle_profile.phase_table({"spec": summary})
    draft_self = next(line for line in table if line.strip().startswith("(self)") and "8.00" in line)
    assert draft_self.split()[-1] == f"{100 * 8 / 110:.1f}%"


@pytest.mark.server
def test_bench_server_smoke(tmp_path):
    # --profile: the same servers also record every decode cycle phase by phase on each rank.
    out = run("bench_server.py", "--hidden", "128", "--requests", "2", "--max-new-tokens", "8",
              "--rounds", "1", "--configs", "balanced/topk", "--profile",
              "--json", str(tmp_path / "s.json"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["config"] for r in results] == ["stock EAGLE, no map", "map + plugin balanced/topk"]
    assert all(r["outputs_equal_stock"] and r["accept_length"] > 2.0 for r in results)
    # One draft step (steps 2), the verify forward, the draft extend; heads and their TP=2
    # collectives inside them (the plugin's top-k packet, stock's full-vocab gather).
    stages = ("run batch > draft", "run batch > verify", "run batch > draft extend")
    inners = ("", " > all-reduce", " > head", " > head > all-gather")
    paths = [f"{stage} > forward 1{inner}" for stage in stages for inner in inners]
    for r in results:
        assert set(r["profile"]) == {"rank0", "rank1"}
        for profile in r["profile"].values():
            assert profile["batch_size"] == 2 and profile["cycles"] >= 1
            assert set(paths) | {"recv requests", "schedule", "run batch", "process result"} <= set(
                profile["phases_ms"]
            ), r["config"]
            assert "run batch > draft > forward 2" not in profile["phases_ms"]
            # The scheduler loop's timed calls cover each cycle, up to the loop's own code.
            assert abs(1 - profile["covered"]) <= cycle_profile.COVERAGE_TOLERANCE, profile
    assert "cycle (one pass of the scheduler loop)" in out.stdout


def test_bench_head_gemm_smoke(tmp_path):
    out = run("bench_head_gemm.py", "--vocab", "5003", "--hot", "700", "--hidden", "64", "--rows", "1", "4",
              "--tp", "1", "2", "--repeats", "2", "--iters", "2", "--working-set-mb", "4",
              "--json", str(tmp_path / "g.json"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "g.json").read_text())["results"]
    rows_of = {(r["tp"], r["variant"]): r["head_rows"] for r in results if r["rows"] == 1}
    # The slowest rank's head per variant: stock shard of the padded vocab, the plan's widths.
    assert rows_of[(1, "(a) stock")] == 5003 and rows_of[(1, "(c) tp1")] == 704
    assert rows_of[(2, "(a) stock")] == 2528 and rows_of[(2, "(b) balanced")] == 350
    assert {v for tp, v in rows_of if tp == 2} == {"(a) stock", "(b) local", "(b) local+topk", "(b) balanced",
                                                  "(b) balanced+topk"}  # fmt: skip
    assert all(r["median_us"] > 0 and r["bound_us"] > 0 for r in results)


@pytest.mark.server
def test_bench_acceptance_smoke(tmp_path):
    # --one-reference (as Gemma 3's run): plain decoding runs in a group of its own, its ratios
    # chained through EAGLE without a map.
    out = run("bench_acceptance.py", "--tp", "1", "--maps", "code_512", "--layouts", "--prompts", "2",
              "--max-new-tokens", "8", "--rounds", "1", "--one-reference", "--json", str(tmp_path / "a.json"),
              "--plot", str(tmp_path / "a.png"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "a.json").read_text())["results"]
    assert [(r["config"], r["domain"]) for r in rows] == [
        (config, domain)
        for config in ("plain greedy", "EAGLE, no map", "map code_512")
        for domain in ("code", "prose")
    ]
    assert all(r["equals_plain_greedy"] != "NO" for r in rows)
    assert all(r["accept_length"] == 1.0 for r in rows if r["config"] == "plain greedy")
    assert all(1.0 < r["accept_length"] <= 4.0 for r in rows if r["config"] != "plain greedy")
    assert (tmp_path / "a.png").stat().st_size > 10_000
    by_config = {(r["config"], r["domain"]): r for r in rows}
    for domain in ("code", "prose"):
        plain, with_map = by_config["plain greedy", domain], by_config["map code_512", domain]
        assert plain["vs_plain"] == 1.0
        # Equal up to float rounding: where plain decoding shares the map's group, the script takes
        # their ratio directly, not through EAGLE without a map.
        assert with_map["vs_plain"] == pytest.approx(with_map["vs_no_map"] / plain["vs_no_map"], rel=1e-12)

    # The size model against those figures: counts served on the same prompts, every map modelled.
    out = run("validate_size_model.py", "--acceptance", str(tmp_path / "a.json"), "--prompt-sets", "timed",
              "--domains", "code", "--batch-tail", "--json", str(tmp_path / "v.json"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "v.json").read_text())
    assert [(r["prompts"], r["tp"], r["domain"]) for r in report["results"]] == [("timed", 1, "code")]
    for result in report["results"]:
        modelled = result["maps"]["code_512"]
        measured = next(r for r in rows if r["config"] == "map code_512" and r["domain"] == result["domain"])
        assert modelled["speedup"] == measured["vs_no_map"]
        assert 0.0 < modelled["drafts_kept"] <= 1.0 and modelled["speedup_model"] > 1.0
    tail = report["batch_tail"]["code_512"]
    assert set(tail) == {"code"} and all(1 <= mean <= slowest for mean, slowest in tail.values())
    printed = run("validate_size_model.py", "--report", str(tmp_path / "v.json"))
    assert printed.returncode == 0 and printed.stdout in out.stdout  # the same tables, from the JSON


@pytest.mark.server
def test_bench_adaptive_smoke(tmp_path):
    """Issue 26's benchmark end to end on the trained fixture: two adaptive servers (two intervals)
    beside the three others, three phases, tiny sizes."""
    out = run("bench_adaptive.py", "--requests-per-phase", "4", "--batch", "2", "--interval", "2", "3",
              "--max-new-tokens", "8", "--json", str(tmp_path / "ad.json"),
              "--plot", str(tmp_path / "ad.png"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "ad.json").read_text())
    adaptive = ["adaptive/2 from prose_128", "adaptive/3 from prose_128"]
    servers = ["static prose_128", *adaptive, "static code_128", "EAGLE, no map"]
    assert [(r["phase"], r["domain"], r["server"]) for r in data["phases"]] == [
        (phase, domain, server)
        for phase, domain in enumerate(("code", "prose", "code"), 1)
        for server in servers
    ]
    assert all(r["equals_no_map"] != "NO" for r in data["phases"])
    assert all(1.0 <= r["accept_length"] <= 4.0 for r in data["phases"])
    assert len(data["batches"]) == 6 and all(set(b["servers"]) == set(servers) for b in data["batches"])
    assert list(data["adaptation"]) == adaptive and list(data["goals"]) == adaptive
    for name, interval in zip(adaptive, (2, 3)):
        adaptation = data["adaptation"][name]
        assert adaptation["interval"] == interval
        # Code traffic on a prose map commits ids the map lacks: the first decisions swap them in.
        assert adaptation["decisions"] >= adaptation["decisions_that_swapped"] >= 1
        assert adaptation["ids_swapped"] >= 1 and adaptation["decision_ms_mean"] > 0
        assert [p["phase"] for p in data["goals"][name]["phases"]] == [1, 2, 3]
    assert (tmp_path / "ad.png").stat().st_size > 10_000
