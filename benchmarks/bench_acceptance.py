"""Acceptance and speed on a model trained on real text: no map vs maps of each size, side by side.

The trained fixture (``tests.harness.trained``: a 32k-vocab BPE Llama trained on the
Python standard library's code, and an EAGLE draft trained on its hidden states) is served by real
CPU SGLang servers. Prompts are held-out code (the training domain) and held-out prose from the
language reference (another domain); their launchers and schedulers are forked from a zygote, as
the test servers' are (``tests.harness.zygote``). For each TP size every configuration runs as its
own server:
plain greedy decoding, EAGLE without a map, EAGLE + each map (this plugin; balanced/full) and, at
TP > 1, the other layouts and exchanges on one map. Timed batches are interleaved round-robin
across the servers alive at a time (the two references stay alive throughout; the others come in
groups of ``--alive``), idle ones suspended; ratios use the references' samples from the same rounds.

Reports per configuration and domain: accept length, tokens/s, ratio to EAGLE without a map and to
plain decoding, and whether the outputs equal plain greedy decoding at that TP (tie-aware: a
difference is allowed only at a top-2 near-tie of the target, see tests.harness.greedy).
    python benchmarks/bench_acceptance.py --json docs/results/acceptance.json --plot docs/acceptance.png

``--fixture gemma3`` runs the same on a real pretrained model: Gemma 3 270M (262144 ids,
``sglang_frspec.demo.gemma3``) with its shipped EAGLE draft and its maps of the training text
(4096 ... 65536 ids), on prompts cut from held-out code and prose with its tokenizer. A TP=2 server
of it holds about 7.5 GB, so ``--one-reference`` keeps only EAGLE without a map alive as the
reference (plain decoding's ratios are then chained through it), and ``--stock-tp1`` makes the
TP=1 servers stock SGLang (no plugin), whose accept lengths the TP=2 plugin's must equal:
    python benchmarks/bench_acceptance.py --fixture gemma3 --stock-tp1 --one-reference --alive 1 \
        --layouts balanced/topk --layout-map 8192 32768 --prompts 8 --max-new-tokens 32 \
        --json docs/results/acceptance-gemma3-cpu.json --plot docs/acceptance-gemma3.png

``--sampling`` measures accept length under sampling instead (no timing): EAGLE without a map and
with ``--sampling-map``, each with SGLang's target-only verify and with rejection sampling
(``--speculative-use-rejection-sampling``), one server each, at each of ``--temperatures``
(requests seeded through ``--random-seed``; at temperature 0 rejection sampling is greedy).
    python benchmarks/bench_acceptance.py --sampling --tp 1 --max-new-tokens 32 \
        --json docs/results/acceptance-sampling-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.harness
from common import fixture_map, shown_path, shown_paths, summarize  # noqa: E402

from sglang_frspec.demo import gemma3  # noqa: E402
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args  # noqa: E402
from sglang_frspec.demo.server import SGLangServer  # noqa: E402
from tests.harness.greedy import compare_greedy  # noqa: E402
from tests.harness.trained import MAP_SIZES, PROSE_MAP_SIZE, trained_fixture  # noqa: E402
from tests.harness.zygote import forked_launch  # noqa: E402

PLAIN, NO_MAP = "plain greedy", "EAGLE, no map"
DOMAINS = ("code", "prose")
# The verify under sampling: SGLang's default (target-only, any draft) or rejection sampling.
VERIFIES = {"target-only": (), "rejection": ("--speculative-use-rejection-sampling",)}
SEED = ("--random-seed", "36")


@dataclass
class Config:
    name: str
    tp: int
    eagle: bool = True
    token_map: str | None = None  # a map name of the fixture, or a map file
    layout: str = "balanced"
    exchange: str = "full"
    extra: tuple = ()  # more server arguments
    samples: dict = field(default_factory=lambda: {d: [] for d in DOMAINS})


# Per fixture: its maps by default, the map of the layout/exchange rows, the prefix of the maps
# plotted against their size.
FIXTURE_MAPS = {
    "trained": (
        [f"code_{n}" for n in MAP_SIZES] + [f"prose_{PROSE_MAP_SIZE}"],
        f"code_{MAP_SIZES[1]}",
        "code_",
    ),
    "gemma3": ([str(n) for n in gemma3.MAP_SIZES], "32768", ""),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixture", choices=tuple(FIXTURE_MAPS), default="trained")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--maps",
        nargs="+",
        help="fixture maps or map files to compare (default: every size of the fixture's maps; "
        f"trained: {FIXTURE_MAPS['trained'][0]}, gemma3: {FIXTURE_MAPS['gemma3'][0]})",
    )
    p.add_argument(
        "--layout-map", nargs="+", help="maps of the layout/exchange rows (trained: code_128, gemma3: 32768)"
    )
    p.add_argument("--stock-tp1", action="store_true", help="TP=1 servers without the plugin (stock SGLang)")
    p.add_argument(
        "--one-reference",
        action="store_true",
        help="keep only EAGLE without a map alive as the reference (plain decoding then runs in a group "
        "of its own and its ratios are chained through that reference): for models whose servers do "
        "not fit three at a time",
    )
    p.add_argument(
        "--layouts",
        nargs="*",
        default=["local/full", "balanced/topk", "local/topk"],
        help="other layout/exchange pairs at TP > 1 (balanced/full is every map's row)",
    )
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain (one batch)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed batches per config and domain")
    p.add_argument("--alive", type=int, default=3, help="map configurations alive at once")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--log-dir", help="keep server logs here")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", help="write accept length and speed against map size here (.png)")
    p.add_argument("--sampling", action="store_true", help="accept length under sampling (see above)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--sampling-map", help="the map of --sampling (default: the --layout-map default)")
    args = p.parse_args(argv)
    maps, layout_map, _ = FIXTURE_MAPS[args.fixture]
    args.maps = args.maps or maps
    args.layout_map = args.layout_map or [layout_map]
    args.sampling_map = args.sampling_map or layout_map
    return args


def configs_for(tp: int, args: argparse.Namespace) -> list[Config]:
    configs = [Config(PLAIN, tp, eagle=False), Config(NO_MAP, tp)]
    configs += [Config(f"map {Path(m).stem}", tp, token_map=m) for m in args.maps]
    if tp > 1:
        for token_map in args.layout_map:
            for pair in args.layouts:
                layout, exchange = pair.split("/")
                name = f"map {Path(token_map).stem} {pair}"
                configs.append(Config(name, tp, True, token_map, layout, exchange))
    return configs


def start(config: Config, fixture, args, log_dir: Path) -> SGLangServer:
    cli = ["--model-path", fixture.target, "--tp-size", str(config.tp), *CPU_SERVER_ARGS]
    cli += gemma3.SERVER_ARGS if isinstance(fixture, gemma3.Gemma3Fixture) else ()
    if config.eagle:
        token_map = fixture_map(fixture, config.token_map) if config.token_map else None
        cli += eagle_args(
            fixture.draft, token_map, steps=args.steps, topk=args.topk, draft_tokens=args.draft_tokens
        )
    cli += config.extra
    options = {"SGLANG_FRSPEC_LAYOUT": config.layout, "SGLANG_FRSPEC_EXCHANGE": config.exchange}
    plugin = config.tp > 1 or not args.stock_tp1
    env = cpu_env(config.tp, with_plugin=plugin, base=os.environ | options)
    name = f"tp{config.tp}-{config.name.replace(' ', '_').replace('/', '-')}.log"
    print(f"starting tp={config.tp} {config.name} ...", flush=True)
    server = SGLangServer(cli, env, log_dir / name, launch=forked_launch).start().wait_ready()
    server.suspend()  # idle schedulers poll: the next server would start (and run) next to them
    return server


def timed_batch(server: SGLangServer, prompts: list[list[int]], max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    begin = time.perf_counter()
    outs = server.post("/generate", {"input_ids": prompts, "sampling_params": params})
    seconds = time.perf_counter() - begin
    accept = [o["meta_info"].get("spec_accept_length") or 1.0 for o in outs]
    return {
        "outputs": [o["output_ids"] for o in outs],
        "tokens_per_s": sum(len(o["output_ids"]) for o in outs) / seconds,
        "accept_length": sum(accept) / len(accept),
    }


def measure(group: list[Config], servers: dict, prompts: dict, args) -> None:
    """Interleaved rounds over the (suspended) servers of ``group``; each round times every domain's batch."""
    for round_ in range(args.rounds + 1):  # round 0 warms up and is not kept
        order = group[round_ % len(group) :] + group[: round_ % len(group)]
        for config in order:
            server = servers[config.name]
            server.resume()
            # untimed: the first request after SIGCONT would time the wake-up, and it is always code's
            timed_batch(server, prompts[DOMAINS[-1]][:1], 4)
            for domain in DOMAINS:
                sample = timed_batch(server, prompts[domain], args.max_new_tokens)
                if round_:
                    sample["group"] = tuple(c.name for c in group)
                    config.samples[domain].append(sample)
            server.suspend()


