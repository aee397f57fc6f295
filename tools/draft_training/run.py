"""Self-distillation data and resumable training for an EAGLE draft of any Transformers target.

``DraftRun`` keeps every stage's output under one work folder, in shards a later run skips, so a
stopped run resumes where it stopped: ``corpus`` (token windows, prompts and held-out sets of seeded
draws, and ``manifest.json``), ``generate`` (the target's greedy continuations of the prompts
with a KV cache: bfloat16 for training, float32 as served for the held-out prompts), ``features``
(the target's final normed hidden states and its top-k next-token probabilities over the hot head:
bfloat16 for training, float32 for the held-out sets), ``train`` (AdamW, checkpointed) and
``evaluate`` (held-out first-step agreement and offline chain accept lengths against the float32
target's argmax, with 95% intervals from a bootstrap over the held-out documents). The draft model
and its forward are ``tools/draft_training/model.py``'s, which reproduce SGLang's
``LlamaForCausalLMEagle``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_frspec.demo.texts import content_hash
from tools.draft_training.model import (
    LayerShape,
    adam,
    draft_chains,
    draft_hidden,
    draft_layers,
    grow_draft,
    init_draft,
)

ROW_CHUNK = 1024  # rows per hot-head matmul in the loss: [1024, H] logits
BOOTSTRAP_DRAWS = 2000  # resamples of documents for a 95% interval


def stderr_log() -> Callable[[str], None]:
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:8.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


def windows(
    streams: list[list[int]], count: int, seq: int, bos: int, rng: random.Random
) -> tuple[list[list[int]], list[int]]:
    """``count`` windows of BOS + ``seq`` - 1 tokens, each from a stream drawn by its length, and
    the index of the stream each came from."""
    if count == 0:
        return [], []
    long = [i for i, s in enumerate(streams) if len(s) >= seq]
    out, sources = [], []
    for i in rng.choices(long, [len(streams[i]) for i in long], k=count):
        start = rng.randrange(len(streams[i]) - seq + 2)
        out.append([bos, *streams[i][start : start + seq - 1]])
        sources.append(i)
    return out, sources


def bootstrap_interval(hits: torch.Tensor, totals: torch.Tensor, clusters: torch.Tensor) -> list[float]:
    """95% interval of ``hits.sum() / totals.sum()`` (one entry per sequence) by resampling the
    ``clusters`` (the document each sequence came from) with replacement, seeded."""
    ids, cluster = clusters.unique(return_inverse=True)
    hit = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, cluster, hits.double())
    total = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, cluster, totals.double())
    draws = torch.randint(len(ids), (BOOTSTRAP_DRAWS, len(ids)), generator=torch.Generator().manual_seed(0))
    ratios = hit[draws].sum(1) / total[draws].sum(1)
    ratios = ratios.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64))
    return [round(float(r), 4) for r in ratios]


def split_even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new: int, suppress: list[int]) -> torch.Tensor:
    """``prompts [B, P]`` followed by the model's ``new`` greedy tokens (``suppress`` ids never
    chosen, so every row has the same length), with a KV cache: ``[B, P + new]``."""
    from transformers import DynamicCache

    head = model.get_output_embeddings().weight
    out = model.model(input_ids=prompts, past_key_values=DynamicCache(config=model.config), use_cache=True)
    tokens = []
    for i in range(new):
        logits = out.last_hidden_state[:, -1] @ head.T
        logits[:, suppress] = -math.inf
        tokens.append(logits.argmax(-1))
        if i + 1 < new:
            out = model.model(
                input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True
            )
    return torch.cat([prompts, torch.stack(tokens, 1)], 1)


@torch.no_grad()
def target_features(
    model, ids: torch.Tensor, head: torch.Tensor, topk: int, argmax: bool = False
) -> dict[str, torch.Tensor]:
    """The target's final normed hidden states at ``ids [B, S]`` and its top-k probabilities over
    ``head``'s rows (positions into the hot head), stored in float16 for training; with ``argmax``
    (a held-out set), the states as computed and the greedy token over the full vocabulary too."""
    feats = model.model(input_ids=ids).last_hidden_state
    assert argmax or feats.abs().max() < 6e4, "features overflow float16"
    probs, top = (feats @ head.T).float().softmax(-1).topk(topk, -1)
    out = {"feats": feats if argmax else feats.half(), "top": top.int(), "probs": probs.half()}
    if argmax:
        full = model.get_output_embeddings().weight
        out["argmax"] = torch.stack([(f @ full.T).argmax(-1) for f in feats])
    return out


def _chunk_logits(rows: torch.Tensor, head: torch.Tensor, start: int) -> torch.Tensor:
    """Float32 logits of ``rows[start : start + ROW_CHUNK]`` over ``head``, bfloat16 matmul: [n, H]."""
    return (rows[start : start + ROW_CHUNK].bfloat16() @ head.T).float()


class _HotHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``rows @ head.T`` (bfloat16 matmul, float32 softmax) against sparse
    targets, in ROW_CHUNK-row pieces. The backward recomputes each piece's logits instead of
    keeping them: autograd's graph would hold [rows, H] float32 logits and run a dozen elementwise
    passes over them, where the gradient is one: softmax x (target mass) - targets, scattered."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, head: torch.Tensor, top: torch.Tensor, probs: torch.Tensor):
        # rows [N, D] float32; head [H, D] bfloat16; top [N, K] positions into head; probs [N, K]
        total = torch.zeros((), dtype=torch.float64)
        lse = torch.empty(rows.shape[0])
        for i in range(0, rows.shape[0], ROW_CHUNK):
            logits = _chunk_logits(rows, head, i)
            lse[i : i + ROW_CHUNK] = logits.logsumexp(-1)
            log_q = logits.gather(1, top[i : i + ROW_CHUNK]) - lse[i : i + ROW_CHUNK, None]  # [n, K]
            total -= (probs[i : i + ROW_CHUNK] * log_q).sum().double()
        ctx.save_for_backward(rows, head, top, probs, lse)
        return total.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, head, top, probs, lse = ctx.saved_tensors
        grad_rows = torch.empty_like(rows)
        mass = probs.sum(-1, keepdim=True)  # [N, 1]
        for i in range(0, rows.shape[0], ROW_CHUNK):
            softmax = _chunk_logits(rows, head, i).sub_(lse[i : i + ROW_CHUNK, None]).exp_()
            dlogits = softmax.mul_(mass[i : i + ROW_CHUNK])
            dlogits.scatter_add_(1, top[i : i + ROW_CHUNK], -probs[i : i + ROW_CHUNK])
            grad_rows[i : i + ROW_CHUNK] = (dlogits.bfloat16() @ head).float()
        return grad_rows * grad, None, None, None


def sparse_head_loss(
    out: torch.Tensor, head: torch.Tensor, top: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of the draft's distribution over ``head``'s rows (bfloat16 matmul)
    against the target's top-k probabilities renormalized (``top``, ``probs`` ``[..., K]``)."""
    rows, top, probs = out.flatten(0, -2), top.flatten(0, -2).long(), probs.flatten(0, -2).float()
    probs = probs / probs.sum(-1, keepdim=True)
    return _HotHeadCrossEntropy.apply(rows, head, top, probs) / rows.shape[0]


