"""Train the shipped EAGLE draft for Gemma 3 270M on CPU (``sglang_frspec/demo/gemma3_draft/``).

Run from the repository root: ``.venv/bin/python -m scripts.train_gemma3_draft`` runs
every stage; each stage resumes from what an earlier run left under ``--work`` (shards, the training
checkpoint), so a run stopped anywhere goes on where it stopped when started again with the same
arguments. ``--stage`` runs one stage; ``--serve`` measures the served accept lengths of ``--out``.

The draft is SGLang's ``LlamaForCausalLMEagle`` (the class SGLang 0.5.23 serves with a Gemma 3
target), trained on what SGLang's draft forward computes (``tools/draft_training/model.py`` says
where, with file:line): Gemma's unscaled embedding table as its embedding, the target's final normed
hidden states as its features, and the target's tied head restricted to the hot ids of the served
map (FR-Spec applies to training too: the loss needs only the hot head's rows).

Stages (``tools/draft_training/run.py`` holds the model-independent parts):
- ``corpus``: offline text in domains (``tools/draft_training/corpus.py``; code: the standard
  library's modules and installed packages' sources; prose: ``pydoc_data.topics`` and installed
  packages' docs and package descriptions), each document held out by a hash of its normalized
  content (1 in 8; duplicates once, no held-out line in training), tokenized into training windows,
  generation prompts and held-out sets; ``manifest.json`` lists every document with its side.
  Every random choice is seeded.
- ``generate``: the target's own greedy continuations of the prompts (self-distillation: at serving
  time the draft predicts exactly these), with a KV cache, in resumable shards: bfloat16 for
  training, float32 as served for the held-out prompts.
- ``features``: the target's final normed hidden states of every sequence and its top-k
  next-token distribution over the hot head (the loss's labels), in resumable shards: a bfloat16
  forward for the training sequences (twice float32's speed here; the features' noise in training
  is far wider than bfloat16's rounding), float32 as served for the held-out sets.
- ``train``: AdamW over the draft, checkpointed every ``--save-every`` steps (resumes).
- ``evaluate``: held-out first-step top-1 agreement and offline chain accept lengths per domain,
  against the float32 target, with 95% intervals; writes the package folder (bf16 safetensors,
  config, ``training.json`` with the manifest's Python and held-out digest and the weights'
  sha256; the whole manifest
  stays in ``--work``: commit it under ``docs/results/`` with the draft).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import cache_root
from sglang_frspec.demo.gemma3 import gemma3_fixture
from tools.draft_training import run as draft_run
from tools.draft_training.corpus import gemma3_corpus
from tools.draft_training.model import LayerShape, save_eagle_draft

REPO = Path(__file__).resolve().parents[1]

OUT = REPO / "sglang_frspec" / "demo" / "gemma3_draft"
HOT = 32768  # the demo's map: the draft's loss is over these rows
STAGES = ("corpus", "generate", "features", "train", "evaluate")
CHAIN = (3, 1, 4)  # served chain: steps, topk, draft tokens
TREE = (3, 2, 6)  # served small tree
# options evaluate's record leaves out: paths, and the train stage's (the checkpoint records those)
NOT_EVALUATE_ARGS = ("work", "out", "more_data", "batch", "epochs", "lr", "ce_weight", "unroll", "save_every",
                     "init", "layers")  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--work",
        type=Path,
        default=cache_root() / "gemma3-draft-work",
        help="shards and checkpoints (resumed)",
    )
    p.add_argument("--out", type=Path, default=OUT, help="package folder written")
    p.add_argument("--stage", choices=STAGES, help="run one stage (default: all, each resuming)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=160, help="tokens per sequence, BOS first")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of a generated sequence")
    p.add_argument("--gen-seqs", type=int, default=1024, help="prompts the target continues")
    p.add_argument("--text-seqs", type=int, default=5632, help="teacher-forced windows of text")
    p.add_argument(
        "--eval-seqs",
        type=int,
        default=384,
        help="held-out windows and continuations per domain (+-1.5 points)",
    )
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--topk", type=int, default=16, help="target probabilities kept per position")
    p.add_argument("--inter", type=int, default=2048, help="the draft's MLP width")
    p.add_argument(
        "--layers", type=int, default=1, help="the draft's decoder layers (a warm start gains identity ones)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=float, default=0.85, help="passes over the training sequences")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=1.0, help="token loss weight (feature loss 1)")
    p.add_argument("--unroll", type=int, default=2, help="draft steps trained (each reads the last's output)")
    p.add_argument(
        "--checkpoint", default="checkpoint.pt", help="training checkpoint under --work (runs side by side)"
    )
    p.add_argument(
        "--init",
        type=Path,
        help="warm start: a checkpoint or a draft folder such as --out (new optimizer); refused unless it "
        "held out the same text as --work",
    )
    p.add_argument(
        "--more-data",
        type=Path,
        action="append",
        default=[],
        help="another run's --work folder (features done, same held-out text) to train on too; repeatable",
    )
    p.add_argument("--save-every", type=int, default=25, help="steps between training checkpoints")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--serve", action="store_true", help="measure served accept lengths of --out")
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.serve:
        return serve(args)
    fixture = gemma3_fixture()
    target = Path(fixture.target)
    cfg = json.loads((target / "config.json").read_text())
    shape = LayerShape(cfg["hidden_size"], 4, 2, 128, args.inter, rope_theta=10000.0, eps=cfg["rms_norm_eps"])
    run = draft_run.DraftRun(
        work=args.work,
        target=target,
        token_map=Path(fixture.token_map(HOT)),
        shape=shape,
        seed=args.seed,
        log=draft_run.stderr_log(),
        checkpoint=args.checkpoint,
        more_data=tuple(args.more_data),
    )
    stages = [args.stage] if args.stage else STAGES
    if "corpus" in stages:
        domains, manifest, sides = gemma3_corpus()
        (args.work / "sides.json").write_text(json.dumps(sides, indent=0) + "\n")
        run.corpus(
            domains,
            seq=args.seq,
            prompt=args.prompt,
            gen_seqs=args.gen_seqs,
            text_seqs=args.text_seqs,
            eval_seqs=args.eval_seqs,
            manifest=manifest,
        )
    if "generate" in stages:
        run.generate(batch=args.gen_batch)
    if "features" in stages:
        run.features(topk=args.topk)
    if "train" in stages:
        run.train(
            batch=args.batch,
            epochs=args.epochs,
            lr=args.lr,
            ce_weight=args.ce_weight,
            unroll=args.unroll,
            save_every=args.save_every,
            init=args.init,
            layers=args.layers,
        )
    if "evaluate" in stages:
        report = run.evaluate(steps=CHAIN[0])
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
        report |= {
            "script": "scripts/train_gemma3_draft.py",
            "git_commit": commit.strip(),
            # the train stage's options come from the checkpoint (training_settings), not this command
            "args": {k: str(v) for k, v in vars(args).items() if k not in NOT_EVALUATE_ARGS},
            "target": "Gemma 3 270M (sglang_frspec/demo/gemma3.py, float32)",
        }
        save_eagle_draft(args.out, run.trained_draft(), cfg, shape)
        manifest = json.loads((args.work / "manifest.json").read_text())
        report["manifest"] = {k: manifest[k] for k in ("python", "documents_read", "held_out_digest")}
        report["weights_sha256"] = {
            name: hashlib.sha256((args.out / name).read_bytes()).hexdigest()
            for name in ("model.safetensors", "config.json")
        }
        (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        # what later held-out sets keep out of reach (sglang_frspec.demo.texts.shipped_draft_sides)
        shutil.copyfile(args.work / "sides.json", args.out / "sides.json")
        run.log(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out.name}")


def serve(args: argparse.Namespace) -> None:
    """Served accept lengths of the shipped draft on ``gemma3_fixture``'s held-out prompts: TP=2
    with the plugin (chain and small tree) and stock SGLang at TP=1, all with the 32768-id map.

    Each server is a new Python started as ``sglang-frspec demo`` starts its CPU servers (SGLang's
    CPU configuration: ``CPU_SERVER_ARGS``, ``cpu_env``), serving this checkout's plugin."""
    from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
    from sglang_frspec.demo.gemma3 import NEW_TOKENS, SERVER_ARGS
    from sglang_frspec.demo.server import SGLangServer, new_python

    fixture = gemma3_fixture()
    args.work.mkdir(parents=True, exist_ok=True)
    base_env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    }
    runs = {
        "tp2_plugin_chain": (2, True, CHAIN),
        "tp2_plugin_tree": (2, True, TREE),
        "tp1_stock_chain": (1, False, CHAIN),
    }
    results = {}
    for name, (tp, plugin, (steps, topk, tokens)) in runs.items():
        server_args = ["--model-path", fixture.target, "--tp-size", str(tp), *CPU_SERVER_ARGS, *SERVER_ARGS]
        server_args += eagle_args(
            str(args.out), fixture.token_map(HOT), steps=steps, topk=topk, draft_tokens=tokens
        )
        env = cpu_env(tp, with_plugin=plugin, base=base_env)
        server = SGLangServer(server_args, env, args.work / f"{name}.log", launch=new_python)
        started = time.monotonic()
        with server:
            outs = server.generate(fixture.prompts, NEW_TOKENS)
        metas = [o["meta_info"] for o in outs]
        results[name] = {
            "tp": tp,
            "plugin": plugin,
            "steps_topk_draft_tokens": [steps, topk, tokens],
            "spec_accept_length": [round(m["spec_accept_length"], 4) for m in metas],
            "mean_spec_accept_length": round(sum(m["spec_accept_length"] for m in metas) / len(metas), 4),
            "greedy_equals_hf": [o["output_ids"] == r for o, r in zip(outs, fixture.reference)],
            "seconds": round(time.monotonic() - started, 1),
        }
        print(name, results[name], file=sys.stderr, flush=True)
    report_path = args.out / "training.json"
    report = json.loads(report_path.read_text())
    report["served"] = {"prompts": len(fixture.prompts), "new_tokens": NEW_TOKENS, "map": HOT} | results
    report_path.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
