"""Target LM heads of quantized checkpoints: a head the checkpoint leaves unquantized is accepted
whatever quant method SGLang wraps it in (judged by what it holds), on real SGLang
ParallelLMHeads built with each quantization config and a real gloo TP=2 group, and served by real
TP=1 and TP=2 servers."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import vocab_shard_ranges
from sglang_frspec.testing.fixtures import quant_config_fixture
from sglang_frspec.testing.server import plugin_activity
from sglang_frspec.testing.tp_group import run_tp_group
from tests.conftest import fixture_server
from tests.test_servers_plugin import num_hot

VOCAB, HIDDEN, ROWS = 5003, 64, 5
NEW, STEPS = 24, 2  # new tokens per request; EAGLE steps (eagle_args' default)
LLAMA_LINEAR = ["model.layers.*"]  # ModelOpt exclude patterns for every decoder linear

# (name, SGLang quantization method, the checkpoint's config, the quant method SGLang 0.5.23 gives
# the ParallelLMHead on CPU, read from its get_quant_method).
EXCLUDED_HEAD_CASES = [
    # hf_quant_config.json of a ModelOpt FP8 checkpoint (as NVIDIA publishes them): lm_head excluded.
    ("modelopt_fp8", "modelopt_fp8",
     {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}, "UnquantizedLinearMethod"),
    ("modelopt_nvfp4", "modelopt_fp4",
     {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}},
     "UnquantizedLinearMethod"),
    # config.json quantization_config: AWQ with the head in modules_to_not_convert.
    ("awq", "awq",
     {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
      "modules_to_not_convert": ["lm_head"]}, "UnquantizedEmbeddingMethod"),
    # GPTQ with a quantized-head flag and a dynamic rule that skips lm_head ("-:" = not quantized).
    ("gptq_dynamic_skip", "gptq_marlin",
     {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
      "lm_head": True, "dynamic": {"-:lm_head": {}}}, "UnquantizedEmbeddingMethod"),
    ("gptq", "gptq",
     {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "lm_head": False},
     "UnquantizedEmbeddingMethod"),
    # compressed-tensors (llm-compressor) FP8 with lm_head in ignore.
    ("compressed_tensors", "compressed-tensors",
     {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                "symmetric": True, "dynamic": False}}}},
     "UnquantizedEmbeddingMethod"),
]  # fmt: skip


@pytest.mark.multirank
def test_heads_left_unquantized_by_each_quant_config_give_exact_hot_logits_at_tp2():
    """Each config's head is accepted and its draft logits on a gloo TP=2 group equal the
    single-rank reference ``h @ W[hot].T``, bit-identical on both ranks, in both layouts."""
    gen = torch.Generator().manual_seed(5)
    split = vocab_shard_ranges(VOCAB, 2)[1][0]
    hot_map = [0, split - 1, split, VOCAB - 1, *torch.randperm(VOCAB, generator=gen)[:300].tolist()]
    cases = [(name, method, config) for name, method, config, _ in EXCLUDED_HEAD_CASES]
    payload = {
        "vocab": VOCAB,
        "hidden": HIDDEN,
        "dtype": "bfloat16",
        "rows": ROWS,
        "map": hot_map,
        "cases": cases,
    }
    results = run_tp_group("tests.rank_cases_quantized:excluded_head_logits", 2, payload)
    for name, _, _, method in EXCLUDED_HEAD_CASES:
        cases = [r[name] for r in results]
        assert [c["method"] for c in cases] == [method] * 2, name
        assert [c.get("error") for c in cases] == [None, None], name
        reference = cases[0]["reference"]
        for layout in ("local", "balanced"):
            assert torch.equal(cases[0][layout], cases[1][layout]), (name, layout)
            # bf16 head and hidden states: the GEMM rounds its output to bf16, the reference does not.
            torch.testing.assert_close(
                cases[0][layout], reference, rtol=1e-2, atol=8e-3 * reference.abs().max().item()
            )


# Served configurations: (quantization config of QUANT_CONFIGS_ALL_EXCLUDED, TP size, a line SGLang
# logs only when it read that config). GPTQ is not among them: SGLang 0.5.23's CPU path quantizes
# every GPTQ linear (CPUGPTQConfig ignores the dynamic skips) and needs an AMX kernel to load it.
SERVED = [
    ("modelopt_fp8", 2, "Detected ModelOpt FP8 checkpoint"),
    ("modelopt_fp8", 1, "Detected ModelOpt FP8 checkpoint"),
    ("awq", 2, "awq quantization is not fully optimized yet"),
]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{name}-tp{tp}" for name, tp, _ in SERVED])
def quantized_checkpoint_server(request, perm, tmp_path_factory):
    """One EAGLE + token map server (this plugin) per served configuration, for the module."""
    name, tp, config_read_line = request.param
    fixture = quant_config_fixture(perm, name)
    log = tmp_path_factory.mktemp(f"{name}-tp{tp}") / "server.log"
    with fixture_server(fixture, tp, log, fixture.token_map("hot")) as server:
        yield fixture, tp, config_read_line, server


@pytest.mark.server
def test_checkpoint_with_unquantized_head_serves_greedy_with_full_acceptance(quantized_checkpoint_server):
    """Outputs are the pi chain (plain greedy decoding of this fixture) and every draft is accepted:
    accept length steps + 1, as on the unquantized fixture (tests/test_servers_plugin.py)."""
    fixture, tp, config_read_line, server = quantized_checkpoint_server
    assert config_read_line in server.log()  # SGLang read the checkpoint's quantization config
    starts = (0, 17, 33)
    outs = server.generate([list(fixture.chain[s : s + 3]) for s in starts], NEW)
    assert [o["output_ids"] for o in outs] == [list(fixture.chain[s + 3 : s + 3 + NEW]) for s in starts]
    assert [o["meta_info"]["spec_accept_length"] for o in outs] == [STEPS + 1.0] * len(starts)
    assert plugin_activity(server.log()) == [(num_hot(fixture.token_map("hot")), tp, "balanced", "full")]
