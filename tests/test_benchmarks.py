"""The benchmark scripts run end to end in a smoke mode (tiny sizes); timings are not checked.

Most run as users run them, ``python -m benchmarks.NAME`` from the repository root. The four that
start servers (bench_server and the studies bench_acceptance, validate_size_model, bench_adaptive)
run their ``main(argv)`` in this process instead: their servers' environment is the suite's, so they
fork from the suite's zygote rather than a new Python's (about 25 s each of a fresh import and zygote
start on 2 cores); their command line is the same ``main`` behind ``if __name__ == "__main__"``, and
``validate_size_model --report`` still runs as a module."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import cycle_profile
from benchmarks.common import local_path, median_interval, shown_path, shown_paths

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


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


def run(module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m module *args`` from the repository root, as a user runs a benchmark."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCH.parent)  # fmt: skip


def run_main(capsys, module: str, *args: str) -> subprocess.CompletedProcess:
    """``module``'s ``main(args)`` in this process, seen as ``run`` sees a module's run."""
    capsys.readouterr()
    status = importlib.import_module(module).main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], status, out.out, out.err)


@pytest.mark.multirank
def test_bench_draft_head_smoke(tmp_path):
    out = run("benchmarks.bench_draft_head", "--tp", "2", "--vocab", "5003", "--hot", "700", "--hidden", "64",
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
def test_bench_server_smoke(tmp_path, capsys):
    # --profile: the same servers also record every decode cycle phase by phase on each rank.
    out = run_main(capsys, "benchmarks.bench_server", "--hidden", "128", "--requests", "2",
                   "--max-new-tokens", "8", "--rounds", "1", "--configs", "balanced/topk", "--profile",
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
    out = run("benchmarks.bench_head_gemm", "--vocab", "5003", "--hot", "700", "--hidden", "64", "--rows",
              "1", "4", "--tp", "1", "2", "--repeats", "2", "--iters", "2", "--working-set-mb", "4",
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


def test_bench_acceptance_one_spec_keeps_its_names_and_args():
    """Without --spec (or with one) config names carry no spec and the JSON's args say the spec
    (validate_size_model drafts as they say); with several, every EAGLE config runs per spec."""
    from benchmarks.studies.bench_acceptance import configs_for, parse_args

    one = parse_args(["--steps", "2", "--draft-tokens", "3", "--maps", "code_512", "--layouts", "local/topk"])
    assert (one.spec, one.steps, one.topk, one.draft_tokens) == ([(2, 1, 3)], 2, 1, 3)
    assert parse_args(["--spec", "3,2,6"]).steps == 3
    names = ["plain greedy", "EAGLE, no map", "map code_512", "map code_128 local/topk"]
    assert [c.name for c in configs_for(2, one)] == names
    two = parse_args(["--spec", "2,1,3", "3,2,6", "--maps", "code_512", "--layouts"])
    assert two.steps is None
    assert [(c.name, c.spec) for c in configs_for(2, two)] == [("plain greedy", None)] + [
        (f"{name} {s}", spec) for s, spec in (("2,1,3", (2, 1, 3)), ("3,2,6", (3, 2, 6)))
        for name in ("EAGLE, no map", "map code_512")
    ]  # fmt: skip


def test_bench_acceptance_ratios_recover_speeds_across_groups():
    """Gemma 3's sweep (TP=2, --one-reference --alive 1, three specs, two modes): each config times
    in a group with the anchor only, the machine's speed changing every round. Every ratio (to
    plain, to the same spec's EAGLE without a map, to the fastest stock row; round by round too)
    is the configs' own speed ratio, chained through the anchor, and ``best`` picks the fastest."""
    from types import SimpleNamespace

    from benchmarks.studies.bench_acceptance import configs_for, parse_args, summarize_tp

    args = parse_args(["--fixture", "gemma3", "--tp", "2", "--one-reference", "--alive", "1", "--maps",
                       "8192", "32768", "--layouts", "--spec", "2,1,3", "3,1,4", "3,2,6", "--concurrency",
                       "1", "8", "--prompts", "8", "--rounds", "3"])  # fmt: skip
    configs = configs_for(2, args)
    speed = {c.name: 5.0 + (7 * i) % 11 for i, c in enumerate(configs)}  # tokens/s at machine speed 1
    machine = iter([0.5, 1.7, 1.1, 0.8, 2.0, 1.3, 0.6] * 20)
    for other in configs[:1] + configs[2:]:  # configs[1], the first spec's EAGLE without a map: the anchor
        group = (configs[1], other)
        for _ in range(args.rounds):
            speed_now = next(machine)
            for config, cell in ((c, (d, n)) for c in group for d in ("code", "prose") for n in (1, 8)):
                sample = {"tokens_per_s": speed[config.name] * speed_now, "accept_length": 1.5}
                sample |= {"outputs": [[7]], "group": tuple(c.name for c in group)}
                config.samples[cell].append(sample)
    rows, best = summarize_tp(configs, SimpleNamespace(target=""), {"code": [[1]], "prose": [[1]]}, args)
    assert len(rows) == 10 * 4 and len(best) == 3 * 4
    for r in rows:
        own = f"EAGLE, no map {r['spec'] or '2,1,3'}"
        assert r["vs_plain"] == pytest.approx(speed[r["config"]] / speed["plain greedy"], rel=1e-12)
        assert r["vs_no_map"] == pytest.approx(speed[r["config"]] / speed[own], rel=1e-12)
        rounds = r["vs_no_map_rounds"]
        assert len(rounds) == len(r["tokens_per_s_rounds"]) and rounds == pytest.approx(
            [r["vs_no_map"]] * len(rounds)
        )
    fastest = {
        system: max((c for c in configs if c.system == system), key=lambda c: speed[c.name]).name
        for system in ("plain greedy", "stock EAGLE", "EAGLE + map")
    }
    for b in best:
        assert b["config"] == fastest[b["system"]]
        assert b["vs_best_stock"] == pytest.approx(
            speed[b["config"]] / speed[fastest["stock EAGLE"]], rel=1e-12
        )


