"""Train the shipped EAGLE draft for Gemma 3 270M on CPU (``sglang_frspec/demo/gemma3_draft/``).

Run from the repository root (``PYTHONPATH=. .venv/bin/python scripts/train_gemma3_draft.py``).
The draft is SGLang's ``LlamaForCausalLMEagle`` (the class SGLang 0.5.23 serves with a Gemma 3
target), trained on what SGLang's draft forward computes (``tests/harness/eagle_draft.py`` says
where, with file:line): Gemma's unscaled embedding table, its tied head and its final normed
hidden states. The loss is over a 32768-id hot head (FR-Spec's map of the training text): the
draft is only ever asked for those rows when served with the map.

Data (every split from ``sglang_frspec/demo/texts.py``'s ``stdlib_texts``): windows of the standard
library's training files and of the first half of ``pydoc_data.topics``, plus the target's own
greedy continuations of prompts cut from those training texts. Held out for evaluation: windows of
the held-out code files and the second half of the topics (where ``gemma3_fixture``'s prompts come
from), and greedy continuations of held-out prompts. Every sequence is BOS + ``SEQ`` - 1 tokens,
under Gemma's 512-token sliding window. Target features are computed in float32 and kept in float16
under ``--work`` (not in git). Every random choice is seeded (``--seed``).

Stages: ``--measure`` times one batch of each step and exits; the default run collects, trains,
evaluates offline and writes the package folder; ``--serve`` then starts real SGLang servers with
the shipped draft and adds their accept lengths to ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_frspec.demo.gemma3 import gemma3_fixture  # noqa: E402
from sglang_frspec.demo.texts import stdlib_texts  # noqa: E402
from tests.harness.eagle_draft import (  # noqa: E402
    LayerShape,
    draft_hidden,
    draft_loss,
    first_step_agreement,
    init_draft,
    train,
)

OUT = REPO / "sglang_frspec" / "demo" / "gemma3_draft"
VOCAB, HOT = 262144, 32768
# 4 query heads (divisible by TP=2) of 128, 2 KV heads, MLP 1024: 3.8 M parameters, 7.5 MB in bf16.
DRAFT = dict(heads=4, kv_heads=2, head_dim=128, inter=1024)
PROMPT = 32  # tokens (BOS first) of a generation prompt
CHAIN = (3, 1, 4)  # served chain: steps, topk, draft tokens
TREE = (3, 2, 6)  # served small tree


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/gemma3-draft-work"), help="features cache")
    p.add_argument("--out", type=Path, default=OUT, help="package folder written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq", type=int, default=80, help="tokens per sequence, BOS first")
    p.add_argument("--text-seqs", type=int, default=640, help="training windows of text")
    p.add_argument("--gen-seqs", type=int, default=32, help="training prompts the target continues")
    p.add_argument("--eval-seqs", type=int, default=8, help="held-out windows/continuations per kind")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (2 ran 4-6x slower than 1 on 2 shared cores)"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--measure", action="store_true", help="time one batch of each step and exit")
    p.add_argument("--serve", action="store_true", help="measure served accept lengths of --out")
    return p.parse_args()


def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_fixture().target
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def windows(tokenizer, texts: list[str], count: int, seq: int, rng: random.Random) -> list[list[int]]:
    """``count`` windows of BOS + ``seq`` - 1 tokens from random places of random texts."""
    streams = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    streams = [s for s in streams if len(s) >= seq]
    out = []
    for _ in range(count):
        s = rng.choice(streams)
        start = rng.randrange(len(s) - seq + 2)
        out.append([tokenizer.bos_token_id, *s[start : start + seq - 1]])
    return out


def generate(model, prompts: list[list[int]], new: int, log, batch: int = 16) -> list[list[int]]:
    """The target's float32 greedy continuations (prompt + ``new`` tokens; EOS suppressed so each
    has the same length)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            gen = model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new)
            out += gen.tolist()
            log(f"generated {len(out)}/{len(prompts)}")
    return out


