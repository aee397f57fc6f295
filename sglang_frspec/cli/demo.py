"""``sglang-frspec demo``: real servers, EAGLE + token map at TP=N with this plugin, checked.

Runs up to three servers one after another on the same model: plain greedy decoding (the
reference), stock EAGLE without a map (what TP users run today, since a map crashes), and
EAGLE + token map with this plugin. Prints a few prompts and the text each run generates, and for
each run, one request at a time (latency, what speculative decoding is for) and all requests at
once (throughput, where plain decoding batches well): whether its outputs equal plain greedy
decoding, the accept length, tokens/s, the ratio to stock EAGLE (the plugin's contribution: the
FR-Spec effect), one request at a time this host's break-even accept length (a speculative cycle's
cost in plain decode steps, measured in this run), and last the ratio to plain decoding, which the
host and the draft decide: EAGLE wins where the draft's accept length is above the break-even.

The default model is Gemma 3 270M (262144-id vocab), a real pretrained model built once from the
package index into the cache (``sglang_frspec/demo/gemma3.py``), with the EAGLE draft trained for it
and a 32768-id map of the standard library's text; its plain greedy outputs are also checked
against Transformers' float32 greedy decoding. ``--fixture perm`` runs a tiny model with a
Llama-3-size vocab whose drafts are always accepted instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.server import Launch, SGLangServer, new_python, plugin_activity
from sglang_frspec.demo.timing import timed_batch, warm_up

SHOWN_PROMPTS = 4  # prompts whose text the demo prints
DEFAULT_SPEC = (2, 2, 4)  # EAGLE steps, topk, draft tokens where the model names none
PLAIN, STOCK, PLUGIN = "plain greedy (reference)", "EAGLE, no map (stock)", "EAGLE + map (sglang-frspec)"


@dataclass
class Workload:
    """What the servers are asked, and what plain greedy decoding must give (when known)."""

    prompts: list[dict]  # /generate payload pieces: {"text": ...} or {"input_ids": ...}
    expected: list[list[int]] | None = None
    expected_name: str = ""
    server_args: tuple[str, ...] = ()
    tokenizer: str | None = None  # decodes ids for display when the servers skip their tokenizer
    spec: tuple[int, int, int] = DEFAULT_SPEC  # EAGLE steps, topk, draft tokens unless given


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
        "--fixture",
        choices=("gemma3", "perm"),
        default="gemma3",
        help="built-in model when --model-path is not given: gemma3 (default; Gemma 3 270M, a real "
        "pretrained model, with its trained EAGLE draft) or perm (a tiny random model with a "
        "Llama-3-size vocab whose greedy output follows a permutation and whose drafts are all accepted)",
    )
    p.add_argument("--model-path", help="target model (instead of the built-in fixture)")
    p.add_argument("--draft-model-path", help="EAGLE draft model (with --model-path)")
    p.add_argument("--token-map", help="token-map file (with --model-path)")
    p.add_argument(
        "--map-size",
        type=int,
        default=32768,
        help="gemma3 fixture: which of its maps of the training text (4096 ... 65536 ids; default 32768)",
    )
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per timed batch")
    p.add_argument(
        "--one-at-a-time",
        type=int,
        default=2,
        metavar="N",
        help="also time the first N prompts one request at a time, the latency speculative decoding "
        "is for, and the host's break-even accept length (default 2; 0: only the concurrent batch)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=48,
        help="tokens per request (default 48)",
    )
    spec_help = "(default: gemma3 1, 1, 2, its best in the TP=2 sweep; otherwise 2, 2, 4)"
    p.add_argument("--steps", type=int, help=f"--speculative-num-steps {spec_help}")
    p.add_argument("--topk", type=int, help="--speculative-eagle-topk")
    p.add_argument("--draft-tokens", type=int, help="--speculative-num-draft-tokens")
    p.add_argument("--skip-stock", action="store_true", help="do not run stock EAGLE (no map)")
    p.add_argument("--server-args", default="", help="extra launch_server arguments (quoted)")
    p.add_argument("--log-dir", help="keep server logs here (default: a temporary folder)")
    p.add_argument("--json", metavar="FILE", help="also write every run's outputs and figures here")
    p.set_defaults(func=run)


def _gemma3_workload(args) -> Workload:
    from sglang_frspec.demo.gemma3 import DEMO_SPEC, MAP_SIZES, SERVER_ARGS, gemma3_fixture

    if args.map_size not in MAP_SIZES:
        raise SystemExit(f"demo: the gemma3 fixture has maps of {list(MAP_SIZES)} ids, not {args.map_size}")
    print("building/using Gemma 3 270M (262144-id vocab; built once from the package index) ...")
    fixture = gemma3_fixture()
    args.model_path, args.draft_model_path = fixture.target, fixture.draft
    args.token_map = fixture.token_map(args.map_size)
    picks = [i % len(fixture.prompts) for i in range(args.requests)]
    n = args.max_new_tokens
    expected = [fixture.reference[i][:n] for i in picks] if n <= len(fixture.reference[0]) else None
    return Workload(
        [{"input_ids": fixture.prompts[i]} for i in picks],
        expected,
        "Transformers' float32 greedy decoding",
        SERVER_ARGS,
        fixture.target,
        DEMO_SPEC,
    )


def _perm_workload(args) -> Workload:
    from sglang_frspec.demo.fixtures import LLAMA3_VOCAB, perm_fixture

    print(f"building/using the tiny permutation fixture (V={LLAMA3_VOCAB}, greedy x -> pi(x)) ...")
    fixture = perm_fixture(vocab_size=LLAMA3_VOCAB, num_hot=32768)
    args.model_path, args.draft_model_path = fixture.target, fixture.draft
    args.token_map = fixture.token_map("hot")
    starts = [i * 7 for i in range(args.requests)]
    prompts = [{"input_ids": list(fixture.chain[s : s + 3])} for s in starts]
    expected = [list(fixture.chain[s + 3 : s + 3 + args.max_new_tokens]) for s in starts]
    return Workload(prompts, expected, "the fixture's pi chain")


def _workload(args) -> Workload:
    if args.model_path is None:
        return _gemma3_workload(args) if args.fixture == "gemma3" else _perm_workload(args)
    if not (args.draft_model_path and args.token_map):
        raise SystemExit("demo: --model-path needs --draft-model-path and --token-map")
    from sglang_frspec.demo.gemma3 import DEMO_PROMPTS

    return Workload([{"text": DEMO_PROMPTS[i % len(DEMO_PROMPTS)]} for i in range(args.requests)])


def break_even(plain: dict, spec: dict) -> float:
    """The accept length at which ``spec`` decodes as fast as ``plain``: a speculative cycle's
    cost in plain decode steps, ``t_cycle / t_plain``, from ``batch_figures`` of one request at a time.

    The cost model of ``benchmarks/cycle_profile.py`` (``predicted_ratio``; docs/benchmarks.md,
    "Where a cycle's time goes", found it within 5% of the measured ratios): a cycle commits ``a``
    tokens (the accept length) where a plain step commits one, so tokens/s over plain decoding's
    is ``a * t_plain / t_cycle``, above 1 exactly when ``a > t_cycle / t_plain``. Here, with one
    request at a time, ``t_plain`` = plain's seconds / its tokens (one step per token) and
    ``t_cycle`` = ``spec``'s seconds / its verify cycles; the one prefill each request starts with
    (its prompt cached by the concurrent batch before) is inside both, as its token is inside
    SGLang's accept length."""
    return (spec["seconds"] / spec["cycles"]) / (plain["seconds"] / plain["tokens"])


