"""Real SGLang servers side by side: stock EAGLE without a map vs EAGLE + map with this plugin.

Every configuration runs as its own server at the same TP; all are started first, then timed
batches are interleaved across them (round-robin, so machine noise hits every configuration
alike). Servers not being measured are suspended (SIGSTOP): idle SGLang schedulers poll.
Reports tokens/s (median and spread), accept length, and wall time per speculative step
(draft steps + verify; the step count is SGLang's ``sglang:spec_verify_calls_total`` metric).

CPU (default): a permutation fixture with a Llama-3-size vocab (128256) whose hidden size
(``--hidden``, default 1024) makes the LM head dominate the draft step as it does in real
models; every draft token is acceptable, so accept length is the same for every configuration.
    python benchmarks/bench_server.py
Coverage overhead (``--coverage-off``): every plugin configuration also runs with
SGLANG_FRSPEC_COVERAGE=0, and the tokens/s of coverage on over off is reported as the median of
the per-round ratios with its 95% interval (docs/results/coverage-overhead-cpu.txt):
    python benchmarks/bench_server.py --hidden 128 --configs balanced/full --coverage-off --rounds 30 \
        --requests 8 --max-new-tokens 96
GPU:
    python benchmarks/bench_server.py --device cuda --tp 8 --model-path M \\
        --draft-model-path D --token-map freq_32768.pt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.harness (CPU)
from common import median_interval, shown_path, shown_paths, summarize  # noqa: E402

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args  # noqa: E402
from sglang_frspec.demo.fixtures import LLAMA3_VOCAB, perm_fixture  # noqa: E402
from sglang_frspec.demo.server import SGLangServer, new_python  # noqa: E402

STOCK = "stock EAGLE, no map"
COVERAGE_OFF = ", coverage off"
TEXT_PROMPTS = ["The capital of France is", "def quicksort(xs):", "In 1905, Einstein", "Dear team,"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-path", help="target (default: the CPU permutation fixture)")
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
    p.add_argument("--requests", type=int, default=4, help="concurrent requests per batch")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5, help="interleaved timed batches per config")
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


def timed_batch(server: SGLangServer, prompts: list, max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    key = "input_ids" if isinstance(prompts[0], list) else "text"
    before = scrape(server)
    start = time.perf_counter()
    outs = server.post("/generate", {key: prompts, "sampling_params": params})
    seconds = time.perf_counter() - start
    after = scrape(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    verify_calls = delta.get("sglang:spec_verify_calls_total", 0.0)
    accept = [o["meta_info"].get("spec_accept_length") or 0.0 for o in outs]
    return {
        "outputs": [o["output_ids"] for o in outs],
        "tokens_per_s": sum(len(o["output_ids"]) for o in outs) / seconds,
        "accept_length": sum(accept) / len(accept),
        # One speculative step = draft steps + draft extend + verify, for the whole batch.
        "step_ms": 1e3 * seconds / verify_calls if verify_calls else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    fixture = None
    if args.model_path is None:
        fixture = perm_fixture(vocab_size=LLAMA3_VOCAB, hidden_size=args.hidden, num_hot=args.hot)
        args.model_path, args.draft_model_path = fixture.target, fixture.draft
        args.token_map = fixture.token_map("hot")
        prompts = [list(fixture.chain[i * 11 : i * 11 + 3]) for i in range(args.requests)]
    else:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(args.requests)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-frspec-bench-"))
    base = ["--model-path", args.model_path, "--tp-size", str(args.tp), "--enable-metrics"]
    base += CPU_SERVER_ARGS if args.device == "cpu" else ["--device", args.device]
    base += args.server_args.split()
    spec = {"steps": args.steps, "topk": args.topk, "draft_tokens": args.draft_tokens}
    configs = {STOCK: (eagle_args(args.draft_model_path, **spec), {}, False)}
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
    # schedulers are forked from it (tests/harness/zygote.py): ~35 s less per server start here.
    # On a GPU SGLang spawns its schedulers as usual (a forked CUDA context is unusable).
    launch = new_python
    if args.device == "cpu":
        from tests.harness.zygote import forked_launch

        launch = forked_launch
    servers = {}
    try:
        for i, (name, (extra, options, plugin)) in enumerate(configs.items()):
            if args.device == "cpu":
                env = cpu_env(args.tp, with_plugin=plugin, base=os.environ | options)
            else:
                env = os.environ | options | {"SGLANG_PLUGINS": "frspec" if plugin else "none"}
            print(f"starting {name} ...", flush=True)
            server = SGLangServer(base + extra, env, log_dir / f"server{i}.log", launch=launch)
            servers[name] = server.start().wait_ready()
            timed_batch(servers[name], prompts, args.max_new_tokens)  # warm-up
            servers[name].suspend()  # only the server being measured may run
        samples = {name: [] for name in servers}
        for round_ in range(args.rounds):
            for name in list(servers)[round_ % len(servers) :] + list(servers)[: round_ % len(servers)]:
                servers[name].resume()
                samples[name].append(timed_batch(servers[name], prompts, args.max_new_tokens))
                servers[name].suspend()
    finally:
        for server in servers.values():
            server.stop()
    reference = samples[STOCK][0]["outputs"]
    results = []
    stock_tps = summarize([s["tokens_per_s"] for s in samples[STOCK]])["median"]
    for name, runs in samples.items():
        tps = summarize([s["tokens_per_s"] for s in runs])
        steps = [s["step_ms"] for s in runs if s["step_ms"] is not None]
        results.append(
            {
                "config": name,
                "tokens_per_s": tps["median"],
                "tps_p25": tps["p25"],
                "tps_p75": tps["p75"],
                "speedup_vs_stock": tps["median"] / stock_tps,
                "accept_length": summarize([s["accept_length"] for s in runs])["median"],
                "step_ms": summarize(steps)["median"] if steps else None,
                "outputs_equal_stock": all(s["outputs"] == reference for s in runs),
            }
        )
        if name.endswith(COVERAGE_OFF):
            # Paired per round (both ran in the same round), so slow drifts of the machine cancel.
            on = samples[name.removesuffix(COVERAGE_OFF)]
            paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on, runs)]
            low, high = median_interval(paired)
            results[-1] |= {"coverage_on_over_off": summarize(paired)["median"], "ratio_ci95": [low, high]}
    model = args.model_path
    if fixture is not None:
        model = f"permutation fixture (V={LLAMA3_VOCAB}, hidden {args.hidden}, H={args.hot})"
    print(
        f"\nservers: tp={args.tp} device={args.device} model={model}; {args.requests} concurrent "
        f"requests x {args.max_new_tokens} tokens, {args.rounds} interleaved rounds; "
        f"logs {shown_path(log_dir)}"
    )
    print(
        f"{'config':<42} {'tokens/s':>9} {'p25-p75':>13} {'vs stock':>8} {'accept':>6} {'ms/step':>8} "
        f"{'same out':>8}"
    )
    for r in results:
        step = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else "-"
        print(
            f"{r['config']:<42} {r['tokens_per_s']:>9.1f} {r['tps_p25']:>6.1f}-{r['tps_p75']:<6.1f} "
            f"{r['speedup_vs_stock']:>7.2f}x {r['accept_length']:>6.2f} {step:>8} "
            f"{'yes' if r['outputs_equal_stock'] else 'NO':>8}"
        )
    for r in results:
        if "coverage_on_over_off" in r:
            print(
                f"{r['config'].removesuffix(COVERAGE_OFF)}: tokens/s with coverage on / off = "
                f"{r['coverage_on_over_off']:.4f} (95% interval of the median {r['ratio_ci95'][0]:.4f}-"
                f"{r['ratio_ci95'][1]:.4f} over {args.rounds} paired rounds; overhead "
                f"{1 - r['coverage_on_over_off']:+.2%})"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(shown_paths({"args": vars(args), "results": results}), indent=1)
        )
    return 0 if all(r["outputs_equal_stock"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
