"""Real SGLang servers side by side: stock EAGLE without a map vs EAGLE + map with this plugin.

Every configuration runs as its own server at the same TP; all are started first, then timed
batches run in interleaved rounds (``sglang_frspec.demo.timing``: each round every configuration
in turn, plain decoding, else stock EAGLE, first and once more at the end), so machine noise hits
every configuration alike. Servers not being measured are suspended (SIGSTOP): idle SGLang
schedulers poll. A ratio to plain (or stock) is refused when that system's own runs differ by more
than ``--max-drift`` (default 10%): the machine's speed then moved more than the ratio could show.
Reports tokens/s (median and spread), accept length, and wall time per speculative step
(draft steps + verify; the step count is SGLang's ``sglang:spec_verify_calls_total`` metric).

CPU (default): a permutation fixture with a Llama-3-size vocab (128256) whose hidden size
(``--hidden``, default 1024) makes the LM head dominate the draft step as it does in real
models; every draft token is acceptable, so accept length is the same for every configuration.
    python -m benchmarks.bench_server
Coverage overhead (``--coverage-off``): every plugin configuration also runs with
SGLANG_FRSPEC_COVERAGE=0, and the tokens/s of coverage on over off is reported as the median of
the per-round ratios with its 95% interval (docs/results/coverage-overhead-cpu.txt):
    python -m benchmarks.bench_server --hidden 128 --configs balanced/full --coverage-off --rounds 30 \
        --requests 8 --max-new-tokens 96
GPU:
    python -m benchmarks.bench_server --device cuda --tp 8 --model-path M \\
        --draft-model-path D --token-map freq_32768.pt
``--plain`` adds plain decoding (no speculation) beside them. ``--profile`` (CPU) also times every
phase of the schedulers' decode cycles (``cycle_profile.py``: rank 0's verify forward, each draft
step, the draft head and its exchange, the draft extend, the collectives, the scheduler's own calls;
ms per cycle side by side) and prints the cost model's tokens/s over plain decoding beside the
measured one. ``--fixture gemma3`` serves Gemma 3 270M with its shipped draft and a map of its
training text (``--gemma3-map``) on its held-out prose prompts; ``--sequential`` runs one server at
a time (a TP=2 Gemma 3 server holds about 7.5 GB), so its ratios compare runs at different times.
Gemma 3's cycle, TP=2:
    python -m benchmarks.bench_server --fixture gemma3 --plain --profile --sequential \\
        --configs balanced/full --steps 3 --topk 1 --draft-tokens 4 --requests 1 \\
        --max-new-tokens 32 --rounds 3 --json docs/results/cycle-profile-gemma3-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from benchmarks import cycle_profile
from benchmarks.common import median_interval, shown_path, shown_paths, summarize
from sglang_frspec.demo import gemma3
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.fixtures import LLAMA3_VOCAB, perm_fixture
from sglang_frspec.demo.server import SGLangServer, new_python
from sglang_frspec.demo.timing import (
    MAX_REFERENCE_DRIFT,
    drift,
    interleaved_rounds,
    ratio_refusal,
    timed_batch,
    warm_up,
)

STOCK = "stock EAGLE, no map"
PLAIN = "plain decoding"
COVERAGE_OFF = ", coverage off"
TEXT_PROMPTS = ["The capital of France is", "def quicksort(xs):", "In 1905, Einstein", "Dear team,"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fixture", choices=["perm", "gemma3"], default="perm",
                   help="the model served when --model-path is not given")  # fmt: skip
    p.add_argument("--gemma3-map", type=int, default=32768, choices=gemma3.MAP_SIZES)
    p.add_argument("--model-path", help="target (default: the fixture's)")
    p.add_argument("--draft-model-path")
    p.add_argument("--token-map")
    p.add_argument("--hidden", type=int, default=1024, help="fixture hidden size (CPU default)")
    p.add_argument("--hot", type=int, default=32768, help="fixture hot ids")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["balanced/full", "local/full"],
        help="plugin layout/exchange pairs to compare with stock",
    )
    p.add_argument(
        "--coverage-off",
        action="store_true",
        help="also run each plugin config with SGLANG_FRSPEC_COVERAGE=0 (the hot-coverage count off) "
        "and report the tokens/s ratio of coverage on over off",
    )
    p.add_argument("--plain", action="store_true", help="also serve plain decoding (no speculation)")
    p.add_argument("--profile", action="store_true", help="time the phases of each decode cycle (CPU)")
    p.add_argument("--sequential", action="store_true", help="one server at a time (memory)")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests per batch")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds: each config once a round; plain (else stock) also last",
    )
    p.add_argument("--max-drift", type=float, default=MAX_REFERENCE_DRIFT,
                   help="refuse a ratio to plain (or stock) when its runs' tokens/s differ by more than this "
                   f"share (default {MAX_REFERENCE_DRIFT})")  # fmt: skip
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--server-args", default="", help="extra launch_server arguments (quoted)")
    p.add_argument("--log-dir", help="keep server logs here")
    p.add_argument("--json", help="write the results here as JSON")
    return p.parse_args(argv)


def scrape(server: SGLangServer) -> dict[str, float]:
    """Sum every sample of each sglang:* counter in /metrics over its labels."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(sglang:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if match:
            name, labels = match.group(1), match.group(2) or ""
            key = name + (
                "{" + ",".join(sorted(re.findall(r'(category="[^"]*")', labels))) + "}"
                if "category=" in labels
                else ""
            )
            totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def metered_batch(server: SGLangServer, prompts: list, max_new_tokens: int) -> dict:
    """``timed_batch`` with its time per speculative step, from the server's metrics around it."""
    before = scrape(server)
    sample = timed_batch(server, prompts, max_new_tokens)
    after = scrape(server)
    calls = "sglang:spec_verify_calls_total"
    verify_calls = after.get(calls, 0.0) - before.get(calls, 0.0)
    # One speculative step = draft steps + draft extend + verify, for the whole batch.
    sample["step_ms"] = 1e3 * sample["seconds"] / verify_calls if verify_calls else None
    sample["accept_length"] = sample["accept_length"] or 1.0  # plain decoding: one token a step
    return sample


