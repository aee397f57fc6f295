"""Tiny random-weight targets of SGLang's EAGLE/NEXTN-servable architectures, each with a draft.

Every target is a Hugging Face model built from a tiny config (``from_config``, random weights,
saved as float32 safetensors with a whitespace tokenizer), so its checkpoint uses exactly the
tensor names that architecture's loader expects and an independent HF forward can judge ties. The
draft is a Llama EAGLE draft (the architecture-independent one), SGLang's own EAGLE class for the
family where it ships one (Qwen2), or an MTP/NextN layer stored in the target's own checkpoint and
served with the target's path as the draft path (MiMo, DeepSeek-V3), as those models ship. No
model hub is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_frspec.demo.fixtures import (
    ModelFixture,
    cache_root,
    cached_build,
    save_model,
    save_word_tokenizer,
    source_digest,
)

VOCAB = 4096
HIDDEN = 128
NUM_HOT = 512
SEED = 0
# Large enough that the target's logits spread over O(1) (top-2 near-ties stay rare), small
# enough that the layers' outputs do not saturate.
INIT_STD = 0.1
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": INIT_STD,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": HIDDEN, "norm_topk_prob": True}


@dataclass(frozen=True)
class Architecture:
    """One target family: its HF config, how its head is held, and the draft it is served with."""

    name: str
    config_class: str  # transformers config class
    config: dict
    head: str  # how SGLang holds the target's LM head (for the sweep's table)
    draft: str = "llama_eagle"  # llama_eagle | qwen2_eagle | deepseek_mtp | mimo_mtp
    algorithm: str = "EAGLE"
    extra_args: tuple[str, ...] = field(default_factory=tuple)  # for every server of it


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", "LlamaConfig", {"architectures": ["LlamaForCausalLM"]}, "own ParallelLMHead"),
        Architecture(
            "llama_tied",
            "LlamaConfig",
            {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True},
            "tied: embed_tokens (VocabParallelEmbedding)",
        ),
        Architecture(
            "llama_softcap",
            "LlamaConfig",
            # SGLang's LogitsProcessor caps any model whose config sets it (Gemma-2 style), and
            # a cap near the logits' own size bends them; greedy choices are unchanged.
            {"architectures": ["LlamaForCausalLM"], "final_logit_softcapping": 3.0},
            "own ParallelLMHead; target and draft logits softcapped",
        ),
        Architecture(
            "mistral",
            "MistralConfig",
            {"architectures": ["MistralForCausalLM"]},
            "own ParallelLMHead (Llama)",
        ),
        Architecture(
            "qwen2",
            "Qwen2Config",
            {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False},
            "own ParallelLMHead",
            draft="qwen2_eagle",
        ),
        Architecture(
            "qwen3_tied",
            "Qwen3Config",
            {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True},
            "tied: embed_tokens (VocabParallelEmbedding)",
        ),
        Architecture(
            "qwen3_moe",
            "Qwen3MoeConfig",
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                **_MOE,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            },
            "own ParallelLMHead",
        ),
        Architecture(
            "gemma3_softcap",
            "Gemma3TextConfig",
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "final_logit_softcapping": 30.0,
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 32,
            },
            "tied: embed_tokens (replicated nn.Embedding, a row slice per rank); logits softcapped",
            # SGLang's dtype "auto" runs a float32 Gemma checkpoint in bfloat16 but the float32 Llama
            # draft in float16, and the draft then multiplies bf16 inputs by fp16 weights: one dtype.
            extra_args=("--dtype", "float32"),
        ),
        Architecture(
            "phi3",
            "Phi3Config",
            {"architectures": ["Phi3ForCausalLM"], "num_key_value_heads": 4},
            "own ParallelLMHead (Llama)",
        ),
        Architecture(
            "glm4",
            "Glm4Config",
            {"architectures": ["Glm4ForCausalLM"], "partial_rotary_factor": 0.5},
            "own ParallelLMHead",
        ),
        Architecture(
            "glm4_moe",
            "Glm4MoeConfig",
            {
                "architectures": ["Glm4MoeForCausalLM"],
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": HIDDEN,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "partial_rotary_factor": 0.5,
            },
            "own ParallelLMHead",
        ),
        Architecture(
            "mimo_mtp",
            "Qwen2Config",  # MiMo's config is Qwen2's plus num_nextn_predict_layers
            {
                "architectures": ["MiMoForCausalLM"],
                "tie_word_embeddings": False,
                "num_nextn_predict_layers": 1,
            },
            "own ParallelLMHead; the MTP draft's lm_head takes the target's",
            draft="mimo_mtp",
            algorithm="NEXTN",
        ),
        Architecture(
            "deepseek_v3_nextn",
            "DeepseekV3Config",
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": HIDDEN,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "q_lora_rank": 64,
                "kv_lora_rank": 64,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "head_dim": 16,  # HF's rotary size is head_dim: DeepSeek-V3's config sets qk_rope_head_dim
                "num_key_value_heads": 4,
                # DeepSeek-V3's own YaRN (SGLang's CPU rotary embedding for MLA is deepseek_yarn only).
                "max_position_embeddings": 163840,
                "rope_scaling": {
                    "type": "yarn",
                    "rope_type": "yarn",
                    "factor": 40.0,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                "num_nextn_predict_layers": 1,
                # DeepSeek-V3's router settings, read by SGLang's loader from config.json.
                "moe_layer_freq": 1,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "routed_scaling_factor": 2.5,
                "norm_topk_prob": True,
            },
            "own ParallelLMHead; the NextN draft's shared_head.head takes the target's",
            draft="deepseek_mtp",
            algorithm="NEXTN",
        ),
    )
}

BUILDER_DIGEST = source_digest(__name__, "sglang_frspec.demo.fixtures")


def _target_config(arch: Architecture):
    import transformers

    values = _COMMON | arch.config
    return getattr(transformers, arch.config_class)(**values)


def _build_target(arch: Architecture, path: Path) -> torch.nn.Module:
    """The HF model of ``arch`` with random weights, saved (float32) where SGLang loads it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    config = _target_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:  # matrices only: norms keep HF's init; some families init zeros
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(str(path), safe_serialization=True)
    config_path = path / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = arch.config["architectures"]
    config_path.write_text(json.dumps(saved, indent=1))
    save_word_tokenizer(path, VOCAB)
    return model