def greedy_match(target: str, prompts: list, got: list, expected: list) -> str:
    """``yes``, ``ties N`` (equal but for N near-tie flips of the target) or ``NO``."""
    try:
        ties = compare_greedy(target, prompts, got, expected)
    except AssertionError:
        return "NO"
    return f"ties {len(ties)}" if ties else "yes"


def run_tp(tp: int, fixture, args, log_dir: Path, prompts: dict) -> list[Config]:
    configs = configs_for(tp, args)
    references = configs[1:2] if args.one_reference else configs[:2]  # [PLAIN, NO_MAP, maps...]
    others = [c for c in configs if all(c is not r for r in references)]
    servers = {c.name: start(c, fixture, args, log_dir) for c in references}
    try:
        for i in range(0, len(others), args.alive):
            group = others[i : i + args.alive]
            try:
                for config in group:
                    servers[config.name] = start(config, fixture, args, log_dir)
                measure(references + group, servers, prompts, args)
            finally:
                for config in group:
                    servers.pop(config.name).stop()
    finally:
        for server in servers.values():
            server.stop()
    return configs


def round_ratios(samples: list[dict], ref_samples: list[dict]) -> list[float]:
    """Tokens/s over the reference's, round by round (the reference's samples of the same groups)."""
    groups = dict.fromkeys(s["group"] for s in samples)
    paired = [r for group in groups for r in ref_samples if r["group"] == group]
    return [s["tokens_per_s"] / r["tokens_per_s"] for s, r in zip(samples, paired, strict=True)]