def start_server(name: str, i: int, config: tuple, args, base: list, prompts: list, log_dir: Path, launch):
    """A server of ``config``, warmed up and suspended; with ``--profile`` its ``CycleLog`` too."""
    extra, options, plugin = config
    if args.device == "cpu":
        env = cpu_env(args.tp, with_plugin=plugin, base=os.environ | options)
    else:
        env = os.environ | options | {"SGLANG_PLUGINS": "frspec" if plugin else "none"}
    log = None
    if args.profile:
        env = cycle_profile.profiled_env(env, log_dir / f"profile{i}")
        log = cycle_profile.CycleLog(log_dir / f"profile{i}")
    print(f"starting {name} ...", flush=True)
    server = SGLangServer(base + extra, env, log_dir / f"server{i}.log", launch=launch).start().wait_ready()
    warm_up(server, prompts, sizes=(len(prompts),))
    server.suspend()  # only the server being measured may run
    if log is not None:
        log.read_new()  # the warm-up's cycles are not kept
    return server, log


def measure(servers: dict, logs: dict, samples: dict, cycles: dict, prompts: list, args) -> None:
    """Interleaved rounds over the (suspended) ``servers``, the first one also last
    (``round_order``); their cycle records if profiled."""

    def run(name: str) -> dict:
        servers[name].resume()
        sample = metered_batch(servers[name], prompts, args.max_new_tokens)
        servers[name].suspend()
        if logs[name] is not None:
            cycles[name] += logs[name].read_new()
        return sample

    for name, runs in interleaved_rounds(run, list(servers), args.rounds).items():
        samples[name] += runs