def _measure(server: SGLangServer, prompts: list[dict], max_new_tokens: int, one_at_a_time: int) -> dict:
    """Every prompt at once (throughput), then the first ``one_at_a_time`` prompts one after another
    (latency: what speculative decoding is for) under ``"one_at_a_time"``."""
    batch = [p.get("text", p.get("input_ids")) for p in prompts]
    warm_up(server, batch)
    result = timed_batch(server, batch, max_new_tokens)
    if one_at_a_time:
        result["one_at_a_time"] = timed_batch(server, batch[:one_at_a_time], max_new_tokens, at_once=1)
    return result


def _spec(args, default_spec: tuple[int, int, int]) -> dict[str, int]:
    """EAGLE's steps, topk and draft tokens: the flags given, ``default_spec``'s values for the rest."""
    given = (args.steps, args.topk, args.draft_tokens)
    steps, topk, draft_tokens = (d if g is None else g for g, d in zip(given, default_spec))
    return {"steps": steps, "topk": topk, "draft_tokens": draft_tokens}


def _runs(args, spec: dict[str, int]) -> list[tuple[str, list[str], bool]]:
    """(name, EAGLE arguments, plugin loaded) of each server the demo starts."""
    runs = [(PLAIN, [], False)]
    if not args.skip_stock:
        runs.append((STOCK, eagle_args(args.draft_model_path, **spec), False))
    runs.append((PLUGIN, eagle_args(args.draft_model_path, args.token_map, **spec), True))
    return runs