def group_ratio(samples: list[dict], ref_samples: list[dict]) -> float:
    """Median over interleaved groups of (median tokens/s of ``samples`` / the reference's) within
    each group: only samples from the same rounds are compared (the references run in every group)."""
    ratios = []
    for group in dict.fromkeys(s["group"] for s in samples):
        mine = [s["tokens_per_s"] for s in samples if s["group"] == group]
        ref = [s["tokens_per_s"] for s in ref_samples if s["group"] == group]
        ratios.append(summarize(mine)["median"] / summarize(ref)["median"])
    return summarize(ratios)["median"]


def vs_reference(samples: list[dict], ref_samples: list[dict], no_map_samples: list[dict]) -> float:
    """``group_ratio`` where the reference ran in every group of ``samples``; else chained through
    EAGLE without a map, which runs in every group."""
    if {s["group"] for s in samples} <= {r["group"] for r in ref_samples}:
        return group_ratio(samples, ref_samples)
    return group_ratio(samples, no_map_samples) / group_ratio(ref_samples, no_map_samples)


def summarize_tp(configs: list[Config], fixture, prompts: dict) -> list[dict]:
    by_name = {c.name: c for c in configs}
    rows = []
    for config in configs:
        for domain in DOMAINS:
            samples = config.samples[domain]
            no_map = by_name[NO_MAP].samples[domain]
            ratios = {
                ref: vs_reference(samples, by_name[ref].samples[domain], no_map) for ref in (PLAIN, NO_MAP)
            }
            plain = by_name[PLAIN].samples[domain][0]["outputs"]
            rows.append(
                {
                    "tp": config.tp,
                    "config": config.name,
                    "map": config.token_map,
                    "layout": f"{config.layout}/{config.exchange}" if config.token_map else None,
                    "domain": domain,
                    "accept_length": samples[0]["accept_length"],
                    "tokens_per_s": summarize([s["tokens_per_s"] for s in samples])["median"],
                    "vs_no_map": ratios[NO_MAP],
                    "vs_plain": ratios[PLAIN],
                    "tokens_per_s_rounds": [s["tokens_per_s"] for s in samples],
                    "vs_no_map_rounds": round_ratios(samples, by_name[NO_MAP].samples[domain]),
                    "same_accept_every_round": len({s["accept_length"] for s in samples}) == 1,
                    "equals_plain_greedy": greedy_match(
                        fixture.target, prompts[domain], samples[0]["outputs"], plain
                    ),
                }
            )
    return rows