def unrolled_loss(
    draft: dict,
    embed: torch.Tensor,
    head: torch.Tensor,
    batch: dict[str, torch.Tensor],
    shape: LayerShape,
    gen: torch.Generator,
    unroll: int,
    ce_weight: float,
    noise: float = 0.2,
) -> torch.Tensor:
    """EAGLE's loss over ``unroll`` draft steps on ``batch`` (ids ``[B, S+1]`` and the target's
    features and top-k at them): position t reads (token t+1, feature t) and must give feature
    t+1 and the target's distribution there; each later step reads the step before's outputs, as
    the served draft reads its own. Step one's features get uniform noise of width ``noise``."""
    ids, feats = batch["ids"], batch["feats"].float()
    seq = ids.shape[1] - 1
    inputs = feats[:, : seq - 1] + (torch.rand(feats[:, : seq - 1].shape, generator=gen) - 0.5) * noise
    loss = torch.zeros(())
    for step in range(unroll):
        end = seq - 1 - step
        out = draft_hidden(draft, embed, ids[:, 1 + step : 1 + step + end], inputs[:, :end], shape)
        goal = slice(1 + step, 1 + step + end)
        ce = sparse_head_loss(out, head, batch["top"][:, goal], batch["probs"][:, goal])
        loss = loss + F.smooth_l1_loss(out, feats[:, goal]) + ce_weight * ce
        inputs = out
    return loss / unroll