def _env(args, plugin: bool) -> dict:
    if args.device == "cpu":
        return cpu_env(args.tp, with_plugin=plugin)
    return dict(os.environ, SGLANG_PLUGINS="frspec" if plugin else "none")


def _show_texts(work: Workload, results: dict) -> None:
    """The first prompts and each run's continuation (the runs that equal the reference once)."""
    decode = None
    if work.tokenizer is not None:
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(work.tokenizer).decode
    names = list(results)
    for i, prompt in enumerate(work.prompts[:SHOWN_PROMPTS]):
        text = prompt.get("text") or (decode(prompt["input_ids"], skip_special_tokens=True) if decode else "")
        print(f"\nprompt {i + 1}: {text!r}")
        for name in names:
            out = results[name]["outputs"][i]
            same = name != names[0] and out == results[names[0]]["outputs"][i]
            body = results[name]["texts"][i] or (decode(out) if decode else str(out[:16]))
            print(f"  {name:<28} {'(same as plain greedy)' if same else repr(body)}")


def _ratio(result: dict, other: dict) -> float:
    return result["tokens_per_s"] / other["tokens_per_s"]


def _show_table(results: dict, reference: dict, concurrent: int) -> bool:
    """Each run in each mode: whether it equals plain greedy decoding in that mode, its accept
    length, tokens/s, their ratio to stock EAGLE's (the plugin's contribution) and, one request at
    a time, the break-even accept length of this host; last, the ratio to plain decoding's (this
    host's and the draft's). Returns whether every run matched."""
    modes = [(f"{concurrent} at once", lambda r: r, False)]
    if "one_at_a_time" in reference:
        modes.insert(0, ("one at a time", lambda r: r["one_at_a_time"], True))
    ok = True
    for title, pick, alone in modes:
        print(
            f"\n{title + ':':<30} {'matches greedy':>14} {'accept len':>10} {'tokens/s':>9} {'x stock':>8}"
            f" {'break-even':>10} {'x plain':>8}"
        )
        plain, stock = pick(reference), pick(results[STOCK]) if STOCK in results else None
        for name, result in results.items():
            mode = pick(result)
            same = mode["outputs"] == plain["outputs"]
            ok &= same
            spec = mode["cycles"] is not None
            accept = f"{mode['accept_length']:.2f}" if spec else "-"
            x_stock = f"{_ratio(mode, stock):.2f}x" if spec and stock else "-"
            even = f"{break_even(plain, mode):.2f}" if spec and alone else "-"
            print(
                f"  {name:<28} {'yes' if same else 'NO':>14} {accept:>10} {mode['tokens_per_s']:>9.1f}"
                f" {x_stock:>8} {even:>10} {_ratio(mode, plain):>7.2f}x"
            )
    return ok


