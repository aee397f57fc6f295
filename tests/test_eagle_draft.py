"""The plain-torch EAGLE draft the drafts are trained with, and the shipped Gemma 3 draft's files.

The draft forward of ``tests/harness/eagle_draft.py`` must compute what SGLang's
``LlamaForCausalLMEagle`` computes, or served acceptance falls below offline agreement. It is
compared with Transformers' Llama layer (the conventions SGLang's Llama loads checkpoints by:
neox rotary, GQA, an explicit ``head_dim``), with the first layer's input norm and the model's
final norm removed as SGLang's EAGLE class removes them (``llama_eagle.py:55, 110-114``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.harness.eagle_draft import LayerShape, draft_hidden, init_draft

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "sglang_frspec" / "demo" / "gemma3_draft"


def test_draft_forward_equals_transformers_llama_layer_without_input_and_final_norm():
    from transformers import LlamaConfig, LlamaModel

    # head_dim != hidden / heads, GQA, a non-default rope theta and eps: each is a way to differ.
    cfg = {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 80,
        "rope_theta": 5000.0,
        "rms_norm_eps": 1e-5,
    }
    shape = LayerShape.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    draft = init_draft(48, shape, gen)
    draft["layers.0.post_attention_layernorm.weight"] = torch.rand(48, generator=gen) + 0.5
    embed = torch.randn(100, 48, generator=gen)
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    features = torch.randn(2, 12, 48, generator=gen)

    hf = LlamaModel(LlamaConfig(**cfg, vocab_size=100, num_hidden_layers=1, attn_implementation="eager"))
    layer_weights = {k.removeprefix("layers.0."): v for k, v in draft.items() if k.startswith("layers.0.")}
    hf.layers[0].load_state_dict(layer_weights, strict=False)
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    fc = torch.cat([embed[ids], features], -1) @ draft["fc.weight"].T + draft["fc.bias"]
    with torch.no_grad():
        theirs = hf(inputs_embeds=fc).last_hidden_state
        ours = draft_hidden(draft, embed, ids, features, shape)
    assert (ours - theirs).abs().max() < 1e-5


def test_shipped_gemma3_draft_is_small_complete_and_servable_at_tp2():
    from safetensors import safe_open

    config = json.loads((SHIPPED / "config.json").read_text())
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 8 * 2**20
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["vocab_size"] == 262144  # Gemma 3's; SGLang gives the draft its embedding and head
    # Gemma 3 270M's ids and context: SGLang refuses a draft whose context is shorter.
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["max_position_embeddings"] == 32768
    shape = LayerShape.from_config(config)
    assert shape.heads % 2 == 0 and shape.kv_heads % 2 == 0  # served at TP=2
    expected = {k: v.shape for k, v in init_draft(shape.hidden, shape, torch.Generator()).items()}
    with safe_open(str(weights), "pt") as f:
        shipped = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {k: v.shape for k, v in shipped.items()} == expected  # no embed_tokens or lm_head
    assert all(v.dtype == torch.bfloat16 and v.isfinite().all() for v in shipped.values())
    report = json.loads((SHIPPED / "training.json").read_text())
    assert report["parameters"] == sum(v.numel() for v in shipped.values())
