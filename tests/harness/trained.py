"""A small Llama target and EAGLE draft trained on real text, for acceptance that means something.

The text is what every CPython install has: the standard library's top-level modules (code, in
sorted file order) and ``pydoc_data.topics`` (the language reference's prose). Code files with
index % 8 == 7 are held out; the prose topics, sorted by name, are split in half: the first half
builds the ``prose`` map, the second gives out-of-domain prompts. Everything is trained on CPU in
float32 with fixed seeds and cached under a hash of the text and of this builder's source.

Built here:
- a byte-level BPE tokenizer (32k vocab) trained on the training code;
- a Llama target (``LlamaForCausalLM``) trained on that code until its held-out loss is well below
  a unigram model's (checked: the build fails otherwise);
- an EAGLE draft (``LlamaForCausalLMEagle``, the target's embedding and head) trained on the
  target's final hidden states: regression on the next hidden state plus cross-entropy with the
  target's next-token distribution, EAGLE-1's objective, with one unrolled step on its own output;
- maps of ``MAP_SIZES`` from the training code (``code_<n>``), and ``prose_<n>`` from held-out prose.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_frspec.demo.fixtures import (
    ModelFixture,
    cache_root,
    cached_build,
    llama_config,
    save_model,
    source_digest,
)

VOCAB = 32000
HIDDEN, LAYERS, HEADS, INTER = 128, 2, 4, 384
SEQ, BATCH = 128, 8
TARGET_STEPS, DRAFT_STEPS = 400, 200
LOSS_CHUNK = 256  # rows per head matmul in the losses: [256, V] logits stay off glibc's mmap path
EVAL_TOKENS = 32768  # held-out tokens the losses are measured on
# The greedy outputs of a model this small keep to a few hundred frequent ids (15-33 distinct ids in
# 384 tokens of held-out prompts), so acceptance changes below ~256 ids: the sizes span that range.
MAP_SIZES = (32, 128, 512, 2048)
PROSE_MAP_SIZE = 128
HELD_OUT_EVERY = 8  # code file i is held out when i % 8 == 7
PROMPT_TOKENS = 32  # prompts are this many tokens of held-out text

BUILDER_DIGEST = source_digest(__name__, "sglang_frspec.demo.fixtures")


@dataclass(frozen=True)
class TrainedFixture(ModelFixture):
    """The trained target/draft, its maps (``token_map("code_128")``, ...), the training
    code's token counts (``counts``) and held-out prompts."""

    @property
    def counts(self) -> str:
        """Token counts of the training code (``build-map --save-counts`` format)."""
        return str(self.root / "counts_code.pt")

    @property
    def report(self) -> dict:
        """Sizes, losses and timings printed by the build (``report.json``)."""
        return json.loads((self.root / "report.json").read_text())

    def prompts(self, domain: str) -> list[list[int]]:
        """Held-out prompts (token ids) of ``domain``: ``code`` or ``prose``."""
        return json.loads((self.root / "prompts.json").read_text())[domain]