def print_profile(results: list[dict], plain: bool) -> None:
    """Rank 0's phases per decode cycle side by side; with plain decoding, the cost model's tokens/s
    over plain decoding's (from the measured phases, and on a GPU) beside the measured ratio."""
    profiles = {r["config"]: r["profile"].get("rank0") for r in results}
    missing = [name for name, summary in profiles.items() if summary is None]
    if missing:
        print(f"\nno full-batch decode cycles recorded on rank 0 for: {', '.join(missing)}")
        return
    print("\n" + "\n".join(cycle_profile.phase_table(profiles)))
    if not plain:
        return
    base = profiles[PLAIN]
    print(
        "\ncost model: tokens/s over plain decoding = accept length x plain cycle / cycle. GPU: "
        "forwards memory-bound (verify = plain's forward, draft extend = a draft step), the other "
        "phases as measured / left out"
    )
    print(f"{'config':<42} {'accept':>6} {'cycle ms':>9} {'predicted':>9} {'measured':>9} {'GPU':>15}")
    for r in results:
        summary, accept = profiles[r["config"]], r["accept_length"]
        r["predicted_vs_plain"] = cycle_profile.predicted_ratio(accept, base["cycle_ms"], summary["cycle_ms"])
        gpu = "-"
        if r["config"] != PLAIN:
            g = cycle_profile.gpu_cycle(summary, base)
            g["ratio_with_rest"] = cycle_profile.predicted_ratio(
                accept, g["plain_with_rest"], g["cycle_with_rest"]
            )
            g["ratio_forwards_only"] = cycle_profile.predicted_ratio(
                accept, g["plain_forwards_only"], g["cycle_forwards_only"]
            )
            r["gpu_prediction"] = g
            gpu = f"{g['ratio_with_rest']:.2f}x / {g['ratio_forwards_only']:.2f}x"
        measured = "-" if r["vs_plain"] is None else f"{r['vs_plain']:.2f}x"
        print(
            f"{r['config']:<42} {accept:>6.2f} {summary['cycle_ms']:>9.2f} {r['predicted_vs_plain']:>8.2f}x "
            f"{measured:>9} {gpu:>15}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile and args.device != "cpu":
        raise SystemExit("--profile times wall clock per phase: CPU only (on a GPU it would time launches)")
    fixture = None
    extra_server_args: tuple = ()
    if args.model_path is None and args.fixture == "gemma3":
        fixture = gemma3.gemma3_fixture()
        args.model_path, args.draft_model_path = fixture.target, fixture.draft
        args.token_map = args.token_map or fixture.token_map(args.gemma3_map)
        held_out = fixture.prompts[len(gemma3.DEMO_PROMPTS) :]  # 40 ids each, as bench_acceptance's
        prompts = [held_out[i % len(held_out)] for i in range(args.requests)]
        extra_server_args = gemma3.SERVER_ARGS
    elif args.model_path is None:
        fixture = perm_fixture(vocab_size=LLAMA3_VOCAB, hidden_size=args.hidden, num_hot=args.hot)
        args.model_path, args.draft_model_path = fixture.target, fixture.draft
        args.token_map = fixture.token_map("hot")
        prompts = [list(fixture.chain[i * 11 : i * 11 + 3]) for i in range(args.requests)]
    else:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(args.requests)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-frspec-bench-"))
    base = ["--model-path", args.model_path, "--tp-size", str(args.tp), "--enable-metrics"]
    base += CPU_SERVER_ARGS if args.device == "cpu" else ["--device", args.device]
    base += [*extra_server_args, *args.server_args.split()]
    spec = {"steps": args.steps, "topk": args.topk, "draft_tokens": args.draft_tokens}
    configs = {PLAIN: ([], {}, False)} if args.plain else {}
    configs[STOCK] = (eagle_args(args.draft_model_path, **spec), {}, False)
    for config in args.configs:
        layout, exchange = config.split("/")
        env = {"SGLANG_FRSPEC_LAYOUT": layout, "SGLANG_FRSPEC_EXCHANGE": exchange}
        configs[f"map + plugin {config}"] = (
            eagle_args(args.draft_model_path, args.token_map, **spec),
            env,
            True,
        )
        if args.coverage_off:
            configs[f"map + plugin {config}{COVERAGE_OFF}"] = (
                eagle_args(args.draft_model_path, args.token_map, **spec),
                env | {"SGLANG_FRSPEC_COVERAGE": "0"},
                True,
            )
    # On CPU the launcher is forked from a Python that has already imported SGLang, and its
    # schedulers are forked from it (tools/serving/zygote.py): ~35 s less per server start here.
    # On a GPU SGLang spawns its schedulers as usual (a forked CUDA context is unusable).
    launch = new_python
    if args.device == "cpu":
        from tools.serving.zygote import forked_launch

        launch = forked_launch
    servers, logs = {}, {}
    samples: dict[str, list] = {name: [] for name in configs}
    cycles: dict[str, list] = {name: [] for name in configs}
    # All servers alive at once (interleaved rounds), or one at a time with --sequential.
    groups = [[name] for name in configs] if args.sequential else [list(configs)]
    try:
        for group in groups:
            for name in group:
                i = list(configs).index(name)
                servers[name], logs[name] = start_server(
                    name, i, configs[name], args, base, prompts, log_dir, launch
                )
            measure({n: servers[n] for n in group}, logs, samples, cycles, prompts, args)
            for name in group:
                servers.pop(name).stop()
    finally:
        for server in servers.values():
            server.stop()
    reference = samples[STOCK][0]["outputs"]
    bases = {"stock": STOCK, "plain": PLAIN} if args.plain else {"stock": STOCK}
    base_tps = {key: [s["tokens_per_s"] for s in samples[name]] for key, name in bases.items()}
    # A ratio to a system whose own runs drifted apart by more than --max-drift is not printed.
    refusals = {key: ratio_refusal(tps, args.max_drift) for key, tps in base_tps.items()}
    results = []
    for name, runs in samples.items():
        tps = summarize([s["tokens_per_s"] for s in runs])
        steps = [s["step_ms"] for s in runs if s["step_ms"] is not None]
        results.append(
            {
                "config": name,
                "tokens_per_s": tps["median"],
                "tps_p25": tps["p25"],
                "tps_p75": tps["p75"],
                "drift": drift([s["tokens_per_s"] for s in runs]),
                "accept_length": summarize([s["accept_length"] for s in runs])["median"],
                "step_ms": summarize(steps)["median"] if steps else None,
                "outputs_equal_stock": all(s["outputs"] == reference for s in runs),
            }
        )
        for key, base in base_tps.items():
            ratio = None if refusals[key] else tps["median"] / summarize(base)["median"]
            results[-1]["speedup_vs_stock" if key == "stock" else "vs_plain"] = ratio
        if args.profile:
            ranks = sorted({c["rank"] for c in cycles[name]})
            results[-1]["profile"] = {
                f"rank{rank}": cycle_profile.summarize_cycles(cycles[name], len(prompts), rank)
                for rank in ranks
            }
        if name.endswith(COVERAGE_OFF):
            # Paired per round (both ran in the same round), so slow drifts of the machine cancel.
            on = samples[name.removesuffix(COVERAGE_OFF)]
            paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, runs)]
            low, high = median_interval(paired)
            results[-1] |= {"coverage_on_over_off": summarize(paired)["median"], "ratio_ci95": [low, high]}
    model = args.model_path
    if isinstance(fixture, gemma3.Gemma3Fixture):
        model = f"Gemma 3 270M (V={gemma3.VOCAB}, float32), map {shown_path(args.token_map)}"
    elif fixture is not None:
        model = f"permutation fixture (V={LLAMA3_VOCAB}, hidden {args.hidden}, H={args.hot})"
    first = next(iter(samples))
    order = "rounds, one server at a time" if args.sequential else f"interleaved rounds, {first} also last"
    print(
        f"\nservers: tp={args.tp} device={args.device} model={model}; EAGLE steps={args.steps} "
        f"topk={args.topk} draft tokens={args.draft_tokens}; {args.requests} concurrent requests x "
        f"{args.max_new_tokens} tokens, {args.rounds} {order}; logs {shown_path(log_dir)}"
    )
    plain_column = f" {'vs plain':>8}" if args.plain else ""
    print(
        f"{'config':<42} {'tokens/s':>9} {'p25-p75':>13} {'drift':>6} {'vs stock':>8}{plain_column} "
        f"{'accept':>6} {'ms/step':>8} {'same out':>8}"
    )

    def shown_ratio(ratio: float | None) -> str:
        return "-" if ratio is None else f"{ratio:.2f}x"

    for r in results:
        step = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "-"
        plain = f" {shown_ratio(r['vs_plain']):>8}" if args.plain else ""
        print(
            f"{r['config']:<42} {r['tokens_per_s']:>9.1f} {r['tps_p25']:>6.1f}-{r['tps_p75']:<6.1f} "
            f"{r['drift']:>6.0%} {shown_ratio(r['speedup_vs_stock']):>8}{plain} {r['accept_length']:>6.2f} "
            f"{step:>8} {'yes' if r['outputs_equal_stock'] else 'NO':>8}"
        )
    for key, reason in refusals.items():
        if reason:
            print(f"no ratio to {bases[key]}: {reason}")
    for r in results:
        if "coverage_on_over_off" in r:
            print(
                f"{r['config'].removesuffix(COVERAGE_OFF)}: tokens/s with coverage on / off = "
                f"{r['coverage_on_over_off']:.4f} (95% interval of the median {r['ratio_ci95'][0]:.4f}-"
                f"{r['ratio_ci95'][1]:.4f} over {args.rounds} paired rounds; overhead "
                f"{1 - r['coverage_on_over_off']:+.2%})"
            )
    if args.profile:
        print_profile(results, args.plain)
    if args.json:
        Path(args.json).write_text(
            json.dumps(shown_paths({"args": vars(args), "results": results}), indent=1)
        )
    return 0 if all(r["outputs_equal_stock"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
