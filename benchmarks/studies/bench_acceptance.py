r"""Acceptance and speed on a model trained on real text: no map vs maps of each size, side by side.

The trained fixture (``tools.draft_training.trained_fixture``: a 32k-vocab BPE Llama trained on the
Python standard library's code, and an EAGLE draft trained on its hidden states) is served by real
CPU SGLang servers. Prompts are held-out code (the training domain) and held-out prose from the
language reference (another domain); their launchers and schedulers are forked from a zygote, as
the test servers' are (``tools.serving.zygote``). For each TP size every configuration runs as its
own server:
plain greedy decoding, EAGLE without a map, EAGLE + each map (this plugin; balanced/full) and, at
TP > 1, the other layouts and exchanges on one map. Timed batches are interleaved round-robin
across the servers alive at a time (the two references stay alive throughout; the others come in
groups of ``--alive``), idle ones suspended; ratios use the references' samples from the same rounds.

Reports per configuration, domain and concurrency mode: accept length, tokens/s, ratio to EAGLE
without a map and to plain decoding, and whether the outputs equal plain greedy decoding at that TP
(tie-aware: a difference is allowed only at a top-2 near-tie of the target, see tools.serving.greedy).
    python -m benchmarks.studies.bench_acceptance --json docs/results/acceptance.json \\
        --plot docs/acceptance.png

``--spec S,K,T ...`` (EAGLE steps, topk, draft tokens) runs every EAGLE configuration once per spec
(its name then ends in the spec); its ratio to EAGLE without a map is to that of the same spec, and
the first spec's is the reference alive in every group, through which ratios of rows that ran apart
are chained. ``--concurrency N ...`` times each domain's prompts in closed batches of N, one after
another (1: one request at a time; default: all as one batch). A closing table gives, per TP,
domain and concurrency, each system's fastest row (plain greedy; stock EAGLE: no map, any spec;
EAGLE + map: any map and spec) and its ratios to plain greedy and to the fastest stock EAGLE row
(JSON key ``best``). Gemma 3's sweep at TP=2 (the plugin; ``--tp 1`` for TP=1):
    python -m benchmarks.studies.bench_acceptance --fixture gemma3 --tp 2 --stock-tp1 --one-reference \
        --alive 1 --maps 8192 32768 --layouts --spec 2,1,3 3,1,4 3,2,6 --concurrency 1 8 --prompts 8 \
        --max-new-tokens 32 --rounds 2 --json docs/results/acceptance-gemma3-sweep-cpu.json

``--fixture gemma3`` runs the same on a real pretrained model: Gemma 3 270M (262144 ids,
``sglang_frspec.demo.gemma3``) with its shipped EAGLE draft and its maps of the training text
(4096 ... 65536 ids), on prompts cut from held-out code and prose with its tokenizer. A TP=2 server
of it holds about 7.5 GB, so ``--one-reference`` keeps only EAGLE without a map alive as the
reference (plain decoding's ratios are then chained through it), and ``--stock-tp1`` makes the
TP=1 servers stock SGLang (no plugin), whose accept lengths the TP=2 plugin's must equal:
    python -m benchmarks.studies.bench_acceptance --fixture gemma3 --stock-tp1 --one-reference --alive 1 \
        --layouts balanced/topk --layout-map 8192 32768 --prompts 8 --max-new-tokens 32 \
        --json docs/results/acceptance-gemma3-cpu.json --plot docs/acceptance-gemma3.png

``--sampling`` measures accept length under sampling instead (no timing): EAGLE without a map and
with ``--sampling-map``, each with SGLang's target-only verify and with rejection sampling
(``--speculative-use-rejection-sampling``), one server each, at each of ``--temperatures``
(requests seeded through ``--random-seed``; at temperature 0 rejection sampling is greedy).
    python -m benchmarks.studies.bench_acceptance --sampling --tp 1 --max-new-tokens 32 \
        --json docs/results/acceptance-sampling-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import fixture_map, shown_path, shown_paths, summarize
from sglang_frspec.demo import gemma3, timing
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.server import SGLangServer
from tools.draft_training.trained_fixture import MAP_SIZES, PROSE_MAP_SIZE, trained_fixture
from tools.serving.greedy import greedy_match
from tools.serving.zygote import forked_launch

PLAIN, NO_MAP = "plain greedy", "EAGLE, no map"
# The systems of the closing table: rows without a map are stock EAGLE, rows with one EAGLE + map.
STOCK, WITH_MAP = "stock EAGLE", "EAGLE + map"
BEST_FIELDS = ("tp", "domain", "concurrency", "system", "config", "spec", "map", "layout", "accept_length",
               "tokens_per_s", "vs_plain", "equals_plain_greedy")  # fmt: skip
DOMAINS = ("code", "prose")
# The verify under sampling: SGLang's default (target-only, any draft) or rejection sampling.
VERIFIES = {"target-only": (), "rejection": ("--speculative-use-rejection-sampling",)}
SEED = ("--random-seed", "36")


Spec = tuple[int, int, int]  # EAGLE steps, topk, draft tokens


@dataclass
class Config:
    name: str
    tp: int
    spec: Spec | None = None  # None: plain decoding
    token_map: str | None = None  # a map name of the fixture, or a map file
    layout: str = "balanced"
    exchange: str = "full"
    extra: tuple = ()  # more server arguments
    samples: dict = field(default_factory=lambda: defaultdict(list))  # (domain, at once) -> rounds

    @property
    def system(self) -> str:
        return PLAIN if self.spec is None else WITH_MAP if self.token_map else STOCK


def spec_label(spec: Spec | None) -> str | None:
    return ",".join(map(str, spec)) if spec else None


def spec_arg(text: str) -> Spec:
    """``S,K,T`` of ``--spec``."""
    try:
        spec = tuple(int(v) for v in text.split(","))
    except ValueError:
        spec = ()
    if len(spec) != 3 or min(spec) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give steps,topk,draft tokens as positive integers, e.g. 3,1,4"
        )
    return spec


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
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="requests at once, each a timed mode: N sends a domain's prompts as closed batches of N, one "
        "after another (1: one request at a time); tokens/s = all tokens / all time (default: all prompts "
        "as one batch)",
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed batches per config and domain")
    p.add_argument("--alive", type=int, default=3, help="map configurations alive at once")
    p.add_argument(
        "--spec",
        type=spec_arg,
        nargs="+",
        metavar="S,K,T",
        help="EAGLE steps,topk,draft tokens: every EAGLE configuration runs once per spec, its name ending "
        "in it when there are several (default: --steps,--topk,--draft-tokens)",
    )
    p.add_argument("--steps", type=int, help="EAGLE steps of the one spec without --spec (default 3)")
    p.add_argument("--topk", type=int, help="EAGLE topk of the one spec without --spec (default 1)")
    p.add_argument("--draft-tokens", type=int, help="draft tokens of the one spec without --spec (default 4)")
    p.add_argument("--log-dir", help="keep server logs here")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--plot", help="write accept length and speed against map size here (.png)")
    p.add_argument("--sampling", action="store_true", help="accept length under sampling (see above)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--sampling-map", help="the map of --sampling (default: the --layout-map default)")
    args = p.parse_args(argv)
    one_spec = (args.steps, args.topk, args.draft_tokens)
    if args.spec and one_spec != (None, None, None):
        p.error("--spec replaces --steps/--topk/--draft-tokens: give one or the other")
    args.spec = args.spec or [tuple(d if v is None else v for v, d in zip(one_spec, (3, 1, 4)))]
    if len(set(args.spec)) < len(args.spec):
        p.error(f"--spec lists a spec twice: {' '.join(map(spec_label, args.spec))}")
    for steps, topk, draft_tokens in args.spec:
        if topk == 1 and draft_tokens != steps + 1:  # SGLang would serve steps + 1 under this name
            p.error(
                f"--spec {steps},1,{draft_tokens}: topk 1 drafts a chain of steps + 1 tokens; "
                f"give {steps},1,{steps + 1}"
            )
    if len(args.spec) == 1:  # the JSON's args say what ran (validate_size_model drafts as they say)
        args.steps, args.topk, args.draft_tokens = args.spec[0]
    elif args.sampling:
        p.error("--sampling runs one spec: give one --spec")
    args.concurrency = args.concurrency or [args.prompts]
    if len(set(args.concurrency)) < len(args.concurrency) or not all(
        1 <= n <= args.prompts for n in args.concurrency
    ):
        p.error(f"--concurrency {args.concurrency}: each from 1 to --prompts ({args.prompts}), once")
    maps, layout_map, _ = FIXTURE_MAPS[args.fixture]
    args.maps = args.maps or maps
    args.layout_map = args.layout_map or [layout_map]
    args.sampling_map = args.sampling_map or layout_map
    return args


def configs_for(tp: int, args: argparse.Namespace) -> list[Config]:
    """Plain greedy, then per spec: EAGLE without a map, with each map and, at TP > 1, the layout rows
    (the first spec's EAGLE without a map second: the reference alive in every group)."""
    configs = [Config(PLAIN, tp)]
    for spec in args.spec:
        suffix = f" {spec_label(spec)}" if len(args.spec) > 1 else ""
        rows = [(NO_MAP, None, "balanced/full")] + [
            (f"map {Path(m).stem}", m, "balanced/full") for m in args.maps
        ]
        if tp > 1:
            rows += [
                (f"map {Path(m).stem} {pair}", m, pair) for m in args.layout_map for pair in args.layouts
            ]
        for name, token_map, pair in rows:
            layout, exchange = pair.split("/")
            configs.append(Config(name + suffix, tp, spec, token_map, layout, exchange))
    return configs


def start(config: Config, fixture, args, log_dir: Path) -> SGLangServer:
    cli = ["--model-path", fixture.target, "--tp-size", str(config.tp), *CPU_SERVER_ARGS]
    cli += gemma3.SERVER_ARGS if isinstance(fixture, gemma3.Gemma3Fixture) else ()
    if config.spec:
        token_map = fixture_map(fixture, config.token_map) if config.token_map else None
        steps, topk, draft_tokens = config.spec
        cli += eagle_args(fixture.draft, token_map, steps=steps, topk=topk, draft_tokens=draft_tokens)
    cli += config.extra
    options = {"SGLANG_FRSPEC_LAYOUT": config.layout, "SGLANG_FRSPEC_EXCHANGE": config.exchange}
    plugin = config.tp > 1 or not args.stock_tp1
    env = cpu_env(config.tp, with_plugin=plugin, base=os.environ | options)
    name = f"tp{config.tp}-{config.name.replace(' ', '_').replace('/', '-')}.log"
    print(f"starting tp={config.tp} {config.name} ...", flush=True)
    server = SGLangServer(cli, env, log_dir / name, launch=forked_launch).start().wait_ready()
    server.suspend()  # idle schedulers poll: the next server would start (and run) next to them
    return server


def measure(group: list[Config], servers: dict, prompts: dict, args) -> None:
    """Interleaved rounds over the (suspended) servers of ``group``; each round times every domain's
    prompts in each concurrency mode. Round 0 warms up, untimed: one batch of each size, 4 tokens
    (every shape the timed rounds run, at a fraction of their time)."""
    for round_ in range(args.rounds + 1):
        order = group[round_ % len(group) :] + group[: round_ % len(group)]
        for config in order:
            server = servers[config.name]
            server.resume()
            # untimed: the first request after SIGCONT would time the wake-up, and it is always code's
            timing.warm_up(server, prompts[DOMAINS[-1]])
            for domain in DOMAINS:
                if not round_:
                    timing.warm_up(server, prompts[domain], args.concurrency)
                    continue
                for at_once in args.concurrency:
                    sample = timing.timed_batch(server, prompts[domain], args.max_new_tokens, at_once)
                    sample["accept_length"] = sample["accept_length"] or 1.0  # plain: one token a step
                    sample["group"] = tuple(c.name for c in group)
                    config.samples[domain, at_once].append(sample)
            server.suspend()


def run_tp(tp: int, fixture, args, log_dir: Path, prompts: dict) -> list[Config]:
    configs = configs_for(tp, args)
    references = configs[1:2] if args.one_reference else configs[:2]  # plain, the first spec's no map
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


def round_ratios(samples: list[dict], ref_samples: list[dict], anchor_samples: list[dict]) -> list[float]:
    """Tokens/s over the reference's, round by round (the reference's samples of the same groups;
    where the reference ran in other groups, over the anchor's, chained as ``vs_reference``)."""
    if not {s["group"] for s in samples} <= {r["group"] for r in ref_samples}:
        scale = group_ratio(ref_samples, anchor_samples)
        return [ratio / scale for ratio in round_ratios(samples, anchor_samples, anchor_samples)]
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


def vs_reference(samples: list[dict], ref_samples: list[dict], anchor_samples: list[dict]) -> float:
    """``group_ratio`` where the reference ran in every group of ``samples``; else chained through
    the anchor (the first spec's EAGLE without a map), which runs in every group."""
    if {s["group"] for s in samples} <= {r["group"] for r in ref_samples}:
        return group_ratio(samples, ref_samples)
    return group_ratio(samples, anchor_samples) / group_ratio(ref_samples, anchor_samples)


def summarize_tp(configs: list[Config], fixture, prompts: dict, args) -> tuple[list[dict], list[dict]]:
    """The rows of one TP (per config, domain and concurrency) and its ``best`` rows."""
    plain = configs[0]
    no_map = {c.spec: c for c in configs if c.system == STOCK}
    anchor = no_map[args.spec[0]]  # alive in every group (run_tp)
    rows = []
    for config in configs:
        for cell in ((d, n) for d in DOMAINS for n in args.concurrency):
            samples = config.samples[cell]
            own_no_map = no_map[config.spec or args.spec[0]]  # the same spec's (plain: the first's)
            rows.append(
                {
                    "tp": config.tp,
                    "config": config.name,
                    "system": config.system,
                    "spec": spec_label(config.spec),
                    "map": config.token_map,
                    "layout": f"{config.layout}/{config.exchange}" if config.token_map else None,
                    "domain": cell[0],
                    "concurrency": cell[1],
                    "accept_length": samples[0]["accept_length"],
                    "tokens_per_s": summarize([s["tokens_per_s"] for s in samples])["median"],
                    "vs_no_map": vs_reference(samples, own_no_map.samples[cell], anchor.samples[cell]),
                    "vs_plain": vs_reference(samples, plain.samples[cell], anchor.samples[cell]),
                    "tokens_per_s_rounds": [s["tokens_per_s"] for s in samples],
                    "vs_no_map_rounds": round_ratios(samples, own_no_map.samples[cell], anchor.samples[cell]),
                    "same_accept_every_round": len({s["accept_length"] for s in samples}) == 1,
                    "equals_plain_greedy": greedy_match(
                        fixture.target,
                        prompts[cell[0]],
                        samples[0]["outputs"],
                        plain.samples[cell][0]["outputs"],
                    ),
                }
            )
    return rows, best_rows(configs, rows, anchor)


def best_rows(configs: list[Config], rows: list[dict], anchor: Config) -> list[dict]:
    """Per domain and concurrency, each system's fastest row (by ``vs_plain``: tokens/s against plain
    greedy in the same rounds) with its ratio to the fastest stock EAGLE row (as ``vs_reference``)."""
    by_name = {c.name: c for c in configs}
    best = []
    for cell in dict.fromkeys((r["domain"], r["concurrency"]) for r in rows):
        mine = [r for r in rows if (r["domain"], r["concurrency"]) == cell]
        fastest = {
            system: max((r for r in mine if r["system"] == system), key=lambda r: r["vs_plain"])
            for system in dict.fromkeys(r["system"] for r in mine)
        }
        stock = by_name[fastest[STOCK]["config"]].samples[cell]
        for r in fastest.values():
            vs_stock = vs_reference(by_name[r["config"]].samples[cell], stock, anchor.samples[cell])
            best.append({k: r[k] for k in BEST_FIELDS} | {"vs_best_stock": vs_stock})
    return best


def sampling_rows(tp: int, fixture, args, log_dir: Path, prompts: dict) -> list[dict]:
    """Accept length per (map, verify, temperature, domain): one server per map and verify, every
    temperature's batches on it (the mean of the requests' accept lengths, as ``timing.timed_batch``)."""
    rows = []
    for token_map in (None, args.sampling_map):
        for verify, extra in VERIFIES.items():
            name = f"{f'map {Path(token_map).stem}' if token_map else 'no map'}, {verify}"
            server = start(
                Config(name, tp, args.spec[0], token_map, extra=(*extra, *SEED)), fixture, args, log_dir
            )
            server.resume()
            try:
                for temperature in args.temperatures:
                    for domain in DOMAINS:
                        outs = timing.generate(
                            server, prompts[domain], args.max_new_tokens, temperature=temperature
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
            no_map = next(r for r in rows if r["tp"] == tp and r["domain"] == domain and r["system"] == STOCK)
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
            f"Gemma 3 270M: vocab {gemma3.VOCAB}, float32; "
            f"its shipped EAGLE draft ({shown_path(fixture.draft)})"
        )
    return (
        f"trained fixture: vocab {report['vocab']}, target held-out loss {report['target_held_out_loss']:.2f}"
        f" nats (unigram {report['unigram_held_out_loss']:.2f})"
    )


def accept_lengths_across_tp(rows: list[dict]) -> list[str]:
    """Rows whose accept length differs from the same map's (any layout and exchange), spec, domain
    and concurrency at the smallest TP."""
    first = min(r["tp"] for r in rows)

    def key(r: dict) -> tuple:
        return r["map"] or r["config"], r["spec"], r["domain"], r["concurrency"]

    base = {key(r): r["accept_length"] for r in rows if r["tp"] == first}
    return [
        f"tp={r['tp']} {r['config']} {r['domain']} {r['concurrency']} at once: {r['accept_length']:.4f} "
        f"vs {base[key(r)]:.4f}"
        for r in rows
        if r["tp"] != first and key(r) in base and r["accept_length"] != base[key(r)]
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
    best: list[dict] = []
    for tp in args.tp:
        tp_rows, tp_best = summarize_tp(run_tp(tp, fixture, args, log_dir, prompts), fixture, prompts, args)
        rows, best = rows + tp_rows, best + tp_best
    spec_line = (
        f"EAGLE steps,topk,draft tokens {' '.join(map(spec_label, args.spec))} (max accept length "
        f"steps + 1); {args.prompts} prompts x {args.max_new_tokens} tokens per domain, sent "
        f"{' / '.join(map(str, args.concurrency))} at once, {args.rounds} interleaved rounds; logs "
        f"{shown_path(log_dir)}"
    )
    print(f"\n{fixture_line(fixture, report)}\n{spec_line}")
    header = f"{'tp':>2} {'config':<34} {'domain':<6} {'at once':>7} {'accept':>6} {'tokens/s':>9} "
    print(header + f"{'vs no map':>9} {'(rounds)':>11} {'vs plain':>8} {'= greedy':>9}")
    for r in rows:
        spread = f"{min(r['vs_no_map_rounds']):.2f}-{max(r['vs_no_map_rounds']):.2f}"
        print(
            f"{r['tp']:>2} {r['config']:<34} {r['domain']:<6} {r['concurrency']:>7} "
            f"{r['accept_length']:>6.2f} {r['tokens_per_s']:>9.1f} {r['vs_no_map']:>8.2f}x {spread:>11} "
            f"{r['vs_plain']:>7.2f}x {r['equals_plain_greedy']:>9}"
        )
    if len(args.tp) > 1:
        differ = accept_lengths_across_tp(rows)
        print(
            f"accept lengths equal TP={min(args.tp)}'s for every map and domain: {'NO' if differ else 'yes'}"
        )
        for line in differ:
            print(f"  {line}")
    print(
        f"\nbest configuration per system (the fastest against {PLAIN} in the same rounds; vs best stock: "
        f"against the fastest {STOCK} row; ratios chained through the first spec's {NO_MAP} where rows ran "
        "apart)"
    )
    header = f"{'tp':>2} {'domain':<6} {'at once':>7} {'system':<13} {'config':<34} {'accept':>6} "
    print(header + f"{'tokens/s':>9} {'vs plain':>8} {'vs best stock':>13} {'= greedy':>9}")
    for r in best:
        print(
            f"{r['tp']:>2} {r['domain']:<6} {r['concurrency']:>7} {r['system']:<13} {r['config']:<34} "
            f"{r['accept_length']:>6.2f} {r['tokens_per_s']:>9.1f} {r['vs_plain']:>7.2f}x "
            f"{r['vs_best_stock']:>12.2f}x {r['equals_plain_greedy']:>9}"
        )
    if args.json:
        results = {"args": vars(args), "fixture": report, "results": rows, "best": best}
        Path(args.json).write_text(json.dumps(shown_paths(results), indent=1))
    if args.plot:  # against map size: the first spec and concurrency mode
        first = [
            r
            for r in rows
            if r["spec"] in (None, spec_label(args.spec[0])) and r["concurrency"] == args.concurrency[0]
        ]
        plot(first, args.plot, FIXTURE_MAPS[args.fixture][2])
    return 0 if all(r["equals_plain_greedy"] != "NO" and r["same_accept_every_round"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
