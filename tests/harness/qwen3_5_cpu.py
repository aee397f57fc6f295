"""A tiny random-weight Qwen3.5 target served by SGLang on CPU, greedy (plain, or NEXTN with its
MTP layer, optionally with a token map and this plugin) against HF greedy (issue 35 item 2). CI
serves one setting of it (TP=2, NEXTN topk 2, map and plugin:
``tests/test_architectures.py::test_qwen3_5_mtp_at_tp2_with_a_map_decodes_as_hf_greedy``, 26 s
with the build on a quiet 2-core machine); this script runs any other by hand (about 35 s each).

    .venv/bin/python -m tests.harness.qwen3_5_cpu                     # plain greedy at TP=1 vs HF
    .venv/bin/python -m tests.harness.qwen3_5_cpu --nextn --topk 2      # NEXTN (its MTP layer) vs HF
    .venv/bin/python -m tests.harness.qwen3_5_cpu --tp 2 --map          # NEXTN + map + plugin at TP=2

The checkpoint is what SGLang serves for Qwen3.5 (``Qwen3_5ForConditionalGeneration``: SGLang
registers no text-only Qwen3.5 class, ``srt/models/qwen3_5.py:3021``), built by Transformers from
a tiny config: one gated-delta-net layer and one gated full-attention layer, key and value head
sizes differing and twice as many value as key heads in the linear layer, an odd vocabulary
(4093: the last TP=2 shard is padded, as on the released 248077-id model), a one-block vision
tower. Transformers drops ``mtp.*`` weights, so the MTP layer (a copy of the full-attention layer,
the released names) is appended as ``mtp.safetensors``. The config also carries
``full_attention_interval`` (SGLang's layer typing reads it, ``configs/qwen3_next.py:264``) and the
folder a Qwen3-VL processor (SGLang's tokenizer manager loads one for this architecture even with
``--skip-tokenizer-init``, ``managers/tokenizer_manager.py:616``).

Server settings: ``--dtype float32`` (the config's top-level dtype is not the text model's: SGLang
picked float16 without it), ``SGLANG_MAMBA_CONV_DTYPE=float32`` (SGLang keeps the conv state in
bfloat16 by default, ``configs/mamba_utils.py:67``: decode then left HF's greedy path, once at a
top-2 margin of 0.008 and once outside HF's top two), ``--disable-radix-cache`` (the radix
cache's default ``extra_buffer`` mode asserts a GPU-class platform,
``arg_groups/mamba_hook.py:120``; ``--radix-cache`` serves its ``no_buffer`` mode instead,
``NO_BUFFER_RADIX_ARGS``, and sends each prompt again extended by its first output, a prefix hit of
the whole first request), ``--max-mamba-cache-size 32`` (else 3 GB of ssm states).

``--family qwen3_next``: a tiny ``Qwen3NextForCausalLM`` (issue 35's last family) with the same
two layers and vocabulary, every MLP a sparse MoE block as in the released config (4 experts, top
2, a gated shared expert), text-only (no processor needed), its MTP layer (a copy of the
full-attention MoE layer) appended under the same ``mtp.*`` names that
``Qwen3NextForCausalLMMTP`` loads. Same server settings. CI:
``tests/test_architectures.py::test_qwen3_next_mtp_at_tp2_with_a_map_decodes_as_hf_greedy`` (13-17 s with the
build, 2 cores, another job running).
On CPU it needs three more CPU-test plugin patches (``frspec_cpu_amx.py``: fla's gated norm, the
shared-expert gate, ``get_device_module``).

    .venv/bin/python -m tests.harness.qwen3_5_cpu --family qwen3_next --tp 2 --map --topk 1

``--chain`` (Qwen3-Next): ``chain_target``, a permutation chain with an exact MTP draft, so accept
lengths mean something; ``--stock`` serves the map without the plugin (stock SGLang: TP=1 only).
Results: docs/results/qwen3-next-chain-cpu.txt.

    .venv/bin/python -m tests.harness.qwen3_5_cpu --family qwen3_next --chain --tp 1 --map --stock
    .venv/bin/python -m tests.harness.qwen3_5_cpu --family qwen3_next --chain --tp 2 --map

``modelopt_target``: the checkpoint as a ModelOpt export (``MODELOPT_CONFIGS``: an
``hf_quant_config.json`` beside the same weights), the seed report's shape of checkpoint, served in
bfloat16 (ModelOpt's configs refuse float32). There SGLang's greedy leaves HF's float32 greedy at
near-ties, so it is compared with SGLang's plain greedy instead: in CI
``tests/test_architectures.py::test_qwen3_5_modelopt_checkpoint_at_tp2_with_a_map_decodes_as_plain_greedy``,
by hand ``python -m tests.harness.sweep_architectures --only qwen3_5_mtp_modelopt_nvfp4
qwen3_next_mtp_modelopt_fp8``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_frspec.demo.cpu import CPU_SERVER_ARGS, cpu_env, eagle_args
from sglang_frspec.demo.fixtures import (
    cache_root,
    cached_build,
    linked_variant,
    save_word_tokenizer,
    source_digest,
)
from sglang_frspec.demo.server import SGLangServer, plugin_activity
from tools.serving.greedy import compare_greedy, reference_greedy

# the builders' sources (by module name: this file runs as __main__ too)
BUILDER_DIGEST = source_digest("tests.harness.qwen3_5_cpu", "sglang_frspec.demo.fixtures")
VOCAB = 4093
HIDDEN = 128
INIT_STD = 0.1
SEED = 0
NEW_TOKENS = 16
PROMPTS = [[5, 77, 1203], [4000, 17], [9, 9, 9, 9, 2500]]
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
}
VISION_CONFIG = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                 "out_hidden_size": HIDDEN, "num_position_embeddings": 64}  # fmt: skip
SERVER_ARGS = [
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    "--disable-radix-cache",
    "--max-mamba-cache-size",
    "32",
]
SERVER_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
# The radix cache in the hybrid mode a CPU can run (SGLang refuses overlap scheduling with it).
NO_BUFFER_RADIX_ARGS = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]


def server_args(radix_cache: bool = False) -> list[str]:
    """SERVER_ARGS, with the radix cache in its ``no_buffer`` mode instead of off if asked."""
    if not radix_cache:
        return list(SERVER_ARGS)
    return [arg for arg in SERVER_ARGS if arg != "--disable-radix-cache"] + NO_BUFFER_RADIX_ARGS


def prefix_hit_prompts(prompts: list[list[int]], outs: list[dict]) -> list[list[int]]:
    """Each prompt extended by its output and one more id: its whole first request is a prefix."""
    return [prompt + out["output_ids"] + [33] for prompt, out in zip(prompts, outs, strict=True)]


# Qwen3-Next: the same linear and full-attention layers, every layer's MLP a sparse MoE block (as
# in the released config, decoder_sparse_step 1) with a shared expert; tiny and text-only.
NEXT_CONFIG = {
    key: value
    for key, value in TEXT_CONFIG.items()
    if key not in ("rope_parameters", "mtp_num_hidden_layers", "intermediate_size")
} | {
    "intermediate_size": 2 * HIDDEN,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}
# hf_quant_config.json of a ModelOpt checkpoint of this family, shaped as NVIDIA publishes them for
# Qwen3.5 / Qwen3-Next (the seed report's shape): NVFP4 or FP8 experts and MLPs, everything else
# in exclude_modules, the LM head and the MTP layer included. SGLang's ModelOpt methods need CUDA
# kernels, so the CPU fixture also excludes the MLPs (the last pattern): every layer then loads
# unquantized, while SGLang still reads the config, builds each layer through its
# get_quant_method and serves the head through UnquantizedLinearMethod.
MODELOPT_EXCLUDED = [
    "lm_head",
    "mtp*",
    "model.visual*",
    "*linear_attn*",
    "*self_attn*",
    "*mlp.gate",
    "*shared_expert_gate",
    "*mlp*",  # CPU only: NVIDIA's checkpoints quantize these
]
MODELOPT_CONFIGS = {
    "nvfp4": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None},
    "fp8": {"quant_algo": "FP8", "kv_cache_quant_algo": None},
}


def _mtp_tensors(state: dict, gen: torch.Generator, last: str = "model.language_model.layers.1.") -> dict:
    """The MTP block under its released names (Qwen3.5 and Qwen3-Next alike): ``mtp.layers.0.`` (a
    copy of the target's full-attention layer ``last``), ``mtp.fc`` over [embedding | hidden], its
    two input norms and a norm."""
    tensors = {"mtp.layers.0." + k[len(last) :]: v.clone() for k, v in state.items() if k.startswith(last)}
    return tensors | {
        "mtp.fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * INIT_STD,
        # Qwen3.5's RMSNorm scales by (1 + weight): zeros are the identity scale.
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(HIDDEN),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(HIDDEN),
        "mtp.norm.weight": torch.zeros(HIDDEN),
    }


def _save_random_weights(model: torch.nn.Module, target: Path) -> dict:
    """Give the model's matrices random weights (norms keep their init), save it; its saved config."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD)
    model.save_pretrained(str(target), safe_serialization=True)
    return json.loads((target / "config.json").read_text())


def _save_hot_map(folder: Path) -> None:
    """512 hot ids over the whole vocabulary (both TP=2 halves), in a random ("frequency") order."""
    torch.save(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(SEED + 2))[:512].clone(),
               folder / "map_hot.pt")  # fmt: skip


