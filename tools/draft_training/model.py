"""A plain-torch EAGLE-1 draft (SGLang's ``LlamaForCausalLMEagle``) and its trainer, over any config.

The draft is ``fc([embed(token t+1) | feature t])`` followed by Llama decoder layers whose first
has no input norm, and no final norm; its logits are ``head @ output``. Parameters are stored
under the checkpoint's names (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...), so a
trained draft is saved as its state_dict. The embedding and head are tensors given by the caller
(SGLang replaces the draft's with the target's), so a head of a token map's hot rows works too.

What SGLang 0.5.23 hands the draft (``sglang/srt``), which training must reproduce:
- the draft's first layer has no ``input_layernorm`` (``models/llama_eagle.py:55``); its model is
  ``fc`` on the concatenation of the embedded ids and ``spec_info.hidden_states``
  (``llama_eagle.py:106``), then the layers, with no final norm (``llama_eagle.py:110-114``);
- the embedding is a plain ``VocabParallelEmbedding`` (``llama_eagle.py:74``): no scale. A Gemma 3
  target gives it its raw ``embed_tokens.weight`` (``models/gemma3_causal.py:947-950``); the
  sqrt(hidden) scale lives only in Gemma's own embedding module (``gemma3_causal.py:548,570``);
- the head is the target's ``lm_head.weight``, which for Gemma 3 is the tied embedding table
  (``gemma3_causal.py:750``);
- the features are the target's final hidden states after its final norm: Gemma's model returns
  ``self.norm(hidden_states, residual)`` (``gemma3_causal.py:674``) and passes it to the logits
  processor with no pre-norm states (``gemma3_causal.py:787-793``), which stores those states for
  the draft (``layers/logits_processor.py:866``) - for a Transformers checkpoint, that is
  ``model.model(ids).last_hidden_state``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

LOSS_CHUNK = 256  # rows per head matmul in the losses: [256, V] logits stay off glibc's mmap path


@dataclass(frozen=True)
class LayerShape:
    """The dimensions of a Llama decoder layer and its rotary embedding."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @classmethod
    def from_config(cls, cfg: dict) -> LayerShape:
        """The shape a Llama ``config.json`` describes."""
        return cls(
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
            cfg["intermediate_size"],
            cfg.get("rope_theta", 10000.0),
            cfg["rms_norm_eps"],
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary(x: torch.Tensor, theta: float = 10000.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of ``x [..., seq, head_dim]`` at ``positions`` (broadcast against
    ``x.shape[:-1]``; default 0..seq-1), rotate_half."""
    dim, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    at = torch.arange(seq, dtype=torch.float32) if positions is None else positions.float()
    angles = at[..., None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def init_layer(params: dict, prefix: str, gen: torch.Generator, input_ln: bool, shape: LayerShape) -> None:
    """Random weights of one decoder layer (output projections at half scale) into ``params``."""

    def linear(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * (scale / math.sqrt(inp))

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    params[f"{prefix}self_attn.q_proj.weight"] = linear(q, shape.hidden)
    params[f"{prefix}self_attn.k_proj.weight"] = linear(kv, shape.hidden)
    params[f"{prefix}self_attn.v_proj.weight"] = linear(kv, shape.hidden)
    params[f"{prefix}self_attn.o_proj.weight"] = linear(shape.hidden, q, 0.5)
    params[f"{prefix}mlp.gate_proj.weight"] = linear(shape.inter, shape.hidden)
    params[f"{prefix}mlp.up_proj.weight"] = linear(shape.inter, shape.hidden)
    params[f"{prefix}mlp.down_proj.weight"] = linear(shape.hidden, shape.inter, 0.5)
    params[f"{prefix}post_attention_layernorm.weight"] = torch.ones(shape.hidden)
    if input_ln:
        params[f"{prefix}input_layernorm.weight"] = torch.ones(shape.hidden)


def attention_inputs(
    p: dict, prefix: str, x: torch.Tensor, shape: LayerShape, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's queries, keys and values of ``x [batch, seq, hidden]`` at ``positions``
    (default 0..seq-1), rotated, the KV heads repeated: each ``[batch, heads, seq, head_dim]``
    (the EAGLE draft's first layer has no input norm: it reads the residual as it is)."""
    batch, seq, _ = x.shape
    heads, kv, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    norm_w = p.get(f"{prefix}input_layernorm.weight")
    h = rms_norm(x, norm_w, shape.eps) if norm_w is not None else x
    q = (h @ p[f"{prefix}self_attn.q_proj.weight"].T).view(batch, seq, heads, head_dim).transpose(1, 2)
    k = (h @ p[f"{prefix}self_attn.k_proj.weight"].T).view(batch, seq, kv, head_dim).transpose(1, 2)
    v = (h @ p[f"{prefix}self_attn.v_proj.weight"].T).view(batch, seq, kv, head_dim).transpose(1, 2)
    q, k = rotary(q, shape.rope_theta, positions), rotary(k, shape.rope_theta, positions)
    return q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)


def after_attention(
    p: dict, prefix: str, x: torch.Tensor, attn: torch.Tensor, shape: LayerShape
) -> torch.Tensor:
    """The rest of a decoder layer on ``x``, given its attention ``attn [batch, seq, heads * head_dim]``."""
    x = x + attn @ p[f"{prefix}self_attn.o_proj.weight"].T
    h = rms_norm(x, p[f"{prefix}post_attention_layernorm.weight"], shape.eps)
    gate, up = h @ p[f"{prefix}mlp.gate_proj.weight"].T, h @ p[f"{prefix}mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ p[f"{prefix}mlp.down_proj.weight"].T


def layer(p: dict, prefix: str, x: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """One decoder layer on ``x [batch, seq, hidden]`` with causal attention."""
    batch, seq, _ = x.shape
    q, k, v = attention_inputs(p, prefix, x, shape)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
    return after_attention(p, prefix, x, attn, shape)


def init_draft(hidden: int, shape: LayerShape, gen: torch.Generator, layers: int = 1) -> dict:
    """A draft's random ``fc`` and ``layers`` decoder layers (no embedding or head)."""
    draft = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)}
    draft["fc.bias"] = torch.zeros(hidden)
    for i in range(layers):
        init_layer(draft, f"layers.{i}.", gen, input_ln=i > 0, shape=shape)
    return draft


def draft_layers(p: dict) -> int:
    """How many decoder layers a draft's parameters hold."""
    return 1 + max(int(k.split(".")[1]) for k in p if k.startswith("layers."))


def grow_draft(p: dict, layers: int, shape: LayerShape, gen: torch.Generator) -> dict:
    """``p`` with random layers appended up to ``layers``, each with zero output projections: the
    grown draft computes what ``p`` does until training moves them (a warm start for a deeper draft)."""
    grown = dict(p)
    for i in range(draft_layers(p), layers):
        init_layer(grown, f"layers.{i}.", gen, input_ln=True, shape=shape)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            grown[f"layers.{i}.{name}"].zero_()
    return grown


def draft_hidden(
    p: dict, embed: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, shape: LayerShape
) -> torch.Tensor:
    """The EAGLE draft's output: fc([embed(ids) | features]), its layers, no final norm."""
    x = torch.cat([embed[ids], features], -1) @ p["fc.weight"].T + p["fc.bias"]
    for i in range(draft_layers(p)):
        x = layer(p, f"layers.{i}.", x, shape)
    return x


@torch.no_grad()
def draft_chains(
    p: dict,
    embed: torch.Tensor,
    head: torch.Tensor,
    hot: torch.Tensor,
    ids: torch.Tensor,
    features: torch.Tensor,
    shape: LayerShape,
    steps: int,
) -> torch.Tensor:
    """The top-k 1 chain of ``steps`` ids the draft proposes after every position of one sequence,
    as SGLang runs it, all at once: row b is drafted after the draft read ``ids[: b + 1]`` with
    the target's ``features[: b + 1]`` (step 1, the teacher-forced output at b); each later step
    reads the previous step's id and output at the next position and attends to the prefix and
    to its own chain only. ``ids [seq]``, ``features [seq, hidden]`` -> ``[seq, steps]`` ids of
    ``hot`` (argmax over the hot head ``head [H, hidden]``)."""
    seq, layers = ids.shape[0], draft_layers(p)
    x = (torch.cat([embed[ids], features], -1) @ p["fc.weight"].T + p["fc.bias"])[None]
    prefix_kv = []  # per layer: the teacher-forced keys and values [heads, seq, head_dim]
    for i in range(layers):
        q, k, v = attention_inputs(p, f"layers.{i}.", x, shape)
        prefix_kv.append((k[0], v[0]))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, seq, -1)
        x = after_attention(p, f"layers.{i}.", x, attn, shape)
    out = x[0]
    chains = [hot[(out @ head.T).argmax(-1)]]
    visible = torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]  # [base b, prefix position j]
    own_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
    for step in range(1, steps):
        # one query per base position b, at position b + step; the batch is the base positions
        y = (torch.cat([embed[chains[-1]], out], -1) @ p["fc.weight"].T + p["fc.bias"])[:, None]
        positions = (torch.arange(seq) + step)[:, None, None]
        for i in range(layers):
            q, k, v = attention_inputs(p, f"layers.{i}.", y, shape, positions)  # [seq, heads, 1, head_dim]
            own_kv[i].append((k, v))
            prefix_k, prefix_v = prefix_kv[i]
            own_k, own_v = (torch.cat(t, 2) for t in zip(*own_kv[i]))  # [seq, heads, step, head_dim]
            to_prefix = torch.einsum("bhd,hjd->bhj", q[:, :, 0], prefix_k)
            to_prefix = to_prefix.masked_fill(~visible[:, None], -math.inf)
            to_own = torch.einsum("bhd,bhjd->bhj", q[:, :, 0], own_k)
            scores = torch.cat([to_prefix, to_own], -1) / math.sqrt(shape.head_dim)
            weights = scores.softmax(-1)
            attn = torch.einsum("bhj,hjd->bhd", weights[..., :seq], prefix_v)
            attn = attn + torch.einsum("bhj,bhjd->bhd", weights[..., seq:], own_v)
            y = after_attention(p, f"layers.{i}.", y, attn.reshape(seq, 1, -1), shape)
        out = y[:, 0]
        chains.append(hot[(out @ head.T).argmax(-1)])
    return torch.stack(chains, 1)


