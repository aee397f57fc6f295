"""``sglang-frspec demo``: real servers, EAGLE + token map at TP=N with this plugin, checked.

Runs up to three servers one after another on the same model: plain greedy decoding (the
reference), stock EAGLE without a map (what TP users run today, since a map crashes), and
EAGLE + token map with this plugin. Prints each run's outputs, whether they equal plain greedy
decoding, the accept length and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.fixtures import LLAMA3_VOCAB, perm_fixture
from sglang_frspec.demo.server import SGLangServer

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding speeds up inference by",
    "Once upon a time,",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run real servers: EAGLE + token map with this plugin vs stock, checked and timed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default, runs anywhere) or cuda")
    p.add_argument(
        "--model-path",
        help="target model (default: a tiny built-in fixture with a Llama-3-size vocab, 128256)",
    )
    p.add_argument("--draft-model-path", help="EAGLE draft model (with --model-path)")
    p.add_argument("--token-map", help="token-map file (with --model-path)")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per timed batch")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=2, help="--speculative-num-steps")
    p.add_argument("--topk", type=int, default=2, help="--speculative-eagle-topk")
    p.add_argument("--draft-tokens", type=int, default=4, help="--speculative-num-draft-tokens")
    p.add_argument("--skip-stock", action="store_true", help="do not run stock EAGLE (no map)")
    p.add_argument("--server-args", default="", help="extra launch_server arguments (quoted)")
    p.add_argument("--log-dir", help="keep server logs here (default: a temporary folder)")
    p.set_defaults(func=run)


def _prompts(args, fixture) -> tuple[list[dict], list[list[int]] | None]:
    """Request prompts, and for the fixture the outputs greedy decoding must give (the pi chain)."""
    if fixture is None:
        return [{"text": TEXT_PROMPTS[i % len(TEXT_PROMPTS)]} for i in range(args.requests)], None
    starts = [i * 7 for i in range(args.requests)]
    prompts = [{"input_ids": list(fixture.chain[s : s + 3])} for s in starts]
    expected = [list(fixture.chain[s + 3 : s + 3 + args.max_new_tokens]) for s in starts]
    return prompts, expected


def _timed_batch(server: SGLangServer, prompts: list[dict], max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    server.post("/generate", prompts[0] | {"sampling_params": params})  # warm-up
    batch = {key: [p[key] for p in prompts] for key in prompts[0]}
    start = time.perf_counter()
    outs = server.post("/generate", batch | {"sampling_params": params})
    seconds = time.perf_counter() - start
    accept = [o["meta_info"].get("spec_accept_length") for o in outs]
    accept = [a for a in accept if a is not None]
    return {
        "outputs": [o["output_ids"] for o in outs],
        "text": outs[0].get("text", ""),
        "tokens_per_s": sum(len(o["output_ids"]) for o in outs) / seconds,
        "accept_length": sum(accept) / len(accept) if accept else None,
    }


def _runs(args) -> list[tuple[str, list[str], bool]]:
    """(name, EAGLE arguments, plugin loaded) of each server the demo starts."""
    spec = {"steps": args.steps, "topk": args.topk, "draft_tokens": args.draft_tokens}
    runs = [("plain greedy (reference)", [], False)]
    if not args.skip_stock:
        runs.append(("EAGLE, no map (stock)", eagle_args(args.draft_model_path, **spec), False))
    with_map = eagle_args(args.draft_model_path, args.token_map, **spec)
    runs.append(("EAGLE + map (sglang-frspec)", with_map, True))
    return runs


def _env(args, plugin: bool) -> dict:
    if args.device == "cpu":
        return cpu_env(args.tp, with_plugin=plugin)
    return dict(os.environ, SGLANG_PLUGINS="frspec" if plugin else "none")


def run(args: argparse.Namespace) -> int:
    fixture = None
    if args.model_path is None:
        print(f"building/using the built-in fixture (V={LLAMA3_VOCAB}, greedy x -> pi(x)) ...")
        fixture = perm_fixture(vocab_size=LLAMA3_VOCAB, num_hot=32768)
        args.model_path, args.draft_model_path = fixture.target, fixture.draft
        args.token_map = fixture.token_map("hot")
    elif not (args.draft_model_path and args.token_map):
        print("demo: --model-path needs --draft-model-path and --token-map", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-frspec-demo-"))
    base = ["--model-path", args.model_path, "--tp-size", str(args.tp)]
    base += CPU_SERVER_ARGS if args.device == "cpu" else ["--device", args.device]
    base += shlex.split(args.server_args)
    prompts, expected = _prompts(args, fixture)
    runs = _runs(args)
    results = {}
    for i, (name, extra, plugin) in enumerate(runs, start=1):
        print(f"[{i}/{len(runs)}] {name}: starting a TP={args.tp} server ...", flush=True)
        with SGLangServer(base + extra, _env(args, plugin), log_dir / f"server{i}.log") as server:
            results[name] = _timed_batch(server, prompts, args.max_new_tokens)
    reference = results[runs[0][0]]
    print(f"\nmodel {args.model_path}\ntoken map {args.token_map}\nserver logs {log_dir}")
    print(f"first output: {reference['outputs'][0][:10]} ... {reference['text'][:60]!r}")
    ok = True
    if expected is not None:
        ok = reference["outputs"] == expected
        print(f"plain greedy follows the fixture's pi chain: {'yes' if ok else 'NO'}")
    print(f"\n{'run':<30} {'matches greedy':>14} {'accept len':>10} {'tokens/s':>9}")
    for name, result in results.items():
        same = result["outputs"] == reference["outputs"]
        ok &= same
        accept = "-" if result["accept_length"] is None else f"{result['accept_length']:.2f}"
        tps = result["tokens_per_s"]
        print(f"{name:<30} {'yes' if same else 'NO':>14} {accept:>10} {tps:>9.1f}")
    print("\nall outputs equal plain greedy decoding" if ok else "\nMISMATCH: see above")
    return 0 if ok else 1
