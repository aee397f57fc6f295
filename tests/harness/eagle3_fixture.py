"""A tiny EAGLE3 draft (LlamaForCausalLMEagle3) for the permutation fixture's target.

EAGLE3 drafts carry their own reduced vocab: ``lm_head`` has ``draft_vocab_size`` rows and the
checkpoint's ``d2t[i] = target_id(i) - i`` maps draft ids back to target ids, which is why SGLang
ignores ``--speculative-token-map`` for EAGLE3. The draft vocab here is the fixture's hot set
(where ``chain`` lives) topped up with random other ids, sorted as EAGLE3 training code saves it.

The weights are small random ones except for one path, built so that the d2t mapping shows in
the acceptance: a draft whose ids were mapped wrongly would still produce correct tokens (the
target verifies them) but would accept nothing. The single layer's q and k are a scaled slice
of the normed input embedding, so each position attends (almost) only to itself; v and o_proj
copy the first ``2 * head_dim`` coordinates of that embedding into the residual stream, and
the head row of draft id i is ``embed[pi^-1(d2t target id of i)]`` on those coordinates. So the
draft predicts pi(x) for its input token x whenever pi(x) is in the draft vocab. The target's
aux hidden states (2 captures: the embedding output and layer 0's output, which both equal
embed(x) in this target) enter through a small random ``fc``; the draft's own hidden state is
fed back normed (``norm_output``) and scaled down by ``norm.weight``, so it barely perturbs the
next step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import (
    PermFixture,
    cache_root,
    cached_build,
    llama_config,
    source_digest,
)

# The target's folder name already carries the perm builder's digest; this one covers this file.
EAGLE3_DIGEST = source_digest(__name__)
# SGLang captures layer i + 1's input for id i: -1 is the embedding output, 0 is layer 0's output.
# Two captures (not one) so the aux width differs from the hidden size and fc really runs.
AUX_LAYER_IDS = [-1, 0]
SELF_ATTN_SCALE = 4.0  # q = k = 4 * normed slice: > 0.9999 of each position's attention on itself
FEEDBACK_SCALE = 0.1  # norm.weight: the fed-back hidden state is ~1/7 of the copied embedding


def _load_target(target: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The target's config, embedding and pi^-1 (read off the LM head, whose rows copy embed rows)."""
    from safetensors.torch import load_file

    config = json.loads((Path(target) / "config.json").read_text())
    weights = load_file(str(Path(target) / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    row_of = {row.tobytes(): i for i, row in enumerate(embed.numpy())}
    # head[j] = embed[pi^-1(j)] exactly, so matching row bytes recovers pi^-1 without a matmul.
    inverse = torch.tensor([row_of[row.tobytes()] for row in head.numpy()])
    return config, embed, inverse


def _draft_vocab(hot: torch.Tensor, vocab: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted target ids of the draft vocab: the hot set first, then random other ids."""
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[hot] = False
    others = torch.nonzero(rest).flatten()
    others = others[torch.randperm(others.numel(), generator=gen)]
    return torch.cat([hot, others])[:size].sort().values


def _build_eagle3(path: Path, fixture: PermFixture, draft_vocab_size: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    target_cfg, embed, inverse = _load_target(fixture.target)
    vocab, hidden = target_cfg["vocab_size"], target_cfg["hidden_size"]
    heads, kv_heads = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    head_dim, inter = target_cfg["head_dim"], target_cfg["intermediate_size"]
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    hot = torch.load(fixture.token_map("hot"))
    ids = _draft_vocab(hot, vocab, draft_vocab_size, gen)

    def small(*shape: int, scale: float = 0.01) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    # The qkv input is [input_layernorm(embeds) | hidden_norm(hidden)], 2 * hidden wide.
    q_proj = small(heads * head_dim, 2 * hidden)
    k_proj = small(kv_heads * head_dim, 2 * hidden)
    v_proj = small(kv_heads * head_dim, 2 * hidden)
    o_proj = small(hidden, heads * head_dim, scale=0.001)
    group = heads // kv_heads  # q heads per kv head (GQA)
    eye = torch.eye(head_dim)
    for g in range(kv_heads):
        emb = slice(g * head_dim, (g + 1) * head_dim)  # kv head g sees embedding slice g
        k_proj[emb, emb] = SELF_ATTN_SCALE * eye
        v_proj[emb, emb] = eye
        for h in range(g * group, (g + 1) * group):
            q_proj[h * head_dim : (h + 1) * head_dim, emb] = SELF_ATTN_SCALE * eye
        # The group's first q head carries v back to coordinates emb of the residual stream.
        first = g * group * head_dim
        o_proj[emb, first : first + head_dim] = eye
    copied = kv_heads * head_dim  # coordinates of the embedding the layer copies
    rows = embed[inverse[ids], :copied]
    lm_head = small(draft_vocab_size, hidden, scale=0.001)
    lm_head[:, :copied] = rows / rows.norm(dim=1, keepdim=True)

    # The builder's promise, checked with plain torch for attention fully on self: the copy
    # path predicts pi(x) for chain tokens whose successor is in the draft vocab (all of them
    # when the vocab holds the hot set; fc only adds the target's input as small noise).
    pi = torch.empty_like(inverse)
    pi[inverse] = torch.arange(vocab)
    x = torch.tensor(fixture.chain[:16])
    x = x[torch.isin(pi[x], ids)]
    normed = embed[x] * hidden**0.5  # RMSNorm of a unit vector
    v = (normed @ v_proj[:, :hidden].T).view(len(x), kv_heads, head_dim)
    attn = v.repeat_interleave(group, dim=1).flatten(1) @ o_proj.T  # each q head reads its kv head
    draft_ids = (attn @ lm_head.T).argmax(-1)
    assert torch.equal(ids[draft_ids], pi[x]), "draft copy path is not pi"

    cfg = llama_config("LlamaForCausalLMEagle3", vocab, hidden, 1, inter, heads)
    cfg |= {
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True},
        "norm_output": True,
    }
    layer = "midlayer."  # the name published EAGLE3 checkpoints use (SGLang maps it to layers.0)
    tensors = {
        "embed_tokens.weight": embed,  # SGLang swaps in the target's, but the model has one
        "fc.weight": small(hidden, len(AUX_LAYER_IDS) * hidden, scale=0.02),
        f"{layer}self_attn.q_proj.weight": q_proj,
        f"{layer}self_attn.k_proj.weight": k_proj,
        f"{layer}self_attn.v_proj.weight": v_proj,
        f"{layer}self_attn.o_proj.weight": o_proj,
        f"{layer}mlp.gate_proj.weight": small(inter, hidden, scale=0.05),
        f"{layer}mlp.up_proj.weight": small(inter, hidden, scale=0.05),
        f"{layer}mlp.down_proj.weight": small(hidden, inter, scale=0.001),
        f"{layer}input_layernorm.weight": torch.ones(hidden),
        f"{layer}hidden_norm.weight": torch.ones(hidden),
        f"{layer}post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.full((hidden,), FEEDBACK_SCALE),
        "lm_head.weight": lm_head,
    }
    tensors = {name: t.float().contiguous() for name, t in tensors.items()}
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["d2t"] = ids - torch.arange(draft_vocab_size)  # int64 offsets, as SpecForge saves them
    tensors["t2d"] = t2d

    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def eagle3_draft(fixture: PermFixture, draft_vocab_size: int = 1024, seed: int = 4321) -> str:
    """Build (once, cached) an EAGLE3 draft for ``fixture.target``; returns its directory."""
    root = cache_root() / f"eagle3-{EAGLE3_DIGEST}-{fixture.root.name}-d{draft_vocab_size}-s{seed}"
    build = lambda path: _build_eagle3(path, fixture, draft_vocab_size, seed)  # noqa: E731
    return str(cached_build(root, build, marker="config.json"))
