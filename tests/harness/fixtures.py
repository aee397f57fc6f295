"""Test-only fixtures: a random-weights model and copies of the permutation fixture under
quantization configs (the permutation fixture itself ships with the demo)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import (
    ModelFixture,
    PermFixture,
    cache_root,
    cached_build,
    decoder_layer,
    linked_variant,
    llama_config,
    save_model,
    save_word_tokenizer,
    source_digest,
)

BUILDER_DIGEST = source_digest(__name__, "sglang_frspec.demo.fixtures")


def _build_random(root: Path, vocab: int, hidden: int, num_hot: int, seed: int) -> None:
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    inter, heads = 2 * hidden, max(1, hidden // 32)
    target_cfg = llama_config("LlamaForCausalLM", vocab, hidden, 2, inter, heads)
    target = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen) * 0.05,
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen) * 0.05,
    }
    for i in range(2):
        target |= decoder_layer(f"model.layers.{i}.", target_cfg, gen, input_ln=True, output_scale=0.05)
    save_model(root / "target", target, target_cfg)
    save_word_tokenizer(root / "target", vocab)
    draft_cfg = llama_config("LlamaForCausalLMEagle", vocab, hidden, 1, inter, heads)
    draft = {
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen) * 0.05,
        "fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.05,
        "fc.bias": torch.zeros(hidden),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen) * 0.05,
    }
    draft |= decoder_layer("layers.0.", draft_cfg, gen, input_ln=False, output_scale=0.05)
    save_model(root / "draft", draft, draft_cfg)
    # Hot ids over the whole vocab, listed in a random ("frequency") order.
    torch.save(torch.randperm(vocab, generator=gen)[:num_hot].clone(), root / "map_hot.pt")


def random_fixture(
    vocab_size: int = 32000, hidden_size: int = 128, num_hot: int = 2048, seed: int = 0
) -> ModelFixture:
    """A tiny Llama target and EAGLE draft with random weights, a tokenizer and a random map
    (``token_map("hot")``); outputs are whatever greedy decoding of random weights gives."""
    root = cached_build(
        cache_root() / f"random-{BUILDER_DIGEST}-v{vocab_size}-h{hidden_size}-n{num_hot}-s{seed}",
        lambda path: _build_random(path, vocab_size, hidden_size, num_hot, seed),
        marker="map_hot.pt",
    )
    return ModelFixture(root)


# Quantization configs under which SGLang leaves the whole model, LM head included, unquantized
# (so its CPU path loads the float weights), each in the file and shape its format uses: the
# file's top-level keys are merged into the target's copy of that file.
QUANT_CONFIGS_ALL_EXCLUDED = {
    # ModelOpt (NVIDIA's FP8/NVFP4 checkpoints): hf_quant_config.json, lm_head in exclude_modules.
    "modelopt_fp8": (
        "hf_quant_config.json",
        {
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {
                "quant_algo": "FP8",
                "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head", "model.layers.*"],
            },
        },
    ),
    # AutoAWQ: config.json quantization_config, lm_head in modules_to_not_convert.
    "awq": (
        "config.json",
        {
            "quantization_config": {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 128,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": ["lm_head", "model.layers"],
            }
        },
    ),
    # GPTQModel: config.json quantization_config, dynamic "-:" rules skip every module.
    "gptq": (
        "config.json",
        {
            "quantization_config": {
                "quant_method": "gptq",
                "bits": 4,
                "group_size": 128,
                "desc_act": False,
                "sym": True,
                "lm_head": False,
                "dynamic": {"-:.*": {}},
            }
        },
    ),
}


def quant_config_fixture(fixture: PermFixture, name: str) -> PermFixture:
    """``fixture`` with its target's folder copied and the quantization config ``name`` of
    QUANT_CONFIGS_ALL_EXCLUDED added (weights, draft and maps unchanged)."""
    file_name, config = QUANT_CONFIGS_ALL_EXCLUDED[name]

    def add_config(root: Path) -> None:
        path = root / "target" / file_name
        merged = (json.loads(path.read_text()) if path.exists() else {}) | config
        path.unlink(missing_ok=True)  # a new file, never a write through the link into the original
        path.write_text(json.dumps(merged, indent=1))

    root = linked_variant(fixture.root, name, add_config, marker="chains.json")
    return PermFixture(root, fixture.vocab_size, fixture.hidden_size, fixture.chain, fixture.low_chain)


def sharp_draft_fixture(fixture: PermFixture) -> PermFixture:
    """``fixture`` with its draft's ``fc`` scaled by sqrt(hidden): the draft's hidden state is then
    the target's final one (RMSNorm of a unit embedding), so the draft's logits equal the target's
    and a map's draft law is the target's law renormalised over the map (sampling tests need a draft
    near the target; the plain fixture's draft logits are cosines, near uniform at temperature 1).
    Greedy drafts are unchanged. Target, tokenizer and maps are hard links to ``fixture``'s."""
    from safetensors.torch import load_file, save_file

    def sharpen(root: Path) -> None:
        path = root / "draft" / "model.safetensors"
        tensors = load_file(str(path))
        tensors["fc.weight"] = tensors["fc.weight"] * fixture.hidden_size**0.5
        path.unlink()  # a new file, never a write through the link into the original
        save_file(tensors, str(path), metadata={"format": "pt"})

    root = linked_variant(fixture.root, f"sharp-{BUILDER_DIGEST}", sharpen, marker="chains.json")
    return PermFixture(root, fixture.vocab_size, fixture.hidden_size, fixture.chain, fixture.low_chain)