def sampling_rows(tp: int, fixture, args, log_dir: Path, prompts: dict) -> list[dict]:
    """Accept length per (map, verify, temperature, domain): one server per map and verify, every
    temperature's batches on it (the mean of the requests' accept lengths, as ``timed_batch``)."""
    rows = []
    for token_map in (None, args.sampling_map):
        for verify, extra in VERIFIES.items():
            name = f"{f'map {Path(token_map).stem}' if token_map else 'no map'}, {verify}"
            server = start(
                Config(name, tp, token_map=token_map, extra=(*extra, *SEED)), fixture, args, log_dir
            )
            server.resume()
            try:
                for temperature in args.temperatures:
                    for domain in DOMAINS:
                        params = {"max_new_tokens": args.max_new_tokens, "temperature": temperature,
                                  "ignore_eos": True}  # fmt: skip
                        outs = server.post(
                            "/generate", {"input_ids": prompts[domain], "sampling_params": params}
                        )
                        accept = [o["meta_info"]["spec_accept_length"] for o in outs]
                        row = {"tp": tp, "map": token_map, "verify": verify, "temperature": temperature}
                        rows.append(row | {"domain": domain, "accept_length": sum(accept) / len(accept)})
            finally:
                server.stop()
    return rows


def print_sampling(rows: list[dict], temperatures: list[float]) -> None:
    """One line per TP, map and verify; one column per temperature and domain."""
    columns = [(t, d) for t in temperatures for d in DOMAINS]
    print(f"{'tp':>2} {'map':<10} {'verify':<12} " + " ".join(f"{f'T={t:g} {d}':>12}" for t, d in columns))
    for key in dict.fromkeys((r["tp"], r["map"], r["verify"]) for r in rows):
        cells = {
            (r["temperature"], r["domain"]): r["accept_length"]
            for r in rows
            if (r["tp"], r["map"], r["verify"]) == key
        }
        tp, token_map, verify = key
        line = f"{tp:>2} {Path(token_map).stem if token_map else 'no map':<10} {verify:<12} "
        print(line + " ".join(f"{cells[c]:>12.2f}" for c in columns))


def map_size(token_map: str | None, prefix: str) -> int | None:
    """The size in a map's name (``code_128`` with prefix ``code_``, ``32768`` with none)."""
    match = re.fullmatch(rf"{prefix}(\d+)", Path(token_map).stem) if token_map else None
    return int(match.group(1)) if match else None