def head_loss(
    hidden: torch.Tensor, head: torch.Tensor, *, labels: torch.Tensor | None = None, teacher=None
) -> torch.Tensor:
    """Mean cross-entropy of ``head @ hidden`` against ``labels`` (ids) or against the softmax of
    ``head @ teacher`` (the target's distribution over the head's rows), in LOSS_CHUNK-row pieces."""
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


def draft_loss(
    draft: dict,
    embed: torch.Tensor,
    head: torch.Tensor,
    ids: torch.Tensor,
    features: torch.Tensor,
    gen: torch.Generator,
    shape: LayerShape,
    noise: float = 0.2,
) -> torch.Tensor:
    """EAGLE-1's loss over two draft steps on ``ids [B, S+1]`` and the target's ``features`` at
    them: position t reads (token t+1, feature t) and must give the target's feature t+1 and
    next-token distribution (over ``head``'s rows); step 2 reads its own step-1 output. Features
    get uniform noise of width ``noise``, as EAGLE trains."""
    seq = ids.shape[1] - 1
    features = features.float()
    noisy = features[:, :-2] + (torch.rand(features[:, :-2].shape, generator=gen) - 0.5) * noise
    loss = torch.zeros(())
    inputs = noisy
    for step in range(2):
        end = seq - 1 - step
        out = draft_hidden(draft, embed, ids[:, 1 + step : 1 + step + end], inputs[:, :end], shape)
        goal = features[:, 1 + step : 1 + step + end]
        cls = head_loss(out, head, teacher=goal)
        loss = loss + F.smooth_l1_loss(out, goal) + 0.5 * cls
        inputs = out  # the second step drafts from the draft's own feature, as at serving time
    return loss


