"""The ``sglang-frspec`` command line, run as a user runs it."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from sglang_frspec import __version__
from sglang_frspec.cli import build_parser
from sglang_frspec.cli import demo as demo_command
from sglang_frspec.core import vocab_shard_ranges
from sglang_frspec.demo.server import Process, new_python, plugin_activity
from sglang_frspec.demo.timing import batch_figures
from tests.harness.cli import cli
from tools.serving.zygote import forked_launch


def test_version_and_help():
    assert cli("--version").stdout.strip() == f"sglang-frspec {__version__}"
    help_text = cli("--help").stdout
    for command in ("demo", "plan", "build-map", "inspect"):
        assert command in help_text


def test_plan_table_and_json(tmp_path):
    vocab, tp = 128256, 2
    (s0, e0), (s1, e1) = vocab_shard_ranges(vocab, tp)
    ids = torch.cat([torch.arange(0, 3000), torch.arange(s1, s1 + 1000)])
    torch.save(ids, tmp_path / "map.pt")
    args = ["plan", "--token-map", str(tmp_path / "map.pt"), "--vocab-size", str(vocab), "--tp", "2"]
    table = cli(*args)
    assert table.returncode == 0, table.stderr
    assert "layout local: 4000 hot ids over 2 rank(s), width 3000, max/mean 1.50" in table.stdout
    assert "12,000 B (exchange full), 72 B (exchange topk, k=4)" in table.stdout
    assert f"[{s1}, {e1})" in table.stdout
    plans = json.loads(cli(*args, "--json").stdout)
    local, balanced = plans
    assert [r["columns"] for r in local["ranks"]] == [3000, 1000]
    assert [r["owned_hot_ids"] for r in balanced["ranks"]] == [3000, 1000]
    assert [r["columns"] for r in balanced["ranks"]] == [2000, 2000]
    assert local["gathered_bytes_per_row"] == 2 * 3000 * 2
    assert balanced["gathered_bytes_per_row"] == 2 * 2000 * 2
    assert balanced["topk4_bytes_per_row"] == 2 * 9 * 4


def test_plan_reads_the_vocab_from_a_model(perm):
    out = cli(
        "plan", "--token-map", perm.token_map("hot"), "--model-path", perm.target, "--tp", "2", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["ranks"][1]["vocab_range"] == [16000, 32000]


def test_plan_bad_map_is_a_clear_error(tmp_path):
    torch.save(torch.tensor([1.5, 2.0]), tmp_path / "float.pt")
    out = cli("plan", "--token-map", str(tmp_path / "float.pt"), "--vocab-size", "10", "--tp", "2")
    assert out.returncode == 2
    assert "sglang-frspec plan: error: token map" in out.stderr and "torch.float32" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.server
def test_demo_on_the_permutation_fixture(tmp_path):
    """``demo --fixture perm`` (Llama-3-size vocab, TP=2, CPU): its drafts are always accepted.
    (The default, Gemma 3 270M, is the README's main job: tests/test_gemma3.py.) The command runs
    here, as test_gemma3 runs it; the CLI's own entry point is run as a user's by the tests above."""
    argv = ["demo", "--fixture", "perm", "--skip-stock", "--requests", "4", "--one-at-a-time", "1"]
    argv += ["--max-new-tokens", "24", "--log-dir", str(tmp_path), "--json", str(tmp_path / "demo.json")]
    args = build_parser().parse_args(argv)
    spawned: list[Path] = []

    def launch(env: dict, server_args: list[str], log_path: Path) -> Process:
        """The server with the map starts as a user's does: a new Python whose spawned schedulers
        load the plugin themselves (the suite's only such start, ~55 s here); plain's is forked."""
        if "--speculative-token-map" not in server_args:
            return forked_launch(env, server_args, log_path)
        spawned.append(log_path)
        return new_python(env, server_args, log_path)

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = demo_command.run(args, launch=launch)
    out = stdout.getvalue()
    assert status == 0, out[-3000:]
    assert "plain greedy equals the fixture's pi chain: yes" in out
    assert "all outputs equal plain greedy decoding" in out
    # The spawned schedulers registered the plugin: its start-up line, from rank 0, at TP=2.
    assert len(spawned) == 1
    assert [a[1:] for a in plugin_activity(spawned[0].read_text())] == [(2, "balanced", "full")]
    # One table per mode, one request at a time first: the plugin with the map at TP=2 decodes as
    # plain greedy with every draft accepted (2 steps + the bonus token); plain's ratio is 1.
    lines = out.splitlines()
    titles = [line.split(":")[0] for line in lines if line.endswith("x plain")]
    assert titles == ["one at a time", "4 at once"]
    for prefix, columns in (("EAGLE + map", ["yes", "3.00"]), ("plain greedy", ["yes", "-"])):
        rows = [line.split() for line in lines if line.startswith(f"  {prefix}") and line.endswith("x")]
        assert len(rows) == 2 and all(row[-6:-4] == columns for row in rows), rows
    assert all(row[-1] == "1.00x" for row in rows)
    # The break-even, one request at a time, from the run's own seconds, tokens and verify cycles.
    runs = json.loads((tmp_path / "demo.json").read_text())["runs"]
    plain, plugin = runs[demo_command.PLAIN]["one_at_a_time"], runs[demo_command.PLUGIN]["one_at_a_time"]
    assert plugin["cycles"] * 3 == plugin["tokens"] == len(plugin["outputs"][0]) == 24
    even = (plugin["seconds"] / plugin["cycles"]) / (plain["seconds"] / plain["tokens"])
    row = next(line.split() for line in lines if line.startswith("  EAGLE + map") and line.endswith("x"))
    assert row[-2] == f"{even:.2f}" and f"this host's break-even accept length: {even:.2f} " in out


def _responses(tokens: int, verify_cycles: list[int | None]) -> list[dict]:
    """``/generate`` responses of ``tokens`` each, with SGLang's verify cycle count (EAGLE) or none."""
    meta = [{} if v is None else {"spec_verify_ct": v} for v in verify_cycles]
    return [{"output_ids": list(range(tokens)), "meta_info": m} for m in meta]


# One request at a time, two requests of 48 tokens each: plain decodes 96 tokens in 12 s (a 125 ms
# step); stock EAGLE and EAGLE + map both take 36 + 40 verify cycles (accept length 96 / 76 = 1.26).
PLAIN_ALONE = batch_figures(_responses(48, [None, None]), 12.0)


def _demo_results(stock_seconds: float, plugin_seconds: float) -> dict:
    alone = {
        demo_command.PLAIN: PLAIN_ALONE,
        demo_command.STOCK: batch_figures(_responses(48, [36, 40]), stock_seconds),
        demo_command.PLUGIN: batch_figures(_responses(48, [36, 40]), plugin_seconds),
    }
    return {name: {**figures, "one_at_a_time": figures} for name, figures in alone.items()}


@pytest.mark.parametrize(
    ("plugin_seconds", "cycle_steps", "outcome"),
    [(13.3, 1.40, "does not beat it here, 0.90x"), (11.4, 1.20, "beats it here, 1.05x")],
)
def test_demo_break_even_and_its_verdict_plugin_effect_first(plugin_seconds, cycle_steps, outcome, capsys):
    """The break-even accept length is a cycle's cost in plain steps (here 175 ms or 150 ms against a
    125 ms step), and the draft's 1.26 against it decides the ratio to plain decoding (12 s against
    ``plugin_seconds``); stock's 19 s cycle costs 2.00 steps. The plugin's contribution comes first,
    in the verdict and in each table row, then the ratio to plain decoding."""
    results = _demo_results(19.0, plugin_seconds)
    plugin = results[demo_command.PLUGIN]["one_at_a_time"]
    assert plugin["accept_length"] == 96 / 76
    assert demo_command.break_even(PLAIN_ALONE, plugin) == pytest.approx(cycle_steps)
    lines = demo_command.verdict(results)
    effect, steps = f"{19 / plugin_seconds:.2f}x", f"{cycle_steps:.2f}"
    assert lines[0] == "one request at a time:"
    assert lines[1].startswith(f"  FR-Spec effect (the plugin's contribution): EAGLE + map runs {effect}")
    assert f"accept length 1.26 against 1.26: the map cuts a cycle from 2.00 to {steps} plain" in lines[1]
    assert f"this host's break-even accept length: {cycle_steps:.2f} (an EAGLE + map cycle takes " in lines[2]
    assert f"{1e3 * plugin_seconds / 76:.0f} ms, a plain decode step 125 ms); the draft's: 1.26" in lines[2]
    assert outcome in lines[3]  # the ratio to plain: accept length / break-even (the cost model)
    assert 12 / plugin_seconds == pytest.approx(plugin["accept_length"] / cycle_steps, rel=1e-3)
    assert demo_command._show_table(results, results[demo_command.PLAIN], 2)
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[-5:] == ["x", "stock", "break-even", "x", "plain"]
    rows = {line[:30].strip(): line[30:].split() for line in table[2:5]}  # one request at a time
    assert rows[demo_command.STOCK][-3:] == ["1.00x", "2.00", f"{12 / 19:.2f}x"]
    assert rows[demo_command.PLUGIN][-3:] == [effect, steps, outcome[-5:]]
    assert rows[demo_command.PLAIN][-3:] == ["-", "-", "1.00x"]


def test_demo_verdict_without_stock_or_one_at_a_time():
    results = _demo_results(19.0, 11.4)
    del results[demo_command.STOCK]
    assert demo_command.verdict(results)[1] == (
        "  FR-Spec effect: not measured (--skip-stock: no stock EAGLE to set the map against)"
    )
    alone_off = {name: {k: v for k, v in r.items() if k != "one_at_a_time"} for name, r in results.items()}
    assert demo_command.verdict(alone_off) == [
        "no break-even measured: it is measured one request at a time (--one-at-a-time 0)"
    ]


def test_plan_head_bytes_per_rank_against_the_quantized_vocab_shard(tmp_path):
    """--hidden/--head-format: the busiest rank's hot head (bf16 for quantized heads) against its
    full-vocab shard in the head's format (fp8: 1 byte, nvfp4: 4 bits + an fp8 scale per 16)."""
    vocab, hidden = 128256, 4096
    s1 = vocab_shard_ranges(vocab, 2)[1][0]
    torch.save(torch.cat([torch.arange(0, 3000), torch.arange(s1, s1 + 1000)]), tmp_path / "map.pt")
    args = ["plan", "--token-map", str(tmp_path / "map.pt"), "--vocab-size", str(vocab), "--tp", "2"]
    local, balanced = json.loads(cli(*args, "--hidden", str(hidden), "--head-format", "fp8", "--json").stdout)
    shard_rows = 64128  # 128256 / 2 (already a multiple of 64)
    assert local["head_bytes_per_rank"] == {
        "hot_head": 3000 * hidden * 2, "vocab_shard": shard_rows * hidden, "head_format": "fp8"
    }  # fmt: skip
    assert balanced["head_bytes_per_rank"]["hot_head"] == 2000 * hidden * 2
    table = cli(*args, "--hidden", str(hidden), "--head-format", "nvfp4").stdout
    nvfp4_shard = shard_rows * hidden * 9 // 16
    assert f"{3000 * hidden * 2:,} B of bf16 hot head instead of {nvfp4_shard:,} B of the nvfp4" in table
    assert "reads MORE" not in table
    plain = json.loads(cli(*args, "--hidden", str(hidden), "--head-format", "fp32", "--json").stdout)[0]
    assert plain["head_bytes_per_rank"]["hot_head"] == 3000 * hidden * 4  # a plain head's rows as they are
    # A map of most of a small vocab: the bf16 hot rows read more than the 4.5-bit shard.
    torch.save(torch.arange(600), tmp_path / "big.pt")
    small = ["plan", "--token-map", str(tmp_path / "big.pt"), "--vocab-size", "1000", "--tp", "1"]
    table = cli(*small, "--hidden", "64", "--head-format", "nvfp4", "--layout", "balanced").stdout
    assert f"{600 * 64 * 2:,} B of bf16 hot head instead of {1000 * 64 * 9 // 16:,} B" in table
    assert "(the hot head reads MORE: a smaller map reads less)" in table