@pytest.mark.server
def test_bench_acceptance_smoke(tmp_path, capsys):
    # --one-reference (as Gemma 3's run): only the first spec's EAGLE without a map stays alive. Two
    # specs: plain, the first spec's map row and the second spec's EAGLE without a map run in one
    # group (--alive 3), the second spec's map row in the next, so its ratio to its own spec's EAGLE
    # without a map is chained through the first spec's. The prompts go one at a time.
    specs = ("3,1,4", "2,1,3")
    out = run_main(capsys, "benchmarks.studies.bench_acceptance", "--tp", "1", "--maps", "code_512",
                   "--layouts", "--prompts", "2", "--max-new-tokens", "8", "--rounds", "1", "--one-reference",
                   "--spec", *specs, "--concurrency", "1", "--json", str(tmp_path / "a.json"),
                   "--plot", str(tmp_path / "a.png"))  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "a.json").read_text())
    rows = data["results"]
    configs = ["plain greedy"] + [f"{c} {s}" for s in specs for c in ("EAGLE, no map", "map code_512")]
    cells = [("code", 1), ("prose", 1)]
    assert [(r["config"], r["domain"], r["concurrency"]) for r in rows] == [
        (c, *cell) for c in configs for cell in cells
    ]
    assert all(r["equals_plain_greedy"] != "NO" for r in rows)
    assert all(r["accept_length"] == 1.0 for r in rows if r["config"] == "plain greedy")
    assert all(1.0 < r["accept_length"] <= int(r["spec"].split(",")[0]) + 1 for r in rows if r["spec"])
    assert (tmp_path / "a.png").stat().st_size > 10_000
    by_config = {(r["config"], r["domain"], r["concurrency"]): r for r in rows}
    for cell in cells:
        plain = by_config[("plain greedy", *cell)]
        assert plain["vs_plain"] == 1.0
        # One round: every ratio is one of tokens/s, so a row's ratio to its spec's EAGLE without a
        # map equals (up to float rounding) its ratio to plain over that row's, whether taken
        # directly (the first spec: plain shares the group) or chained (the second spec's map row).
        for spec in specs:
            no_map = by_config[(f"EAGLE, no map {spec}", *cell)]
            for row in (no_map, by_config[(f"map code_512 {spec}", *cell)]):
                assert row["vs_no_map"] == pytest.approx(row["vs_plain"] / no_map["vs_plain"], rel=1e-12)
        # The closing table: each system's row with the highest ratio to plain, and its ratio to the
        # best stock EAGLE row.
        best = [b for b in data["best"] if (b["domain"], b["concurrency"]) == cell]
        assert [b["system"] for b in best] == ["plain greedy", "stock EAGLE", "EAGLE + map"]
        mine = [r for r in rows if (r["domain"], r["concurrency"]) == cell]
        fastest = {
            system: max((r for r in mine if r["system"] == system), key=lambda r: r["vs_plain"])
            for system in ("plain greedy", "stock EAGLE", "EAGLE + map")
        }
        stock = fastest["stock EAGLE"]["vs_plain"]
        for b in best:
            assert (b["config"], b["vs_plain"]) == (
                fastest[b["system"]]["config"],
                fastest[b["system"]]["vs_plain"],
            )
            assert b["vs_best_stock"] == pytest.approx(b["vs_plain"] / stock, rel=1e-12)
    assert "best configuration per system" in out.stdout

    # validate_size_model reads a run of one spec: the first spec's rows, named and with args as a
    # run of that spec alone writes them (test_bench_acceptance_one_spec_keeps_its_names_and_args).
    one = [
        r | {"config": r["config"].removesuffix(f" {specs[0]}")}
        for r in rows
        if r["spec"] in (None, specs[0])
    ]
    args = data["args"] | {"steps": 3, "topk": 1, "draft_tokens": 4}
    (tmp_path / "a1.json").write_text(json.dumps(data | {"args": args, "results": one}))
    rows = one
    # The size model against those figures: counts served on the same prompts, every map modelled.
    out = run_main(capsys, "benchmarks.studies.validate_size_model", "--acceptance",
                   str(tmp_path / "a1.json"), "--prompt-sets", "timed", "--domains", "code", "--batch-tail",
                   "--json", str(tmp_path / "v.json"))  # fmt: skip
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
    printed = run("benchmarks.studies.validate_size_model", "--report", str(tmp_path / "v.json"))
    assert printed.returncode == 0 and printed.stdout in out.stdout  # the same tables, from the JSON


@pytest.mark.server
def test_bench_adaptive_smoke(tmp_path, capsys):
    """Issue 26's benchmark end to end on the trained fixture: two adaptive servers (two intervals)
    beside the three others, three phases, tiny sizes."""
    out = run_main(capsys, "benchmarks.studies.bench_adaptive", "--requests-per-phase", "4", "--batch", "2",
                   "--interval", "2", "3", "--max-new-tokens", "8", "--json", str(tmp_path / "ad.json"),
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