def _build(root: Path) -> None:
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    target = root / "target"
    torch.manual_seed(SEED)
    config = Qwen3_5Config(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIG,
        tie_word_embeddings=False,
        # Media ids inside the vocabulary (text-only prompts never use them).
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
    )
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    saved = _save_random_weights(model, target)
    saved["text_config"]["full_attention_interval"] = 2
    (target / "config.json").write_text(json.dumps(saved, indent=1))
    save_file(
        _mtp_tensors(model.state_dict(), torch.Generator().manual_seed(SEED + 1)),
        str(target / "mtp.safetensors"),
    )
    save_word_tokenizer(target, VOCAB)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=AutoTokenizer.from_pretrained(target),
        video_processor=Qwen3VLVideoProcessor(),
    )
    processor.save_pretrained(str(target))
    _save_hot_map(target.parent)
    (root / "done").write_text("")


def _build_next(root: Path) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    target = root / "target"
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT_CONFIG)).float().eval()
    saved = _save_random_weights(model, target)
    saved["full_attention_interval"] = 2  # SGLang's layer typing reads it (configs/qwen3_next.py:264)
    (target / "config.json").write_text(json.dumps(saved, indent=1))
    from safetensors.torch import load_file

    # The saved state, not model.state_dict(): Transformers writes experts under the released
    # per-expert names SGLang loads.
    state = {}
    for shard in target.glob("model*.safetensors"):
        state |= load_file(str(shard))
    save_file(_mtp_tensors(state, torch.Generator().manual_seed(SEED + 1), "model.layers.1."),
              str(target / "mtp.safetensors"))  # fmt: skip
    save_word_tokenizer(target, VOCAB)
    _save_hot_map(target.parent)
    (root / "done").write_text("")


