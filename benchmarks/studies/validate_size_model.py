"""The size model against measured acceptance: serve, count, model, compare with bench_acceptance.

For each domain, a TP=1 EAGLE server of the trained fixture with its largest map (it holds every id
the target emits, so nothing is lost to it) and ``SGLANG_FRSPEC_COUNTS`` serves a set of prompts;
its counts file (committed tokens and accepted drafts per id, its accept length) is what a user
gets from serving. ``sglang-frspec size`` then models every map that ``bench_acceptance.py`` measured,
at each TP it measured, and this script sets the modelled figures next to the measured ones:
accept length relative to no map, and the speed-up over no map. A pair of configurations counts as
resolved when their per-round speed-ups do not overlap; the model should order every resolved pair
as measured. Two prompt sets:
- ``timed``: the prompts bench_acceptance timed (the model given exactly what was measured);
- ``held-out``: the next ``--held-out`` prompts, which it did not time (calibration on other
  traffic, as a user would calibrate).

The model is per verify step (a full batch, as in steady serving); bench_acceptance times one
closed batch, which ends with its slowest request. ``--batch-tail`` serves the timed batch once per
map (TP=1) and reports each map's mean and slowest per-request verify steps, which show that tail.

    python -m benchmarks.studies.validate_size_model --acceptance docs/results/acceptance-cpu.json \
        --head-share 0.40 --batch-tail --json docs/results/size-model-validation.json
    python -m benchmarks.studies.validate_size_model --report docs/results/size-model-validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from itertools import permutations
from pathlib import Path

import torch

from benchmarks.common import fixture_map, shown_path, shown_paths
from sglang_frspec.core import canonical_hot_ids, read_token_map
from sglang_frspec.demo import timing
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.server import SGLangServer
from sglang_frspec.maps import TokenCounts
from sglang_frspec.maps.sizing import estimate_sizes
from tools.draft_training.trained_fixture import MAP_SIZES, trained_fixture
from tools.serving.zygote import forked_launch

DOMAINS = ("code", "prose")
NO_MAP = "EAGLE, no map"
PROMPT_SETS = ("timed", "held-out")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--acceptance", help="bench_acceptance.py --json output")
    source.add_argument(
        "--report", metavar="JSON", help="only print the tables of this script's --json output"
    )
    p.add_argument("--head-share", type=float, default=0.40, help="draft-head share of a step (default 0.40)")
    p.add_argument("--prompt-sets", nargs="+", choices=PROMPT_SETS, default=list(PROMPT_SETS))
    p.add_argument("--held-out", type=int, default=48, help="prompts per domain of the held-out set")
    p.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    p.add_argument("--batch-tail", action="store_true", help="per-request verify steps of each map (TP=1)")
    p.add_argument("--counts-dir", help="keep the servers' counts files and logs here")
    p.add_argument("--json", help="write the comparison here as JSON")
    return p.parse_args(argv)


def eagle_server(fixture, token_map: str, args: argparse.Namespace, log: Path, env: dict) -> SGLangServer:
    """A TP=1 EAGLE server of the fixture with one of its maps, drafting as bench_acceptance did."""
    steps, topk, draft_tokens = (args.bench[k] for k in ("steps", "topk", "draft_tokens"))
    cli = ["--model-path", fixture.target, "--tp-size", "1", *CPU_SERVER_ARGS]
    cli += eagle_args(
        fixture.draft, fixture_map(fixture, token_map), steps=steps, topk=topk, draft_tokens=draft_tokens
    )
    return SGLangServer(cli, cpu_env(1, with_plugin=True, base=os.environ | env), log, launch=forked_launch)


def serve_counts(fixture, domain: str, prompts: list, args: argparse.Namespace, out: Path) -> TokenCounts:
    """Counts of a graceful-shutdown TP=1 server with the largest map that served ``prompts``."""
    path = out / f"served_{domain}.counts.pt"
    largest = f"code_{MAP_SIZES[-1]}"
    env = {"SGLANG_FRSPEC_COUNTS": str(path)}
    with eagle_server(fixture, largest, args, out / f"served_{domain}.log", env) as server:
        timing.generate(server, prompts, args.bench["max_new_tokens"])
        server.proc.send_signal(signal.SIGTERM)  # graceful: the plugin writes its final counts
        server.proc.wait(timeout=120)
    return TokenCounts.load(path)


def prompt_range(prompt_set: str, args: argparse.Namespace) -> tuple[int, int]:
    timed = args.bench["prompts"]
    return (0, timed) if prompt_set == "timed" else (timed, timed + args.held_out)


def batch_tail(fixture, maps: list[str], args: argparse.Namespace, out: Path) -> dict:
    """{map: {domain: (mean, slowest) verify steps per request}} of the timed batch at TP=1."""
    begin, end = prompt_range("timed", args)
    tail = {}
    for name in maps:
        label = Path(name).stem
        print(f"serving the timed batch with {label} ...", flush=True)
        with eagle_server(fixture, name, args, out / f"tail_{label}.log", {}) as server:
            by_domain = tail[label] = {}
            for domain in args.domains:
                steps = [
                    o["meta_info"]["spec_verify_ct"]
                    for o in timing.generate(
                        server, fixture.prompts(domain)[begin:end], args.bench["max_new_tokens"]
                    )
                ]
                by_domain[domain] = (sum(steps) / len(steps), max(steps))
    return tail


def measured_maps(rows: list[dict], fixture) -> dict[str, torch.Tensor]:
    """The canonical hot ids of every map the measurement served (by its name in ``rows``)."""
    vocab = fixture.report["vocab"]
    names = dict.fromkeys(r["map"] for r in rows if r["map"])
    return {
        name: canonical_hot_ids(read_token_map(fixture_map(fixture, name)), vocab, name).ids for name in names
    }


def compare(
    rows: list[dict], maps: dict, counts: TokenCounts, vocab: int, tp: int, domain: str, head_share: float
) -> dict:
    """Modelled against measured for every balanced/full map row (and no map) at this tp and domain."""
    measured = {
        r["map"]: r
        for r in rows
        if r["tp"] == tp
        and r["domain"] == domain
        and (r["config"] == NO_MAP or r["layout"] == "balanced/full")
    }
    no_map = measured.pop(None)
    served = counts.speculative
    estimates = estimate_sizes(
        counts.counts,
        vocab,
        128,
        tp,
        [],
        accept_length=served["accept_length"],
        draft_steps=served["num_steps"],
        accepted=counts.accepted,
        token_maps={name: maps[name] for name in measured},
        head_share=head_share,
    )
    table = {
        NO_MAP: {
            "accept": 1.0,
            "accept_model": 1.0,
            "speedup": 1.0,
            "speedup_model": 1.0,
            "rounds": [1.0, 1.0],
        },
    }
    for e in estimates:
        r = measured[e.token_map]
        table[Path(e.token_map).stem] = {
            "coverage": e.coverage,
            "drafts_kept": e.drafts_kept,
            "accept": r["accept_length"] / no_map["accept_length"],
            "accept_model": e.accept_length / served["accept_length"],
            "speedup": r["vs_no_map"],
            "speedup_model": e.speedup,
            "rounds": [min(r["vs_no_map_rounds"]), max(r["vs_no_map_rounds"])],
        }
    resolved = [(a, b) for a, b in permutations(table, 2) if table[a]["rounds"][0] > table[b]["rounds"][1]]
    wrong = [(a, b) for a, b in resolved if table[a]["speedup_model"] <= table[b]["speedup_model"]]
    return {
        "tp": tp,
        "domain": domain,
        "served_accept_length": served["accept_length"],
        "maps": table,
        "resolved_pairs": resolved,
        "misordered": wrong,
    }


def format_report(report: dict) -> str:
    """The comparison table of a report (this script's JSON), and the batch tail if it has one."""
    results, tail = report["results"], report["batch_tail"]
    width = max(len(name) for res in results for name in res["maps"])
    lines = [
        f"head share {report['head_share']}; measured: {report['acceptance']}",
        f"{'prompts':<9}{'tp':>2} {'domain':<6} {'map':<{width}} {'kept':>6} {'accept':>6} {'model':>6} "
        f"{'speed-up':>8} {'(rounds)':>11} {'model':>6}",
    ]
    for res in results:
        for name, m in res["maps"].items():
            kept = f"{m['drafts_kept']:.1%}" if "drafts_kept" in m else ""
            spread = f"{m['rounds'][0]:.2f}-{m['rounds'][1]:.2f}"
            lines.append(
                f"{res['prompts']:<9}{res['tp']:>2} {res['domain']:<6} {name:<{width}} {kept:>6} "
                f"{m['accept']:>6.3f} {m['accept_model']:>6.3f} {m['speedup']:>7.2f}x {spread:>11} "
                f"{m['speedup_model']:>5.2f}x"
            )
        wrong = ", ".join(f"{a} > {b}" for a, b in res["misordered"]) or "none"
        lines.append(f"  resolved pairs {len(res['resolved_pairs'])}, misordered by the model: {wrong}")
    if tail:
        lines += ["", "verify steps per request of the timed batch, TP=1: mean / slowest"]
        domains = next(iter(tail.values()))
        lines.append(f"{'map':<{width}} " + " ".join(f"{d:>13}" for d in domains))
        for name, by_domain in tail.items():
            cells = " ".join(f"{f'{mean:.1f} / {slowest}':>13}" for mean, slowest in by_domain.values())
            lines.append(f"{name:<{width}} {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        print(format_report(json.loads(Path(args.report).read_text())))
        return 0
    bench = json.loads(Path(args.acceptance).read_text())
    args.bench, rows = bench["args"], bench["results"]
    fixture = trained_fixture()
    out = Path(args.counts_dir or tempfile.mkdtemp(prefix="sglang-frspec-size-model-"))
    maps, vocab = measured_maps(rows, fixture), fixture.report["vocab"]
    results = []
    for prompt_set in args.prompt_sets:
        begin, end = prompt_range(prompt_set, args)
        for domain in args.domains:
            (out / prompt_set).mkdir(parents=True, exist_ok=True)
            print(f"serving {prompt_set} {domain} prompts {begin}..{end - 1} ...", flush=True)
            counts = serve_counts(fixture, domain, fixture.prompts(domain)[begin:end], args, out / prompt_set)
            for tp in sorted({r["tp"] for r in rows}):
                results.append(
                    {"prompts": prompt_set} | compare(rows, maps, counts, vocab, tp, domain, args.head_share)
                )
    tail = {}
    if args.batch_tail:
        tail = batch_tail(fixture, list(maps), args, out)
    report = {
        "head_share": args.head_share,
        "acceptance": shown_path(args.acceptance),  # as the JSON keeps it: --report prints the same
        "results": results,
        "batch_tail": tail,
    }
    print(f"\ncounts and logs: {shown_path(out)}\n{format_report(report)}")
    if args.json:
        Path(args.json).write_text(json.dumps(shown_paths(report), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