def features(model, seqs: list[list[int]], log=None, batch: int = 8) -> torch.Tensor:
    """The target's final normed hidden states at every position (float32 forward, float16 kept)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            h = model.model(torch.tensor(seqs[i : i + batch])).last_hidden_state
            assert h.abs().max() < 6e4, "features overflow float16"
            out.append(h.half())
            if log is not None and (i // batch) % 10 == 0:
                log(f"features {i + batch}/{len(seqs)}")
    return torch.cat(out)


def hot_map(target: str, texts: list[str], work: Path) -> torch.Tensor:
    from sglang_frspec.maps.build import build_token_map

    corpus = work / "train_corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    hot, _ = build_token_map(target, [corpus], HOT, progress=False)
    return hot


def chain_accept(draft, embed, head, hot, shape, prompt, greedy, feats, steps: int = 3) -> list[int]:
    """Offline EAGLE chain (topk 1) on one greedy continuation: per verify, how many tokens it
    gives (longest matching draft prefix + the bonus). ``feats`` are the target's at
    prompt + greedy. The draft reads the target's features up to the verified prefix and its own
    for steps 2..``steps``, as SGLang runs it; ids are drafted over the hot head."""
    seq = prompt + greedy
    done, counts = 1, []  # prefill gave greedy[0]
    with torch.no_grad():
        while done < len(greedy):
            t = len(prompt) + done - 1  # the last verified token's position
            ids, fs = torch.tensor(seq[1 : t + 1]), feats[:t].float()
            drafted = []
            for _ in range(steps):
                out = draft_hidden(draft, embed, ids[None], fs[None], shape)[0, -1]
                token = int(hot[(out @ head.T).argmax()])
                drafted.append(token)
                ids, fs = torch.cat([ids, torch.tensor([token])]), torch.cat([fs, out[None]])
            match = 0
            while match < steps and done + match < len(greedy) and drafted[match] == greedy[done + match]:
                match += 1
            counts.append(match + 1)
            done += match + 1
    return counts


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    if args.serve:
        return serve(args)
    started = time.monotonic()
    report: dict = {"seconds": {}, "seed": args.seed}
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def stage(name: str, t0: float) -> None:
        report["seconds"][name] = round(time.monotonic() - t0, 1)
        log(f"{name}: {report['seconds'][name]} s")

    args.work.mkdir(parents=True, exist_ok=True)
    target, model, tokenizer = load_target()
    cfg = json.loads((Path(target) / "config.json").read_text())
    train_code, held_code, prose, held_prose = stdlib_texts()

    t0 = time.monotonic()
    hot = hot_map(target, train_code + prose, args.work)
    embed = model.model.embed_tokens.weight.detach()  # unscaled: what SGLang hands the draft
    head = embed[hot]
    stage("map", t0)

    n_text = 2 if args.measure else args.text_seqs
    n_gen = 2 if args.measure else args.gen_seqs
    n_eval = 2 if args.measure else args.eval_seqs
    gen_new = args.seq - PROMPT
    t0 = time.monotonic()
    text = windows(tokenizer, train_code, n_text // 2, args.seq, rng)
    text += windows(tokenizer, prose, n_text - n_text // 2, args.seq, rng)
    prompts = [w[:PROMPT] for w in windows(tokenizer, train_code + prose, n_gen, args.seq, rng)]
    eval_code = windows(tokenizer, held_code, n_eval, args.seq, rng)
    eval_prose = windows(tokenizer, held_prose, n_eval, args.seq, rng)
    eval_prompts = [w[:PROMPT] for w in windows(tokenizer, held_prose, n_eval, args.seq, rng)]
    stage("tokenize", t0)

    t0 = time.monotonic()
    gens = generate(model, prompts + eval_prompts, gen_new, log)
    train_gen, eval_gen = gens[: len(prompts)], gens[len(prompts) :]
    stage("generate", t0)
    fixture = gemma3_fixture()
    served_prompts = fixture.prompts
    served_ref = [p + g for p, g in zip(served_prompts, fixture.reference)]

    t0 = time.monotonic()
    train_ids = text + train_gen
    train_feats = features(model, train_ids, log)
    eval_sets = {"held_out_code": eval_code, "held_out_prose": eval_prose, "held_out_generations": eval_gen}
    eval_feats = {k: features(model, v) for k, v in eval_sets.items()}
    served_feats = [features(model, [s])[0] for s in served_ref]
    torch.save({"train_ids": train_ids, "train_feats": train_feats}, args.work / "train.pt")
    stage("features", t0)

    shape = LayerShape(cfg["hidden_size"], **DRAFT, rope_theta=10000.0, eps=cfg["rms_norm_eps"])
    gen = torch.Generator().manual_seed(args.seed + 1)
    draft = init_draft(cfg["hidden_size"], shape, gen)
    train_ids_t = torch.tensor(train_ids)
    order = torch.Generator().manual_seed(args.seed + 2)
    batches_per_epoch = len(train_ids) // args.batch
    steps = 2 if args.measure else batches_per_epoch * args.epochs

    def batches():
        for _ in range(args.epochs):
            perm = torch.randperm(len(train_ids), generator=order)
            for i in range(batches_per_epoch):
                yield perm[i * args.batch : (i + 1) * args.batch]

    noise = torch.Generator().manual_seed(args.seed + 3)

    def loss_of(d: dict, rows: torch.Tensor) -> torch.Tensor:
        return draft_loss(d, embed, head, train_ids_t[rows], train_feats[rows], noise, shape)

    t0 = time.monotonic()
    losses = train(draft, batches(), loss_of, steps, args.lr, log, every=10, label="draft")
    stage("train", t0)
    draft = {k: v.detach().to(torch.bfloat16) for k, v in draft.items()}
    as_served = {k: v.float() for k, v in draft.items()}  # bf16 weights, served in float32

    t0 = time.monotonic()
    agreement = {}
    for name, seqs in eval_sets.items():
        ids, feats = torch.tensor(seqs), eval_feats[name]
        agree_hot = first_step_agreement(as_served, embed, head, ids, feats, shape)
        agree_full = first_step_agreement(as_served, embed, embed, ids, feats, shape)
        agreement[name] = {"hot": round(float(agree_hot.float().mean()), 4)}
        agreement[name]["full_vocab"] = round(float(agree_full.float().mean()), 4)
        agreement[name]["positions"] = agree_hot.numel()
        log(f"agreement {name}: {agreement[name]}")
    chains = [
        chain_accept(as_served, embed, head, hot, shape, s[:PROMPT], s[PROMPT:], f)
        for s, f in zip(eval_gen, eval_feats["held_out_generations"])
    ]
    flat = [c for chain in chains for c in chain]
    offline = {
        "held_out_generations": {
            "tokens_per_verify": round(sum(flat) / len(flat), 4),
            "verifies": len(flat),
            "prompts": len(chains),
        }
    }
    served_chains = [
        chain_accept(as_served, embed, head, hot, shape, p, s[len(p) :], f)
        for p, s, f in zip(served_prompts, served_ref, served_feats)
    ]
    # SGLang's spec_accept_length: completion tokens / verify passes (the prefill's token counts).
    offline["fixture_prompts"] = {
        "spec_accept_length": [round(len(r) / len(c), 4) for r, c in zip(fixture.reference, served_chains)],
        "tokens_per_verify": [c for c in served_chains],
    }
    log(f"offline chain accept: {offline}")
    stage("evaluate", t0)

    out = args.out if not args.measure else args.work / "measure"
    out.mkdir(parents=True, exist_ok=True)
    save_draft(out, draft, cfg, shape)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    report |= {
        "script": "scripts/train_gemma3_draft.py",
        "git_commit": commit.strip(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "target": "Gemma 3 270M (sglang_frspec/demo/gemma3.py, float32)",
        "draft": {"class": "LlamaForCausalLMEagle"} | DRAFT | {"hidden": cfg["hidden_size"]},
        "parameters": sum(v.numel() for v in draft.values()),
        "hot_head": HOT,
        "data": {
            "sequence_tokens": args.seq,
            "text_windows": len(text),
            "generation_sequences": len(train_gen),
            "training_tokens": len(train_ids) * args.seq,
            "epochs": args.epochs,
            "steps": steps,
            "batch": args.batch,
        },
        "losses_every_10_steps": losses,
        "held_out_top1_agreement": agreement,
        "offline_chain_steps3_topk1": offline,
    }
    report["seconds"]["total"] = round(time.monotonic() - started, 1)
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {out}")


def save_draft(out: Path, draft: dict, cfg: dict, shape: LayerShape) -> None:
    """bf16 safetensors without embedding or head, and a Llama config carrying the target's ids."""
    from safetensors.torch import save_file

    from sglang_frspec.demo.fixtures import llama_config

    config = llama_config("LlamaForCausalLMEagle", VOCAB, shape.hidden, 1, shape.inter, shape.heads)
    shared = ("bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "max_position_embeddings")
    config |= {key: cfg[key] for key in shared}
    config |= {
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rope_theta": shape.rope_theta,
        "torch_dtype": "bfloat16",
    }
    save_file({k: v.contiguous() for k, v in draft.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def serve(args: argparse.Namespace) -> None:
    """Served accept lengths of the shipped draft on ``gemma3_fixture``'s held-out prompts: TP=2
    with the plugin (chain and small tree) and stock SGLang at TP=1, all with the 32768-id map."""
    from types import SimpleNamespace

    from sglang_frspec.demo.gemma3 import NEW_TOKENS, SERVER_ARGS
    from sglang_frspec.demo.server import new_python
    from tests.conftest import fixture_server

    fixture = gemma3_fixture()
    args.work.mkdir(parents=True, exist_ok=True)
    train_code, _, prose, _ = stdlib_texts()
    token_map = args.work / "map_hot_32768.pt"
    torch.save(hot_map(fixture.target, train_code + prose, args.work), token_map)
    served = SimpleNamespace(target=fixture.target, draft=str(args.out))
    runs = {
        "tp2_plugin_chain": (2, True, CHAIN),
        "tp2_plugin_tree": (2, True, TREE),
        "tp1_stock_chain": (1, False, CHAIN),
    }
    results = {}
    for name, (tp, plugin, (steps, topk, tokens)) in runs.items():
        spec = ("--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk))
        spec += ("--speculative-num-draft-tokens", str(tokens))
        server = fixture_server(
            served,
            tp,
            args.work / f"{name}.log",
            str(token_map),
            plugin=plugin,
            extra=SERVER_ARGS + spec,
            launch=new_python,  # a new Python per server: a forked launch hung here at TP=2 weight loading
        )
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