def qwen3_next_target() -> str:
    """Build (once, cached) the tiny Qwen3-Next checkpoint; its path."""
    root = cache_root() / f"qwen3_next-{BUILDER_DIGEST}"
    return str(cached_build(root, _build_next, marker="done") / "target")


def chain_target(target: str) -> str:
    """``target`` (Qwen3-Next) made to decode a permutation chain, in a fixture folder of its own:
    every mixer's and MLP's output projection zeroed (the layers still run, and add nothing), unit
    embeddings, ``lm_head[pi(x)] = embed[x]``, so greedy decoding goes x -> pi(x) with a wide
    margin; the MTP layer's ``fc`` passes the next token's embedding on, so its draft is exact and
    accept lengths reach steps + 1 without a map. Its map holds a random half of the vocabulary:
    a cold next token cannot be drafted, so acceptance is partial and comparable across servers."""
    from safetensors.torch import load_file

    def rewire(root: Path) -> None:
        gen = torch.Generator().manual_seed(SEED + 3)
        state = load_file(str(root / "target" / "model.safetensors"))
        mtp = load_file(str(root / "target" / "mtp.safetensors"))
        zeroed = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
        for tensors in (state, mtp):
            for name in tensors:
                if name.endswith(zeroed):
                    tensors[name] = torch.zeros_like(tensors[name])
        embed = torch.nn.functional.normalize(torch.randn(VOCAB, HIDDEN, generator=gen), dim=-1)
        pi = torch.randperm(VOCAB, generator=gen)
        head = torch.empty_like(embed)
        head[pi] = embed
        state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, head
        mtp["mtp.fc.weight"] = torch.cat((torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)), dim=1)
        hot = torch.randperm(VOCAB, generator=gen)[: VOCAB // 2].clone()
        for name in ("target/model.safetensors", "target/mtp.safetensors", "map_hot.pt"):
            (root / name).unlink()  # new files, never a write through the links into the original
        save_file(state, str(root / "target" / "model.safetensors"))
        save_file(mtp, str(root / "target" / "mtp.safetensors"))
        torch.save(hot, root / "map_hot.pt")

    return str(linked_variant(Path(target).parent, "chain", rewire, marker="map_hot.pt") / "target")


def qwen3_5_target() -> str:
    """Build (once, cached) the tiny Qwen3.5 checkpoint; its path."""
    root = cache_root() / f"qwen3_5-{BUILDER_DIGEST}"
    return str(cached_build(root, _build, marker="done") / "target")


def modelopt_target(target: str, algo: str) -> str:
    """``target`` as a ModelOpt ``algo`` checkpoint (MODELOPT_CONFIGS), in a fixture folder of its
    own beside the original (weights and map hard-linked; cached); its target folder."""

    def add_config(root: Path) -> None:
        quantization = MODELOPT_CONFIGS[algo] | {"exclude_modules": MODELOPT_EXCLUDED}
        config = {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": quantization}
        (root / "target" / "hf_quant_config.json").write_text(json.dumps(config, indent=1))

    return str(
        linked_variant(Path(target).parent, f"modelopt-{algo}", add_config, marker="map_hot.pt") / "target"
    )


def nextn_args(target: str, topk: int, with_map: bool) -> list[str]:
    """NEXTN with the checkpoint's MTP layer (the draft path is the target's), optionally a map."""
    token_map = str(Path(target).parent / "map_hot.pt") if with_map else None
    return eagle_args(target, token_map, algorithm="NEXTN", topk=topk, draft_tokens=4 if topk > 1 else 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen3_5", "qwen3_next"), default="qwen3_5")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--nextn", action="store_true", help="NEXTN with the checkpoint's MTP layer")
    parser.add_argument("--topk", type=int, default=2, help="NEXTN tree width (1: a chain)")
    parser.add_argument("--map", action="store_true", help="NEXTN + token map + plugin")
    parser.add_argument("--chain", action="store_true",
                        help="Qwen3-Next decoding a permutation chain (chain_target)")  # fmt: skip
    parser.add_argument("--stock", action="store_true",
                        help="with --map: stock SGLang (it serves a map at TP=1 only)")  # fmt: skip
    parser.add_argument("--radix-cache", action="store_true",
                        help="the radix cache in no_buffer mode, and a second round hitting it")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path("."), help="where the server log goes")
    parser.add_argument("extra", nargs="*", help="more server arguments (after --)")
    args = parser.parse_args(argv)
    if args.chain and args.family != "qwen3_next":
        parser.error("--chain is built from --family qwen3_next")
    target = qwen3_5_target() if args.family == "qwen3_5" else qwen3_next_target()
    if args.chain:
        target = chain_target(target)
    launch = [
        "--model-path",
        target,
        "--tp-size",
        str(args.tp),
        *CPU_SERVER_ARGS,
        *server_args(args.radix_cache),
    ]
    if args.nextn or args.map:
        launch += nextn_args(target, args.topk, args.map)
    speculative = f"-nextn-topk{args.topk}{'-map' if args.map else ''}" if args.nextn or args.map else ""
    log = args.log_dir / f"{args.family}{'-chain' if args.chain else ''}-tp{args.tp}{speculative}.log"
    env = cpu_env(args.tp, with_plugin=args.map and not args.stock) | SERVER_ENV
    server = SGLangServer([*launch, *args.extra], env, log)
    rounds = []
    with server:
        rounds.append((PROMPTS, server.generate(PROMPTS, NEW_TOKENS)))
        if args.radix_cache:
            prompts = prefix_hit_prompts(PROMPTS, rounds[0][1])
            rounds.append((prompts, server.generate(prompts, NEW_TOKENS)))
        plugin = plugin_activity(server.log())
    for prompts, outs in rounds:
        expected = [reference_greedy(target, prompt, NEW_TOKENS) for prompt in prompts]
        ties = compare_greedy(target, prompts, [o["output_ids"] for o in outs], expected)
        meta = [o["meta_info"] for o in outs]
        cached = [m.get("cached_tokens") for m in meta]
        print(f"SGLang greedy equals HF greedy: {len(prompts)} x {NEW_TOKENS} tokens, "
              f"{len(ties)} near-tie(s); cached prompt tokens {cached}")  # fmt: skip
        if args.nextn or args.map:
            print("verify steps", [m.get("spec_verify_ct") for m in meta], "accept lengths",
                  [m.get("spec_accept_length") for m in meta])  # fmt: skip
    if args.map and not args.stock:
        assert plugin and plugin[0][1] == args.tp, f"the plugin's start-up line is missing: {plugin}"
        print("plugin:", plugin[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