def stdlib_texts() -> tuple[list[str], list[str], list[str], list[str]]:
    """(training code, held-out code, prose for maps, held-out prose), in a fixed order."""
    import pydoc_data.topics

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    code = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    train = [t for i, t in enumerate(code) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [t for i, t in enumerate(code) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    half = len(topics) // 2
    return train, held_out, topics[:half], topics[half:]


def _text_digest(*groups: list[str]) -> str:
    digest = hashlib.sha256()
    for group in groups:
        for text in group:
            digest.update(hashlib.sha256(text.encode()).digest())
        digest.update(b"|")
    return digest.hexdigest()[:12]


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts' ids in order, each followed by EOS (id 2)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [2]
    return torch.tensor(ids)


# A Llama in plain torch with SGLang's/HF's conventions (RMSNorm, neox rotary, GQA, SwiGLU). The
# parameters are stored under the checkpoint's own names, so saving is a state_dict.
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x [batch, heads, seq, head_dim]`` at positions 0..seq-1 (rotate_half)."""
    dim, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _init_layer(params: dict, prefix: str, gen: torch.Generator, input_ln: bool) -> None:
    head_dim, kv = HIDDEN // HEADS, max(1, HEADS // 2)

    def linear(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * (scale / math.sqrt(inp))

    params[f"{prefix}self_attn.q_proj.weight"] = linear(HEADS * head_dim, HIDDEN)
    params[f"{prefix}self_attn.k_proj.weight"] = linear(kv * head_dim, HIDDEN)
    params[f"{prefix}self_attn.v_proj.weight"] = linear(kv * head_dim, HIDDEN)
    params[f"{prefix}self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * head_dim, 0.5)
    params[f"{prefix}mlp.gate_proj.weight"] = linear(INTER, HIDDEN)
    params[f"{prefix}mlp.up_proj.weight"] = linear(INTER, HIDDEN)
    params[f"{prefix}mlp.down_proj.weight"] = linear(HIDDEN, INTER, 0.5)
    params[f"{prefix}post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    if input_ln:
        params[f"{prefix}input_layernorm.weight"] = torch.ones(HIDDEN)


def _layer(p: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer on ``x [batch, seq, hidden]`` with causal attention (the EAGLE draft's
    first layer has no input norm: it reads the residual as it is)."""
    batch, seq, _ = x.shape
    head_dim, kv = HIDDEN // HEADS, max(1, HEADS // 2)
    norm_w = p.get(f"{prefix}input_layernorm.weight")
    h = _rms_norm(x, norm_w) if norm_w is not None else x
    q = (h @ p[f"{prefix}self_attn.q_proj.weight"].T).view(batch, seq, HEADS, head_dim).transpose(1, 2)
    k = (h @ p[f"{prefix}self_attn.k_proj.weight"].T).view(batch, seq, kv, head_dim).transpose(1, 2)
    v = (h @ p[f"{prefix}self_attn.v_proj.weight"].T).view(batch, seq, kv, head_dim).transpose(1, 2)
    q, k = _rotary(q), _rotary(k)
    k, v = k.repeat_interleave(HEADS // kv, 1), v.repeat_interleave(HEADS // kv, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
    x = x + attn @ p[f"{prefix}self_attn.o_proj.weight"].T
    h = _rms_norm(x, p[f"{prefix}post_attention_layernorm.weight"])
    gate, up = h @ p[f"{prefix}mlp.gate_proj.weight"].T, h @ p[f"{prefix}mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ p[f"{prefix}mlp.down_proj.weight"].T


def _head_loss(
    hidden: torch.Tensor, head: torch.Tensor, *, labels: torch.Tensor | None = None, teacher=None
) -> torch.Tensor:
    """Mean cross-entropy of ``head @ hidden`` against ``labels`` (ids) or against the softmax of
    ``head @ teacher`` (the target's distribution), in LOSS_CHUNK-row pieces."""
    rows = hidden.flatten(0, -2)
    total = torch.zeros(())
    for i in range(0, rows.shape[0], LOSS_CHUNK):
        log_q = (rows[i : i + LOSS_CHUNK] @ head.T).log_softmax(-1)
        if labels is not None:
            total = total - log_q.gather(1, labels.flatten()[i : i + LOSS_CHUNK, None]).sum()
        else:
            with torch.no_grad():
                p = (teacher.flatten(0, -2)[i : i + LOSS_CHUNK] @ head.T).softmax(-1)
            total = total - (p * log_q).sum()
    return total / rows.shape[0]


def _target_hidden(p: dict, ids: torch.Tensor) -> torch.Tensor:
    """The target's final (normed) hidden states: what SGLang hands the EAGLE draft."""
    x = p["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        x = _layer(p, f"model.layers.{i}.", x)
    return _rms_norm(x, p["model.norm.weight"])


def _draft_hidden(p: dict, embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The EAGLE draft's output: fc([embed(ids) | features]), one layer, no final norm."""
    x = torch.cat([embed[ids], features], -1) @ p["fc.weight"].T + p["fc.bias"]
    return _layer(p, "layers.0.", x)


def _batches(stream: torch.Tensor, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - SEQ - 1, (BATCH,), generator=gen)
        yield torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()])


def _adam(params: dict, steps: int, lr: float):
    trainable = [t.requires_grad_() for t in params.values()]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    return opt, sched


def _held_out_loss(p: dict, stream: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) of the target over ``stream`` in SEQ windows."""
    stream = stream[: EVAL_TOKENS + 1]
    windows = stream[: (stream.numel() - 1) // SEQ * SEQ + 1]
    inputs = windows[:-1].view(-1, SEQ)
    labels = windows[1:].view(-1, SEQ)
    total = 0.0
    with torch.no_grad():
        for i in range(0, inputs.shape[0], BATCH):
            hidden = _target_hidden(p, inputs[i : i + BATCH])
            chunk = labels[i : i + BATCH]
            total += float(_head_loss(hidden, p["lm_head.weight"], labels=chunk)) * chunk.numel()
    return total / labels.numel()


def _unigram_loss(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Held-out cross-entropy (nats) of add-one-smoothed training unigram frequencies."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[held_out[1 : EVAL_TOKENS + 1]].mean())


def _train_target(params: dict, stream: torch.Tensor, log) -> None:
    opt, sched = _adam(params, TARGET_STEPS, lr=3e-3)
    for step, batch in enumerate(_batches(stream, TARGET_STEPS, seed=1)):
        loss = _head_loss(
            _target_hidden(params, batch[:, :-1]), params["lm_head.weight"], labels=batch[:, 1:]
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == TARGET_STEPS - 1:
            log(f"target step {step}: loss {loss.item():.3f}")


def _draft_loss(draft: dict, target: dict, batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """EAGLE-1's loss over two draft steps: position t reads (token t+1, feature t) and must give
    the target's feature t+1 and next-token distribution; step 2 reads its own step-1 output."""
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    with torch.no_grad():
        features = _target_hidden(target, batch)  # [B, SEQ+1, H]
    noisy = features[:, :-2] + (torch.rand(features[:, :-2].shape, generator=gen) - 0.5) * 0.2
    loss = torch.zeros(())
    inputs = noisy
    for step in range(2):
        end = SEQ - 1 - step
        out = _draft_hidden(draft, embed, batch[:, 1 + step : 1 + step + end], inputs[:, :end])
        goal = features[:, 1 + step : 1 + step + end]
        cls = _head_loss(out, head, teacher=goal)
        loss = loss + F.smooth_l1_loss(out, goal) + 0.5 * cls
        inputs = out  # the second step drafts from the draft's own feature, as at serving time
    return loss


def _train_draft(draft: dict, target: dict, stream: torch.Tensor, log) -> None:
    opt, sched = _adam(draft, DRAFT_STEPS, lr=2e-3)
    gen = torch.Generator().manual_seed(3)
    for step, batch in enumerate(_batches(stream, DRAFT_STEPS, seed=2)):
        loss = _draft_loss(draft, target, batch, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == DRAFT_STEPS - 1:
            log(f"draft step {step}: loss {loss.item():.3f}")


def _draft_agreement(draft: dict, target: dict, stream: torch.Tensor) -> float:
    """How often the draft's first-step argmax equals the target's greedy token (held-out code)."""
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    ids = stream[: (stream.numel() - 1) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1)[:8]
    with torch.no_grad():
        features = _target_hidden(target, ids)
        out = _draft_hidden(draft, embed, ids[:, 1:], features[:, :-1])
        return float(((out @ head.T).argmax(-1) == (features[:, 1:] @ head.T).argmax(-1)).float().mean())


def _check_against_transformers(path: Path, params: dict, ids: torch.Tensor) -> None:
    """The saved target, loaded by HF transformers, gives the logits it was trained with."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours = _target_hidden(params, ids[None]) @ params["lm_head.weight"].T
        theirs = model(ids[None]).logits
    error = (ours - theirs).abs().max().item()
    assert error < 1e-3, f"trained target and its checkpoint disagree (max |logit diff| {error:.2e})"


def _build(root: Path, texts: tuple[list[str], ...]) -> None:
    from sglang_frspec.maps.build import build_token_map, rebuild_token_map

    train_code, held_code, prose_map, prose_prompts = texts
    root.mkdir(parents=True)
    started = time.monotonic()
    report: dict = {}
    lines: list[str] = []

    def log(message: str) -> None:
        line = f"[trained fixture {time.monotonic() - started:6.1f}s] {message}"
        lines.append(line)
        print(line, file=sys.stderr, flush=True)

    torch.manual_seed(0)
    target_dir, draft_dir = root / "target", root / "draft"
    tokenizer = _train_tokenizer(train_code)
    train_stream, held_stream = _token_stream(tokenizer, train_code), _token_stream(tokenizer, held_code)
    report |= {
        "vocab": len(tokenizer),
        "train_tokens": train_stream.numel(),
        "held_out_tokens": held_stream.numel(),
    }
    log(f"tokenizer: {len(tokenizer)} ids; " + ", ".join(f"{k} {v}" for k, v in report.items()))

    gen = torch.Generator().manual_seed(0)
    target = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
    }
    for i in range(LAYERS):
        _init_layer(target, f"model.layers.{i}.", gen, input_ln=True)
    _train_target(target, train_stream, log)
    target = {k: v.detach() for k, v in target.items()}
    held_loss, unigram = _held_out_loss(target, held_stream), _unigram_loss(train_stream, held_stream)
    report |= {"target_held_out_loss": held_loss, "unigram_held_out_loss": unigram}
    log(f"target held-out loss {held_loss:.3f} nats vs unigram {unigram:.3f}")
    if held_loss > unigram - 1.0:
        raise RuntimeError(
            f"trained target is not clearly better than unigram ({held_loss:.3f} vs {unigram:.3f})"
        )
    cfg = llama_config("LlamaForCausalLM", VOCAB, HIDDEN, LAYERS, INTER, HEADS)
    save_model(target_dir, target, cfg)
    tokenizer.save_pretrained(str(target_dir))
    _check_against_transformers(target_dir, target, held_stream[:64])

    draft = {"fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) / math.sqrt(2 * HIDDEN)}
    draft["fc.bias"] = torch.zeros(HIDDEN)
    _init_layer(draft, "layers.0.", gen, input_ln=False)
    _train_draft(draft, target, train_stream, log)
    agreement = _draft_agreement(draft, target, held_stream)
    report["draft_top1_agreement"] = agreement
    log(f"draft step-1 agreement with the target's greedy token (held-out code): {agreement:.1%}")
    draft = {k: v.detach() for k, v in draft.items()}
    draft |= {
        "embed_tokens.weight": target["model.embed_tokens.weight"],
        "lm_head.weight": target["lm_head.weight"],
    }
    save_model(draft_dir, draft, llama_config("LlamaForCausalLMEagle", VOCAB, HIDDEN, 1, INTER, HEADS))

    corpus = root / "corpus"
    corpus.mkdir()
    for name, docs in (("code", train_code), ("prose", prose_map)):
        with open(corpus / f"{name}.jsonl", "w") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    _, code_counts = build_token_map(str(target_dir), [corpus / "code.jsonl"], MAP_SIZES[0], progress=False)
    code_counts.save(root / "counts_code.pt")
    for size in MAP_SIZES:
        torch.save(rebuild_token_map(code_counts, size), root / f"map_code_{size}.pt")
    prose_ids, _ = build_token_map(str(target_dir), [corpus / "prose.jsonl"], PROSE_MAP_SIZE, progress=False)
    torch.save(prose_ids, root / f"map_prose_{PROSE_MAP_SIZE}.pt")
    code_coverage = code_counts.best_coverage(MAP_SIZES)
    report["training_text_coverage"] = code_coverage
    log(f"maps {list(MAP_SIZES)} (code), {PROSE_MAP_SIZE} (prose); training-text coverage {code_coverage}")

    prose_stream = _token_stream(tokenizer, prose_prompts)
    prompts = {
        domain: [stream[i : i + PROMPT_TOKENS].tolist() for i in range(0, 64 * 97, 97)]
        for domain, stream in (("code", held_stream), ("prose", prose_stream))
    }
    (root / "prompts.json").write_text(json.dumps(prompts))
    report["build_seconds"] = time.monotonic() - started
    (root / "build.log").write_text("\n".join(lines) + "\n")
    (root / "report.json").write_text(json.dumps(report, indent=1))


def trained_fixture() -> TrainedFixture:
    """Build (once, cached by text and builder hash) and return the trained fixture."""
    texts = stdlib_texts()
    root = cached_build(
        cache_root() / f"trained-{BUILDER_DIGEST}-{_text_digest(*texts)}",
        lambda path: _build(path, texts),
        marker="report.json",
    )
    return TrainedFixture(root)