def verdict(results: dict) -> list[str]:
    """What the one-request-at-a-time figures say: the plugin's contribution first (EAGLE + map
    against stock EAGLE, at the accept length both get from the same draft), then why EAGLE wins or
    loses against plain decoding on this host (the draft's accept length against the host's
    break-even, ``break_even``)."""
    if "one_at_a_time" not in results[PLAIN]:
        return ["no break-even measured: it is measured one request at a time (--one-at-a-time 0)"]
    plain, plugin = results[PLAIN]["one_at_a_time"], results[PLUGIN]["one_at_a_time"]
    even, accept = break_even(plain, plugin), plugin["accept_length"]
    lines = ["one request at a time:"]
    if STOCK in results:
        stock = results[STOCK]["one_at_a_time"]
        lines.append(
            f"  FR-Spec effect (the plugin's contribution): EAGLE + map runs {_ratio(plugin, stock):.2f}x "
            f"stock EAGLE ({plugin['tokens_per_s']:.1f} against {stock['tokens_per_s']:.1f} tokens/s) at "
            f"accept length {accept:.2f} against {stock['accept_length']:.2f}: the map cuts a cycle from "
            f"{break_even(plain, stock):.2f} to {even:.2f} plain decode steps"
        )
    else:
        lines.append("  FR-Spec effect: not measured (--skip-stock: no stock EAGLE to set the map against)")
    t_cycle, t_plain = plugin["seconds"] / plugin["cycles"], plain["seconds"] / plain["tokens"]
    lines.append(
        f"  this host's break-even accept length: {even:.2f} (an EAGLE + map cycle takes "
        f"{1e3 * t_cycle:.0f} ms, a plain decode step {1e3 * t_plain:.0f} ms); the draft's: {accept:.2f}"
    )
    side, outcome = ("above", "beats") if accept > even else ("not above", "does not beat")
    lines.append(
        f"  against plain decoding (the host's and the draft's, not the plugin's): EAGLE + map {outcome} it"
        f" here, {_ratio(plugin, plain):.2f}x, as the draft's accept length is {side} this host's break-even"
    )
    return lines


def run(args: argparse.Namespace, launch: Launch = new_python) -> int:
    """The demo; ``launch`` starts each server's launcher (a new Python, as a user's would be)."""
    started = time.monotonic()
    try:
        work = _workload(args)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    seconds = dict.fromkeys(("model", "server starts", "measuring", "server stops"), 0.0)
    seconds["model"] = time.monotonic() - started
    print(f"model ready in {seconds['model']:.0f} s", flush=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-frspec-demo-"))
    base = ["--model-path", args.model_path, "--tp-size", str(args.tp)]
    base += CPU_SERVER_ARGS if args.device == "cpu" else ["--device", args.device]
    base += [*work.server_args, *shlex.split(args.server_args)]
    spec = _spec(args, work.spec)
    runs = _runs(args, spec)
    results = {}
    for i, (name, extra, plugin) in enumerate(runs, start=1):
        print(f"[{i}/{len(runs)}] {name}: starting a TP={args.tp} server ...", flush=True)
        log_path = log_dir / f"server{i}.log"
        with SGLangServer(base + extra, _env(args, plugin), log_path, launch=launch) as server:
            measuring = time.monotonic()
            results[name] = _measure(server, work.prompts, args.max_new_tokens, args.one_at_a_time)
            results[name]["plugin"] = plugin_activity(server.log())
            stopping = time.monotonic()
        stopped = time.monotonic() - stopping
        measured = stopping - measuring
        ready = server.ready_after
        seconds["server starts"] += ready
        seconds["measuring"] += measured
        seconds["server stops"] += stopped
        print(f"    ready in {ready:.0f} s, measured in {measured:.0f} s, stopped in {stopped:.0f} s")
    reference = results[runs[0][0]]
    print(f"\nmodel {args.model_path}\ndraft {args.draft_model_path}\ntoken map {args.token_map}")
    print(f"EAGLE {spec['steps']} steps, topk {spec['topk']}, {spec['draft_tokens']} draft tokens")
    print(f"server logs {log_dir}")
    _show_texts(work, results)
    ok = True
    if work.expected is not None:
        ok = reference["outputs"] == work.expected
        print(f"\nplain greedy equals {work.expected_name}: {'yes' if ok else 'NO'}")
    ok &= _show_table(results, reference, len(work.prompts))
    print("\nall outputs equal plain greedy decoding" if ok else "\nMISMATCH: see above")
    print("\n" + "\n".join(verdict(results)))
    total = time.monotonic() - started
    phases = ", ".join(f"{phase} {s:.0f} s" for phase, s in seconds.items())
    print(f"\ndemo: {total:.0f} s ({phases}, the rest {total - sum(seconds.values()):.0f} s)")
    if args.json:
        payload = {"prompts": work.prompts, "expected": work.expected, "runs": results}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0 if ok else 1