def adam(params: dict, steps: int, lr: float):
    """AdamW over every tensor of ``params`` with 5% linear warm-up then cosine decay."""
    trainable = [t.requires_grad_() for t in params.values()]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    return opt, sched


def train(
    params: dict, batches, loss_of, steps: int, lr: float, log, every: int = 50, label: str = "draft"
) -> list[float]:
    """``steps`` AdamW steps of ``loss_of(params, batch)`` over ``batches``; the logged losses."""
    opt, sched = adam(params, steps, lr=lr)
    losses = []
    for step, batch in enumerate(batches):
        loss = loss_of(params, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % every == 0 or step == steps - 1:
            losses.append(round(loss.item(), 4))
            log(f"{label} step {step}: loss {loss.item():.3f}")
    return losses


def first_step_agreement(
    draft: dict, embed: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, shape
) -> torch.Tensor:
    """Per position of ``ids [B, S+1]``: does the draft's first-step argmax over ``head`` equal
    the target's (``features`` are the target's at ``ids``)?"""
    rows = []
    with torch.no_grad():
        for i in range(ids.shape[0]):  # one sequence at a time: [S, V] logits of a 262144-id head
            out = draft_hidden(draft, embed, ids[i : i + 1, 1:], features[i : i + 1, :-1].float(), shape)
            rows.append((out @ head.T).argmax(-1) == (features[i : i + 1, 1:].float() @ head.T).argmax(-1))
    return torch.cat(rows)


def save_eagle_draft(out: Path, draft: dict, cfg: dict, shape: LayerShape) -> None:
    """``draft`` as SGLang loads a ``LlamaForCausalLMEagle`` (safetensors without embedding or
    head) and its Llama config, carrying the target's ``cfg`` vocabulary, token ids and norm eps."""
    from safetensors.torch import save_file

    from sglang_frspec.demo.fixtures import llama_config

    layers, vocab = draft_layers(draft), cfg["vocab_size"]
    config = llama_config("LlamaForCausalLMEagle", vocab, shape.hidden, layers, shape.inter, shape.heads)
    shared = ("bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "max_position_embeddings")
    config |= {key: cfg[key] for key in shared if key in cfg}
    config |= {
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rope_theta": shape.rope_theta,
        "torch_dtype": str(next(iter(draft.values())).dtype).removeprefix("torch."),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in draft.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
