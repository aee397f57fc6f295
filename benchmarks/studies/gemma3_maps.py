"""Token maps for a real model, Gemma 3 270M (262144 ids): from text and from the target's own outputs.

Two sources, both through the real command line (``sglang-frspec build-map``):
- ``text``: counts of the project's training text (``sglang_frspec.demo.texts.stdlib_texts``: the
  training code files and training prose topics, split by content) with the target's tokenizer
  (``--corpus ... --save-counts``); the other sizes are ranked from those counts (``--from-counts``);
- ``server``: ``--from-server`` against a plain TP=1 CPU SGLang server of the target (greedy), on
  short prompts cut from the same training text.
Each map is measured on what it did not see: its coverage of held-out code and held-out prose
(tokenized like the corpus) and of the target's own greedy outputs for prompts cut from that
held-out text (counted from the same server). It reports how each map's ids split over the two
vocab halves of TP=2, and ``sglang-frspec size`` on each counts file (the model's vocab and hidden
size, TP=2), whose recommendation is set next to the measured coverage. Measured acceptance per
size needs a trained draft and is not measured here.

    python -m benchmarks.studies.gemma3_maps --out docs/results/gemma3-maps.txt \\
        --json docs/results/gemma3-maps.json
    python -m benchmarks.studies.gemma3_maps --report docs/results/gemma3-maps.json

Keep ``--prompt-chars`` and ``--max-new-tokens`` small: on the shared 2-core CPU of
docs/results/gemma3-maps.txt each generated token of a 16-request batch took about 1 s
(0.87 tokens/s): the defaults are sized to that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import shown_path
from sglang_frspec.core.plan import vocab_shard_ranges
from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env
from sglang_frspec.demo.gemma3 import SERVER_ARGS, gemma3_fixture
from sglang_frspec.demo.server import SGLangServer
from sglang_frspec.demo.texts import stdlib_texts
from sglang_frspec.maps import TokenCounts, count_tokens
from sglang_frspec.maps.sizing import DEFAULT_HEAD_SHARE

SIZES = (4096, 8192, 16384, 32768, 65536)
SOURCES = ("text", "server")
HELD_OUT = ("code", "prose")
TP = 2  # the TP of the per-rank split and of `size`
DRAFT_STEPS = 3  # `size`'s default --draft-steps, also used for the head-share estimate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-path", help="target checkpoint with its tokenizer (default: the Gemma 3 fixture's)"
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument(
        "--prompts",
        type=int,
        default=8,
        help="server prompts per domain (code, prose) of the training text",
    )
    p.add_argument(
        "--held-out-prompts",
        type=int,
        default=8,
        help="prompts per held-out domain for the target's outputs",
    )
    p.add_argument("--prompt-chars", type=int, default=160, help="about this many characters per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (build-map --concurrency)")
    p.add_argument("--work-dir", help="keep the corpora, prompts, counts, maps and server log here")
    p.add_argument("--out", help="write the report here (plain text)")
    p.add_argument("--json", help="write the figures here as JSON")
    p.add_argument(
        "--report", metavar="JSON", help="only print (and --out) the report of this script's --json"
    )
    return p.parse_args(argv)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def cut_prompts(texts: list[str], count: int, chars: int) -> list[str]:
    """``count`` prompts of whole lines (about ``chars`` characters each), from evenly spaced places
    of every text (the middle of each part), then evenly spaced over all of them."""
    per_text = -(-count // len(texts))
    prompts = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        for j in range(per_text):
            prompt = ""
            for line in lines[(2 * j + 1) * len(lines) // (2 * per_text) :]:
                if prompt.strip() and len(prompt) + len(line) > chars:
                    break
                prompt += line[: 2 * chars]  # a very long line is cut: every prompt stays short
            if prompt.strip():
                prompts.append(prompt)
    return [prompts[i * len(prompts) // count] for i in range(min(count, len(prompts)))]


class Cli:
    """Runs ``sglang-frspec`` commands of this checkout and keeps each one, shortened, with its time."""

    def __init__(self, work: Path, target: str):
        self.work, self.target = work, target
        self.commands: list[tuple[str, float]] = []

    def shown(self, args: list[str]) -> str:
        text = shlex.join(["sglang-frspec", *args])
        return text.replace(str(self.work), "$WORK").replace(self.target, "$TARGET")

    def __call__(self, *args: str) -> str:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "sglang_frspec", *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{self.shown(list(args))} failed ({done.returncode}):\n{done.stderr}")
        self.commands.append((self.shown(list(args)), time.monotonic() - started))
        print(f"{self.commands[-1][1]:6.1f} s  {self.commands[-1][0]}", flush=True)
        return done.stdout


def build_maps(cli: Cli, source: str, first: list[str], sizes: list[int], maps: Path) -> dict[int, Path]:
    """The largest map by ``first`` (a build-map counting source), the others from its counts."""
    counts = maps / f"{source}.counts.pt"
    paths = {size: maps / f"{source}_{size}.pt" for size in sizes}
    largest = max(sizes)
    cli("build-map", *first, "--size", str(largest), "-o", str(paths[largest]), "--save-counts", str(counts),
        "--no-progress")  # fmt: skip
    for size in sorted(sizes)[:-1]:
        # --save-counts naming the source: nothing is rewritten, every map shares the one file.
        cli("build-map", "--from-counts", str(counts), "--size", str(size), "-o", str(paths[size]),
            "--save-counts", str(counts))  # fmt: skip
    return paths


def head_share_estimate(target: str, vocab: int, hidden: int) -> float:
    """The draft head's share of the weight bytes a speculative step streams (decode is memory-bound):
    ``DRAFT_STEPS`` draft forwards of one target-sized layer plus EAGLE's fc (2H x H) and the head
    (V x H), then one target forward (its layers and its head)."""
    from safetensors import safe_open

    config = json.loads((Path(target) / "config.json").read_text())
    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not iterable)
    head = vocab * hidden
    layers = total - head  # a tied head is the embedding, stored once
    layer = layers / config["num_hidden_layers"]
    draft_step = layer + 2 * hidden * hidden + head
    return DRAFT_STEPS * head / (DRAFT_STEPS * draft_step + layers + head)


def tp2_split(ids: torch.Tensor, vocab: int) -> tuple[int, int]:
    half = vocab_shard_ranges(vocab, TP)[1][0]
    return int((ids < half).sum()), int((ids >= half).sum())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return write_report(json.loads(Path(args.report).read_text()), args)
    started = time.monotonic()
    target = os.path.abspath(args.model_path or gemma3_fixture().target)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="sglang-frspec-gemma3-maps-")).resolve()
    maps_dir = work / "maps"
    maps_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target) / "config.json").read_text())
    config = config.get("text_config", config)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    shares = {"default": DEFAULT_HEAD_SHARE, "bytes": round(head_share_estimate(target, vocab, hidden), 2)}
    train_code, held_code, prose, held_prose = stdlib_texts()
    corpus = write_jsonl(work / "train.jsonl", train_code + prose)
    held_out = {"code": held_code, "prose": held_prose}
    prompts = write_jsonl(
        work / "prompts_train.jsonl",
        cut_prompts(train_code, args.prompts, args.prompt_chars)
        + cut_prompts(prose, args.prompts, args.prompt_chars),
    )
    held_prompts = {d: cut_prompts(t, args.held_out_prompts, args.prompt_chars) for d, t in held_out.items()}
    for d, texts in held_prompts.items():
        write_jsonl(work / f"prompts_held_out_{d}.jsonl", texts)
    cli = Cli(work, target)
    timings: dict[str, float] = {}

    step = time.monotonic()
    paths = {
        "text": build_maps(
            cli, "text", ["--tokenizer", target, "--corpus", str(corpus)], args.sizes, maps_dir
        )
    }
    timings["text maps"] = time.monotonic() - step
    step = time.monotonic()
    evaluation = {
        f"held-out {d}": count_tokens(target, [write_jsonl(work / f"held_out_{d}.jsonl", t)], progress=False)
        for d, t in held_out.items()
    }
    timings["held-out text counts"] = time.monotonic() - step

    server_args = ["--model-path", target, "--tp-size", "1", *CPU_SERVER_ARGS]
    # Text prompts: the server tokenizes them (and adds BOS), so it loads its tokenizer.
    server_args += [a for a in SERVER_ARGS if a != "--skip-tokenizer-init"]
    step = time.monotonic()
    with SGLangServer(server_args, cpu_env(1, with_plugin=False), work / "server.log") as server:
        timings["server start"] = time.monotonic() - step
        step = time.monotonic()
        source = ["--from-server", server.url, "--prompts", str(prompts), "--max-new-tokens",
                  str(args.max_new_tokens), "--concurrency", str(args.concurrency)]  # fmt: skip
        paths["server"] = build_maps(cli, "server", source, args.sizes, maps_dir)
        timings["server maps"] = time.monotonic() - step
        step = time.monotonic()
        # Greedy, one batch for both domains (SGLang's /generate takes a list of texts).
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
        outputs = server.post(
            "/generate", {"text": sum(held_prompts.values(), []), "sampling_params": params}, timeout=3600
        )
        timings["held-out outputs"] = time.monotonic() - step
    for d, texts in held_prompts.items():
        ids = torch.tensor([i for o in outputs[: len(texts)] for i in o["output_ids"]])
        outputs = outputs[len(texts) :]
        evaluation[f"outputs {d}"] = TokenCounts(
            torch.bincount(ids, minlength=vocab),
            len(texts),
            target,
            (),
            (f"prompts_held_out_{d}.jsonl",),
            "text",
        )
        evaluation[f"outputs {d}"].save(work / f"outputs_{d}.counts.pt")

    counts = {s: TokenCounts.load(maps_dir / f"{s}.counts.pt") for s in SOURCES}
    rows = []
    for s in SOURCES:
        for size, path in sorted(paths[s].items()):
            ids = torch.load(path)
            lower, upper = tp2_split(ids, vocab)
            rows.append(
                {
                    "source": s,
                    "size": size,
                    "own": counts[s].coverage(ids),
                    "held_out": {name: c.coverage(ids) for name, c in evaluation.items()},
                    "tp2": [lower, upper],
                }
            )

    size_runs = []
    size_counts = {
        "text": maps_dir / "text.counts.pt",
        "server": maps_dir / "server.counts.pt",
        "outputs code": work / "outputs_code.counts.pt",
        "outputs prose": work / "outputs_prose.counts.pt",
    }
    step = time.monotonic()
    for name, path in size_counts.items():
        for share_name, share in shares.items():
            out = cli("size", "--counts", str(path), "--model-path", target, "--hidden", str(hidden), "--tp",
                      str(TP), "--head-share", str(share), "--json")  # fmt: skip
            size_runs.append(
                {"counts": name, "head_share": share, "share_name": share_name} | json.loads(out)
            )
    timings["size"] = time.monotonic() - step
    timings["total"] = time.monotonic() - started

    report = {
        "target": shown_path(target),
        "vocab": vocab,
        "hidden": hidden,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "json", "work_dir", "report")},
        "work": shown_path(work),
        "tokens": {name: c.num_tokens for name, c in ({**counts, **evaluation}).items()},
        "distinct": {name: int((c.counts > 0).sum()) for name, c in ({**counts, **evaluation}).items()},
        "prompts": {"train": 2 * args.prompts, **{d: args.held_out_prompts for d in HELD_OUT}},
        "maps": rows,
        "size": size_runs,
        "head_shares": shares,
        "timings": timings,
        "commands": cli.commands,
    }
    Path(args.json or work / "report.json").write_text(json.dumps(report, indent=1))
    return write_report(report, args)


def write_report(report: dict, args: argparse.Namespace) -> int:
    text = format_report(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def format_report(r: dict) -> str:
    names = list(r["maps"][0]["held_out"])
    options = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in r["args"].items()
        if v is not None
    )
    run = f"python -m benchmarks.studies.gemma3_maps {options}"
    lines = [
        f"$ {run}",
        f"Gemma 3 270M token maps: vocab {r['vocab']}, hidden {r['hidden']}; target $TARGET = {r['target']}",
        "counted tokens (distinct ids): "
        + ", ".join(f"{name} {r['tokens'][name]:,} ({r['distinct'][name]:,})" for name in r["tokens"]),
        f"server: plain TP=1 CPU, greedy, {r['args']['max_new_tokens']} new tokens per prompt; "
        f"{r['prompts']['train']} training-text prompts, {r['args']['held_out_prompts']} held-out prompts "
        "per domain",
        "",
        "coverage of each map (own: the counts it was ranked from; held-out text tokenized; outputs:",
        "the target's greedy outputs for held-out prompts); ids per TP=2 vocab half, local layout max/mean",
        f"{'source':<7}{'size':>6} {'own':>7} "
        + " ".join(f"{n:>14}" for n in names)
        + f" {'TP2 halves':>14} {'max/mean':>8}",
    ]
    for m in r["maps"]:
        lower, upper = m["tp2"]
        lines.append(
            f"{m['source']:<7}{m['size']:>6} {m['own']:>7.2%} "
            + " ".join(f"{m['held_out'][n]:>14.2%}" for n in names)
            + f" {f'{lower} / {upper}':>14} {max(lower, upper) / ((lower + upper) / 2):>8.2f}"
        )
    lines += [
        "",
        f"sglang-frspec size (TP={TP} balanced, accept length 3 over {DRAFT_STEPS} steps, acceptance scaled "
        f"by coverage), head share {r['head_shares']['default']} (default) and {r['head_shares']['bytes']} "
        "(this model's weight bytes per step); measured coverage of the recommended size's map:",
        f"{'counts':<14}{'share':>6} {'recommended':>11} {'modelled cov.':>13} {'speed-up':>8} "
        + " ".join(f"{n:>14}" for n in names),
    ]
    by_map = {(m["source"], m["size"]): m for m in r["maps"]}
    for run in r["size"]:
        best = next(s for s in run["sizes"] if s["size"] == run["recommended"])
        measured = by_map.get((run["counts"], run["recommended"]))  # none for the outputs' own counts
        cells = " ".join(f"{measured['held_out'][n]:>14.2%}" if measured else f"{'-':>14}" for n in names)
        lines.append(
            f"{run['counts']:<14}{run['head_share']:>6} {run['recommended']:>11} {best['coverage']:>13.2%} "
            f"{best['speedup']:>7.3f}x {cells}"
        )
    lines += [
        "",
        "timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items()),
        "",
        "commands ($WORK: the --work-dir; each server URL as it was):",
    ]
    lines += [f"  {seconds:5.1f} s  {command}" for command, seconds in r["commands"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