def plot(rows: list[dict], path: str, prefix: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    accept_axes, speed_axes = figure.subplots(1, 2)
    for tp in sorted({r["tp"] for r in rows}):
        for domain, style in zip(DOMAINS, ("-o", "--s")):
            points = sorted(
                (map_size(r["map"], prefix), r)
                for r in rows
                if r["tp"] == tp and r["domain"] == domain and map_size(r["map"], prefix)
                and r["layout"] == "balanced/full"
            )  # fmt: skip
            sizes = [s for s, _ in points]
            label = f"TP={tp} {domain} prompts"
            accept_axes.plot(sizes, [r["accept_length"] for _, r in points], style, label=label)
            speed_axes.plot(sizes, [r["vs_no_map"] for _, r in points], style, label=label)
            no_map = next(
                r for r in rows if r["tp"] == tp and r["domain"] == domain and r["config"] == NO_MAP
            )
            accept_axes.axhline(no_map["accept_length"], color="grey", linewidth=0.5)
    for axes, ylabel in ((accept_axes, "accept length"), (speed_axes, "tokens/s vs EAGLE without a map")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("map size (hot ids of the training text)")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
    accept_axes.legend(fontsize=8)
    accept_axes.set_title("grey lines: EAGLE without a map", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def gemma3_prompts(target: str, count: int) -> dict[str, list[list[int]]]:
    """``count`` prompts per domain, as the trained fixture's: windows of its held-out code and
    prose every 97 tokens, BOS + 39 ids each (Gemma 3's tokenizer)."""
    from transformers import AutoTokenizer

    from sglang_frspec.demo.texts import stdlib_texts

    tokenizer = AutoTokenizer.from_pretrained(target)
    _, held_code, _, held_prose = stdlib_texts()
    prompts = {}
    for domain, texts in zip(DOMAINS, (held_code, held_prose)):
        stream = tokenizer("\n\n".join(texts), add_special_tokens=False).input_ids
        body = gemma3.PROMPT_TOKENS - 1
        prompts[domain] = [[tokenizer.bos_token_id, *stream[i : i + body]] for i in range(0, 97 * count, 97)]
    return prompts


def fixture_line(fixture, report: dict) -> str:
    if isinstance(fixture, gemma3.Gemma3Fixture):
        return (
            f"Gemma 3 270M: vocab {gemma3.VOCAB}, float32, perplexity {report['perplexity']:.1f} on held-out "
            f"prose; its shipped EAGLE draft ({shown_path(fixture.draft)})"
        )
    return (
        f"trained fixture: vocab {report['vocab']}, target held-out loss {report['target_held_out_loss']:.2f}"
        f" nats (unigram {report['unigram_held_out_loss']:.2f})"
    )


def accept_lengths_across_tp(rows: list[dict]) -> list[str]:
    """Rows whose accept length differs from the same map's (any layout and exchange) and domain at
    the smallest TP."""
    first = min(r["tp"] for r in rows)
    base = {(r["map"] or r["config"], r["domain"]): r["accept_length"] for r in rows if r["tp"] == first}
    return [
        f"tp={r['tp']} {r['config']} {r['domain']}: {r['accept_length']:.4f} vs {base[key]:.4f}"
        for r in rows
        if r["tp"] != first
        and (key := (r["map"] or r["config"], r["domain"])) in base
        and r["accept_length"] != base[key]
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fixture == "gemma3":
        fixture = gemma3.gemma3_fixture()
        prompts = gemma3_prompts(fixture.target, args.prompts)
    else:
        fixture = trained_fixture()
        prompts = {d: fixture.prompts(d)[: args.prompts] for d in DOMAINS}
    report = fixture.report
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sglang-frspec-acceptance-"))
    if args.sampling:
        rows = [r for tp in args.tp for r in sampling_rows(tp, fixture, args, log_dir, prompts)]
        spec = f"EAGLE steps={args.steps} topk={args.topk} draft tokens={args.draft_tokens}"
        per_domain = f"{args.prompts} prompts x {args.max_new_tokens} tokens per domain"
        print(f"\n{spec}; {per_domain}; logs {shown_path(log_dir)}")
        print_sampling(rows, args.temperatures)
        if args.json:
            Path(args.json).write_text(
                json.dumps(shown_paths({"args": vars(args), "fixture": report, "results": rows}), indent=1)
            )
        return 0
    rows: list[dict] = []
    for tp in args.tp:
        rows += summarize_tp(run_tp(tp, fixture, args, log_dir, prompts), fixture, prompts)
    spec_line = (
        f"EAGLE steps={args.steps} topk={args.topk} draft tokens={args.draft_tokens} (max accept length "
        f"{args.steps + 1}); {args.prompts} prompts x {args.max_new_tokens} tokens per domain, "
        f"{args.rounds} interleaved rounds; logs {shown_path(log_dir)}"
    )
    print(f"\n{fixture_line(fixture, report)}\n{spec_line}")
    header = f"{'tp':>2} {'config':<34} {'domain':<6} {'accept':>6} {'tokens/s':>9} {'vs no map':>9} "
    print(header + f"{'(rounds)':>11} {'vs plain':>8} {'= greedy':>9}")
    for r in rows:
        spread = f"{min(r['vs_no_map_rounds']):.2f}-{max(r['vs_no_map_rounds']):.2f}"
        print(
            f"{r['tp']:>2} {r['config']:<34} {r['domain']:<6} {r['accept_length']:>6.2f} "
            f"{r['tokens_per_s']:>9.1f} {r['vs_no_map']:>8.2f}x {spread:>11} {r['vs_plain']:>7.2f}x "
            f"{r['equals_plain_greedy']:>9}"
        )
    if len(args.tp) > 1:
        differ = accept_lengths_across_tp(rows)
        print(
            f"accept lengths equal TP={min(args.tp)}'s for every map and domain: {'NO' if differ else 'yes'}"
        )
        for line in differ:
            print(f"  {line}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(shown_paths({"args": vars(args), "fixture": report, "results": rows}), indent=1)
        )
    if args.plot:
        plot(rows, args.plot, FIXTURE_MAPS[args.fixture][2])
    return 0 if all(r["equals_plain_greedy"] != "NO" and r["same_accept_every_round"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