def _eagle_config(architecture: str, softcap: float | None) -> dict:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
            "pad_token_id", "torch_dtype")  # fmt: skip
    return (
        {k: _COMMON[k] for k in keys}
        | {
            "architectures": [architecture],
            "model_type": "llama" if "Llama" in architecture else "qwen2",
            "num_hidden_layers": 1,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        | ({"final_logit_softcapping": softcap} if softcap else {})
    )


def _build_eagle_draft(architecture: str, path: Path, gen: torch.Generator, softcap: float | None) -> None:
    """A one-layer EAGLE draft (Llama or Qwen2 layout) with random weights; its embeddings and
    head are replaced by the target's at start-up. ``softcap``: the draft's logits processor
    caps its logits as the target's does (SGLang reads it from each model's own config)."""
    cfg = _eagle_config(architecture, softcap)
    hidden, inter, head_dim = HIDDEN, cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    tensors = {
        "embed_tokens.weight": rand(VOCAB, hidden),
        "lm_head.weight": rand(VOCAB, hidden),
        "fc.weight": rand(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": rand(q, hidden),
        "layers.0.self_attn.k_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.v_proj.weight": rand(kv, hidden),
        "layers.0.self_attn.o_proj.weight": rand(hidden, q),
        "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
        "layers.0.mlp.up_proj.weight": rand(inter, hidden),
        "layers.0.mlp.down_proj.weight": rand(hidden, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    if architecture.startswith("Qwen2"):  # Qwen2's attention has q/k/v biases
        tensors |= {
            f"layers.0.self_attn.{p}_proj.bias": torch.zeros(n) for p, n in (("q", q), ("k", kv), ("v", kv))
        }
    else:
        tensors["fc.bias"] = torch.zeros(hidden)
    save_model(path, tensors, cfg)


def _deepseek_mtp_tensors(target: torch.nn.Module, config: dict, gen: torch.Generator) -> dict:
    """DeepSeek-V3's NextN layer as its checkpoints carry it: layer ``num_hidden_layers`` (here a
    copy of the target's last, MoE, layer) with enorm, hnorm, eh_proj and a shared head."""
    layer, hidden = config["num_hidden_layers"], config["hidden_size"]
    last, prefix = f"model.layers.{layer - 1}.", f"model.layers.{layer}."
    state = target.state_dict()
    tensors = {prefix + name[len(last) :]: value for name, value in state.items() if name.startswith(last)}
    return tensors | {
        prefix + "embed_tokens.weight": state["model.embed_tokens.weight"],
        prefix + "enorm.weight": torch.ones(hidden),
        prefix + "hnorm.weight": torch.ones(hidden),
        prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * INIT_STD,
        prefix + "shared_head.norm.weight": torch.ones(hidden),
        prefix + "shared_head.head.weight": torch.randn(VOCAB, hidden, generator=gen) * INIT_STD,
    }


def _mimo_mtp_tensors(target: torch.nn.Module, config: dict, gen: torch.Generator) -> dict:
    """MiMo's MTP layer as its checkpoints carry it: ``model.mtp_layers.0.`` (a copy of the
    target's last Qwen2 layer) with token/hidden norms, input_proj and a final norm."""
    hidden = config["hidden_size"]
    last, prefix = f"model.layers.{config['num_hidden_layers'] - 1}.", "model.mtp_layers.0."
    state = target.state_dict()
    tensors = {prefix + name[len(last) :]: value for name, value in state.items() if name.startswith(last)}
    return tensors | {
        prefix + "token_layernorm.weight": torch.ones(hidden),
        prefix + "hidden_layernorm.weight": torch.ones(hidden),
        prefix + "input_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * INIT_STD,
        prefix + "final_layernorm.weight": torch.ones(hidden),
    }


_MTP_TENSORS = {"deepseek_mtp": _deepseek_mtp_tensors, "mimo_mtp": _mimo_mtp_tensors}


def _build(arch: Architecture, root: Path) -> None:
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED + 1)
    target = _build_target(arch, root / "target")
    if arch.draft in _MTP_TENSORS:
        # The MTP layer ships inside the target's checkpoint (a second file, which HF's loader of
        # the target does not read) and the draft path is the target's, as users serve these.
        config = json.loads((root / "target" / "config.json").read_text())
        save_file(_MTP_TENSORS[arch.draft](target, config, gen), str(root / "target" / "mtp.safetensors"))
        (root / "draft").symlink_to("target")
    else:
        eagle = "Qwen2ForCausalLMEagle" if arch.draft == "qwen2_eagle" else "LlamaForCausalLMEagle"
        _build_eagle_draft(eagle, root / "draft", gen, arch.config.get("final_logit_softcapping"))
    # Hot ids over the whole vocab (both TP=2 halves), in a random ("frequency") order.
    torch.save(torch.randperm(VOCAB, generator=gen)[:NUM_HOT].clone(), root / "map_hot.pt")


def architecture_fixture(name: str) -> ModelFixture:
    """Build (once, cached) the target, draft and token map (``token_map("hot")``) of ``name``."""
    arch = ARCHITECTURES[name]
    root = cache_root() / f"arch-{name}-{BUILDER_DIGEST}"
    build: Callable[[Path], None] = lambda path: _build(arch, path)  # noqa: E731
    return ModelFixture(cached_build(root, build, marker="map_hot.pt"))