def warm_start(init: Path) -> dict[str, torch.Tensor]:
    """A draft's weights in float32 from a training checkpoint or a saved draft folder."""
    if init.is_dir():
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()}
    return {k: v.clone() for k, v in torch.load(init)["draft"].items()}


def held_out_digest(source: Path) -> str | None:
    """The digest of the held-out texts recorded by ``source``: a run's work folder or one of its
    checkpoints (``manifest.json``), or a saved draft folder (its ``training.json``); None if none."""
    folder = source if source.is_dir() else source.parent
    if (folder / "manifest.json").exists():
        return json.loads((folder / "manifest.json").read_text()).get("held_out_digest")
    if (folder / "training.json").exists():
        return json.loads((folder / "training.json").read_text()).get("manifest", {}).get("held_out_digest")
    return None


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


@dataclass
class DraftRun:
    """One draft's data, training and evaluation under ``work`` (every stage resumable)."""

    work: Path
    target: Path
    token_map: Path
    shape: LayerShape
    seed: int = 0
    log: Callable[[str], None] = field(default_factory=stderr_log)
    checkpoint: str = "checkpoint.pt"  # under ``work``: runs side by side on the same data
    # Other runs' work folders (features done) whose training sequences train beside this one's;
    # evaluation stays on this run's held-out sets (every run holds out the same files).
    more_data: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)

    def _model(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.target, dtype=dtype).eval()

    @property
    def _corpus(self) -> dict:
        return torch.load(self.work / "corpus.pt")

    def corpus(
        self,
        domains: dict[str, tuple[list[str], list[str]]],
        *,
        seq: int,
        prompt: int,
        gen_seqs: int,
        text_seqs: int,
        eval_seqs: int,
        manifest: dict | None = None,
    ) -> None:
        """Tokenize ``domains`` and draw the training windows, generation prompts and held-out sets
        (``corpus.pt``; kept if present); ``manifest.json`` holds ``manifest`` (what the domains
        were made of), the counts, the draw's settings and a digest of the held-out texts' content
        hashes (runs with the same one hold out the same text)."""
        if (self.work / "corpus.pt").exists():
            return self.log("corpus: kept")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.target)
        rng = random.Random(self.seed)
        out: dict = {"seq": seq, "prompt": prompt, "text": [], "prompts": [], "held": {}, "held_prompts": {}}
        out["held_documents"] = {}
        counts = {}
        for (name, (train, held)), n_text, n_gen in zip(
            domains.items(), split_even(text_seqs, len(domains)), split_even(gen_seqs, len(domains))
        ):
            train_ids, held_ids = (
                [] if not t else tok(t, add_special_tokens=False).input_ids for t in (train, held)
            )
            out["text"] += windows(train_ids, n_text, seq, tok.bos_token_id, rng)[0]
            out["prompts"] += windows(train_ids, n_gen, prompt, tok.bos_token_id, rng)[0]
            out["held"][name], out["held_documents"][f"{name}_text"] = windows(
                held_ids, eval_seqs, seq, tok.bos_token_id, rng
            )
            out["held_prompts"][name], out["held_documents"][f"{name}_generated"] = windows(
                held_ids, eval_seqs, prompt, tok.bos_token_id, rng
            )
            counts[name] = {
                "train_files": len(train),
                "held_out_files": len(held),
                "train_tokens": sum(map(len, train_ids)),
                "held_out_tokens": sum(map(len, held_ids)),
            }
            self.log(f"corpus {name}: {counts[name]}")
        out["counts"] = counts
        settings = {"seq": seq, "prompt": prompt, "gen_seqs": gen_seqs, "text_seqs": text_seqs}
        settings |= {"eval_seqs": eval_seqs, "seed": self.seed, "target": self.target.name}
        held_hashes = sorted(content_hash(t) for _, held in domains.values() for t in held)
        held_digest = hashlib.sha256("\n".join(held_hashes).encode()).hexdigest()
        record = (manifest or {}) | {"counts": counts, "settings": settings, "held_out_digest": held_digest}
        (self.work / "manifest.json").write_text(json.dumps(record, indent=1) + "\n")
        save_atomic(out, self.work / "corpus.pt")

    def _continue(self, prompts: list[list[int]], folder: Path, dtype: torch.dtype, batch: int) -> None:
        """The target's greedy continuations (``dtype``) of ``prompts`` up to ``seq`` tokens, in
        shards of ``batch`` under ``folder`` (present shards are skipped)."""
        folder.mkdir(exist_ok=True)
        todo = [i for i in range(0, len(prompts), batch) if not (folder / f"{i:06d}.pt").exists()]
        if not todo:
            return self.log(f"generate {folder.name}: kept")
        corpus = self._corpus
        model = self._model(dtype)
        eos = (
            [model.config.eos_token_id]
            if isinstance(model.config.eos_token_id, int)
            else model.config.eos_token_id
        )
        suppress = sorted({*eos, model.config.pad_token_id or 0})
        for i in todo:
            started = time.monotonic()
            rows = torch.tensor(prompts[i : i + batch])
            seqs = greedy_continuations(model, rows, corpus["seq"] - corpus["prompt"], suppress)
            save_atomic(seqs, folder / f"{i:06d}.pt")
            made = rows.shape[0] * (corpus["seq"] - corpus["prompt"])
            rate = made / (time.monotonic() - started)
            self.log(f"generate {folder.name} {i + rows.shape[0]}/{len(prompts)}: {rate:.0f} tok/s")

    def generate(self, batch: int) -> None:
        """The target's greedy continuations of the training prompts in bfloat16 (``gen/``), then of
        the held-out prompts in float32 as served (``held_gen/``), in resumable shards of ``batch``."""
        corpus = self._corpus
        self._continue(corpus["prompts"], self.work / "gen", torch.bfloat16, batch)
        held = [p for ps in corpus["held_prompts"].values() for p in ps]
        self._continue(held, self.work / "held_gen", torch.float32, batch)

    def _sequences(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Training sequences (windows then continuations) and held-out sets by name."""
        corpus = self._corpus
        gens, held_gens = (
            torch.cat([torch.load(p) for p in sorted((self.work / f).glob("*.pt"))] or [torch.zeros(0, 0)])
            for f in ("gen", "held_gen")
        )
        held_prompts = sum(map(len, corpus["held_prompts"].values()))
        finished = gens.shape[0] == len(corpus["prompts"]) and held_gens.shape[0] == held_prompts
        assert finished, "generate is not finished"
        text = torch.tensor(corpus["text"], dtype=torch.long).reshape(-1, corpus["seq"])  # none: [0, seq]
        train = torch.cat([text, gens.long().reshape(-1, corpus["seq"])])
        held = {f"{name}_text": torch.tensor(w) for name, w in corpus["held"].items()}
        start = 0
        for name, prompts in corpus["held_prompts"].items():
            held[f"{name}_generated"] = held_gens[start : start + len(prompts)]
            start += len(prompts)
        return train, held

    def hot(self) -> torch.Tensor:
        return torch.as_tensor(torch.load(self.token_map)).long()

    def features(self, topk: int, shard: int = 32, dtype: torch.dtype = torch.bfloat16) -> None:
        """The target's features and top-k over the hot head of every training sequence, its forward
        in ``dtype`` (``feat/``, in shards of ``shard``), and of every held-out set with its full
        argmax, in float32 as served (``held.pt``, in pieces of ``shard``)."""
        train, held = self._sequences()
        folder = self.work / "feat"
        folder.mkdir(exist_ok=True)
        # Last shards first: the continuations, what the served draft reads, survive a run cut short.
        todo = [i for i in range(0, train.shape[0], shard) if not (folder / f"{i:06d}.pt").exists()][::-1]
        if not (self.work / "held.pt").exists():
            model = self._model(torch.float32)
            head = model.get_output_embeddings().weight[self.hot()]
            sets = {}
            for name, ids in held.items():
                pieces = [
                    target_features(model, ids[i : i + shard], head, topk, argmax=True)
                    for i in range(0, ids.shape[0], shard)
                ]
                sets[name] = {"ids": ids} | {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
                self.log(f"features {name}: {ids.shape[0]} held-out sequences")
            save_atomic(sets, self.work / "held.pt")
        if not todo:
            return self.log("features: kept")
        model = self._model(dtype)
        head = model.get_output_embeddings().weight[self.hot()]
        for i in todo:
            started = time.monotonic()
            ids = train[i : i + shard]
            save_atomic({"ids": ids} | target_features(model, ids, head, topk), folder / f"{i:06d}.pt")
            rate = ids.numel() / (time.monotonic() - started)
            self.log(f"features {i + ids.shape[0]}/{train.shape[0]}: {rate:.0f} tok/s")

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's unscaled embedding table (what SGLang hands the draft) and its hot head."""
        model = self._model(torch.float32)
        embed = model.get_input_embeddings().weight.detach()
        return embed, model.get_output_embeddings().weight.detach()[self.hot()]

    def train(
        self,
        *,
        batch: int,
        epochs: float,
        lr: float,
        ce_weight: float,
        unroll: int,
        save_every: int,
        stop_at: int | None = None,
        init: Path | None = None,
        layers: int = 1,
    ) -> None:
        """AdamW over the draft for ``epochs`` passes over the training sequences, resuming from
        ``self.checkpoint`` (saved every ``save_every`` steps and where the run stops). ``stop_at``
        ends this run after that step, as an interrupted run would: the next call goes on. ``init``
        (another run's checkpoint) warm-starts the draft's weights with a fresh optimizer and
        schedule instead of a random init; a draft folder (``model.safetensors``, as shipped) works too.
        ``layers`` decoder layers: a warm start from fewer gains layers that start as the identity."""
        self._check_same_held_out(init)
        folders = (self.work, *self.more_data)
        shards = [torch.load(p) for w in folders for p in sorted((w / "feat").glob("*.pt"))]
        assert len({s["ids"].shape[1] for s in shards}) == 1, "every data folder needs the same --seq"
        data = {k: torch.cat([s[k] for s in shards]) for k in ("ids", "feats", "top", "probs")}
        count, tokens = data["ids"].shape[0], data["ids"].shape[1] - 1
        steps = int(epochs * count) // batch
        end = steps if stop_at is None else min(stop_at, steps)
        path = self.work / self.checkpoint
        state = torch.load(path) if path.exists() else None
        start = state["step"] if state else 0
        if state is not None and start >= end:
            return self.log(f"train: kept at step {start}")
        embed, head = self._tables()
        head = head.bfloat16()
        gen = torch.Generator().manual_seed(self.seed + 1)
        if state:
            draft = state["draft"]
        elif init is not None:
            draft = grow_draft(warm_start(init), layers, self.shape, gen)
        else:
            draft = init_draft(self.shape.hidden, self.shape, gen, layers)
        opt, sched = adam(draft, max(steps, 1), lr)
        losses = state["losses"] if state else []
        if state is not None:
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
        self.log(f"train: {count} sequences of {tokens + 1} tokens, steps {start}..{end} of {steps}")

        # what evaluate reports as the training's settings (its own command line has other defaults)
        settings = dict(batch=batch, epochs=epochs, lr=lr, ce_weight=ce_weight, unroll=unroll, layers=layers)
        settings["init"] = None if init is None else str(init)

        def save(step: int) -> None:
            params = {k: v.detach() for k, v in draft.items()}
            state = {"step": step, "draft": params, "opt": opt.state_dict(), "sched": sched.state_dict()}
            save_atomic(state | {"losses": losses, "settings": settings}, path)

        per_epoch = count // batch
        started = time.monotonic()
        for step in range(start, end):
            epoch, index = divmod(step, per_epoch)
            order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed + 100 + epoch))
            rows = order[index * batch : (index + 1) * batch]
            noise = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            rows_data = {k: v[rows] for k, v in data.items()}
            loss = unrolled_loss(draft, embed, head, rows_data, self.shape, noise, unroll, ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(round(loss.item(), 4))
            done = step + 1
            if done % save_every == 0 or done == end:
                save(done)
                rate = (done - start) * batch * tokens / (time.monotonic() - started)
                recent = losses[-save_every:]
                self.log(
                    f"train step {done}/{steps}: loss {sum(recent) / len(recent):.3f} ({rate:.0f} tok/s)"
                )
        if start == end:  # nothing to train: the draft as it stands, for evaluate
            save(start)

    def _check_same_held_out(self, init: Path | None) -> None:
        """Refuse training data (``more_data``) or a warm start (``init``) from a run that held out
        other text: it may have trained on this run's held-out text, which evaluate would then
        score as never seen."""
        mine = held_out_digest(self.work)
        sources = [("more data", folder) for folder in self.more_data]
        sources += [("a warm start", init)] if init else []
        for role, source in sources:
            theirs = held_out_digest(source)
            if theirs != mine:
                recorded = f"held out other text ({theirs[:12]})" if theirs else "recorded no held-out digest"
                raise ValueError(
                    f"{source}: as {role} it {recorded}; this run holds out {str(mine)[:12]}. Its training "
                    "text may include this run's held-out text, so held-out figures would score memorized "
                    "text. Use a run drawn from the same corpus split (the same held_out_digest in "
                    "manifest.json), or train from scratch."
                )

    def trained_draft(self) -> dict[str, torch.Tensor]:
        """The trained draft in bfloat16, as shipped."""
        return {k: v.to(torch.bfloat16) for k, v in torch.load(self.work / self.checkpoint)["draft"].items()}

    @torch.no_grad()
    def score(self, weights: dict[str, torch.Tensor], steps: int) -> dict:
        """Held-out first-step top-1 agreement (the draft's argmax over the hot head against the
        float32 target's over the full vocabulary) per set, and offline chain accept lengths
        (``steps`` steps, top-k 1) on the held-out continuations, each with its 95% interval
        over the held-out documents the sequences came from."""
        draft = {k: v.to(torch.bfloat16).float() for k, v in weights.items()}  # as served
        embed, head = self._tables()
        hot = self.hot()
        held = torch.load(self.work / "held.pt")
        corpus = self._corpus
        prompt = corpus["prompt"]
        report: dict = {"held_out_top1_agreement": {}, "offline_chain": {}}
        for name, s in held.items():
            documents = torch.tensor(corpus["held_documents"][name])
            out = draft_hidden(draft, embed, s["ids"][:, 1:], s["feats"][:, :-1].float(), self.shape)
            agree = hot[(out @ head.T).argmax(-1)] == s["argmax"][:, 1:]
            hits, totals = agree.sum(1), torch.full((agree.shape[0],), agree.shape[1])
            report["held_out_top1_agreement"][name] = {
                "agreement": round(float(agree.float().mean()), 4),
                "ci95": bootstrap_interval(hits, totals, documents),
                "positions": agree.numel(),
                "sequences": agree.shape[0],
                "documents": len(documents.unique()),
            }
            self.log(f"agreement {name}: {report['held_out_top1_agreement'][name]}")
            if name.endswith("_generated"):
                greedy = s["argmax"][:, prompt - 1 : -1]  # the float32 target's tokens after the prompt
                chains = [
                    draft_chains(draft, embed, head, hot, i[1:], f[:-1].float(), self.shape, steps)
                    for i, f in zip(s["ids"], s["feats"])
                ]
                by_steps = {}
                for depth in range(1, steps + 1):  # 1..steps draft steps: the same chains, cut
                    counts = [chain_accept(c[:, :depth], prompt, g) for c, g in zip(chains, greedy.tolist())]
                    committed = torch.tensor([sum(c) for c in counts])
                    verifies = torch.tensor([len(c) for c in counts])
                    by_steps[depth] = round(float(committed.sum() / verifies.sum()), 4)
                # the interval and counts below are of the full chain (depth == steps, the last pass)
                report["offline_chain"][name] = {
                    "tokens_per_verify": by_steps[steps],
                    "ci95": bootstrap_interval(committed, verifies, documents),
                    "verifies": int(verifies.sum()),
                    "tokens_per_verify_by_steps": by_steps,
                    "sequences": len(s["ids"]),
                    "continuation_tokens_not_the_argmax": int((s["ids"][:, prompt:] != greedy).sum()),
                }
                self.log(f"chain {name}: {report['offline_chain'][name]}")
        return report

    def evaluate(self, steps: int) -> dict:
        """``score`` of the trained draft, with its data, losses and shape."""
        state = torch.load(self.work / self.checkpoint)
        report = self.score(state["draft"], steps)
        corpus = self._corpus
        corpora = [corpus] + [torch.load(w / "corpus.pt") for w in self.more_data]
        windows = sum(len(c["text"]) for c in corpora)
        generated = sum(len(c["prompts"]) for c in corpora)
        report["data"] = {
            "domains": corpus["counts"],
            "folders": [w.name for w in (self.work, *self.more_data)],
            "sequence_tokens": corpus["seq"],
            "text_windows": windows,
            "generated_sequences": generated,
            "training_tokens": (windows + generated) * corpus["seq"],
            "generated_tokens": generated * (corpus["seq"] - corpus["prompt"]),
            "steps": state["step"],
        }
        report["training_settings"] = state.get("settings")  # None: a checkpoint from before they were saved
        report["losses_every_100_steps"] = [
            round(sum(state["losses"][i : i + 100]) / len(state["losses"][i : i + 100]), 4)
            for i in range(0, len(state["losses"]), 100)
        ]
        report["draft"] = {
            "class": "LlamaForCausalLMEagle",
            "parameters": sum(v.numel() for v in state["draft"].values()),
            "layers": draft_layers(state["draft"]),
        }
        report["draft"] |= {
            k: getattr(self.shape, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "inter")
        }
        report["hot_head"] = len(self.hot())
        return report


def chain_accept(chains: torch.Tensor, prompt: int, greedy: list[int]) -> list[int]:
    """Offline EAGLE chain (top-k 1) over one greedy continuation: per verify, the tokens it
    commits (longest matching draft prefix + the bonus). ``chains`` is ``draft_chains`` over the
    continuation (its ids after BOS, the target's features before them): row ``t - 1`` the chain
    drafted after the draft read ids ``1..t``; ``greedy`` the tokens the target commits after the
    ``prompt`` (its argmax after each of ``ids[prompt - 1 : -1]``). A chain of fewer steps is the
    first columns of a longer one."""
    steps, done, counts = chains.shape[1], 1, []  # the prefill gave greedy[0]
    while done < len(greedy):
        drafted = chains[prompt + done - 2].tolist()  # after the last verified token, ids[prompt + done - 1]
        match = 0
        while match < steps and done + match < len(greedy) and drafted[match] == greedy[done + match]:
            match += 1
        counts.append(match + 1)
        done += match + 1
    return counts
