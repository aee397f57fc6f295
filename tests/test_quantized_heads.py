"""Target LM heads of quantized checkpoints, on real SGLang ParallelLMHeads built with each
quantization config (gloo TP groups for the multi-rank cases) and real TP=1/TP=2 servers: a head
the checkpoint leaves unquantized is accepted whatever quant method SGLang wraps it in (judged by
what it holds); a quantized ModelOpt FP8 head has its hot rows dequantized; every other quantized
head, and a draft head SGLang would run a quant method over, is refused naming its format."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import vocab_shard_ranges
from sglang_frspec.demo.server import plugin_activity
from tests import rank_cases_quantized
from tests.conftest import fixture_server
from tests.harness.fixtures import quant_config_fixture
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_quantized import fp8_checkpoint, modelopt_fp8_head, quant_config
from tests.test_adapters_head import single_rank  # noqa: F401 (the fixture, used by name)
from tests.test_servers_plugin import num_hot

VOCAB, HIDDEN, ROWS = 5003, 64, 5
NEW, STEPS = 24, 2  # new tokens per request; EAGLE steps (eagle_args' default)

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
    results = run_tp_group(rank_cases_quantized.excluded_head_logits, 2, payload)
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


@pytest.mark.multirank
@pytest.mark.parametrize(("tp", "per_row"), [(1, False), (2, False), (2, True)])
def test_modelopt_fp8_head_hot_rows_are_dequantized(tp, per_row):
    """A quantized ModelOpt FP8 head (real method, loaded by SGLang's weight_loader from values
    quantized in the test): at TP=1 (where the plugin builds the head too) and on a gloo TP=2
    group each rank's hot head is the independent
    dequantization of its hot rows (bit-exact in float32, exact casts in bfloat16), the draft
    logits equal ``h @ dequant(W)[hot].T``, and a refresh after an in-place update re-reads them.
    ``per_row``: one scale per row as SGLang stores it where CUTLASS FP8 runs, every row's
    distinct, so a reader that takes another row's scale (a neighbour's, or the global row's
    on rank 1) fails."""
    gen = torch.Generator().manual_seed(6)
    split = vocab_shard_ranges(VOCAB, 2)[1][0]
    hot_map = [0, split - 1, split, VOCAB - 1, *torch.randperm(VOCAB, generator=gen)[:200].tolist()]
    payload = {"vocab": VOCAB, "hidden": HIDDEN, "rows": ROWS, "map": hot_map, "per_row": per_row}
    results = run_tp_group(rank_cases_quantized.fp8_head_cases, tp, payload)
    _, scale, dequantized = fp8_checkpoint(VOCAB, HIDDEN, seed=0, per_row=per_row)
    _, _, new_dequantized = fp8_checkpoint(VOCAB, HIDDEN, seed=2, per_row=per_row)
    assert scale.unique().numel() == (VOCAB if per_row else 1)
    hot = torch.tensor(sorted(set(hot_map)))
    hidden_states = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    reference = hidden_states @ dequantized[hot].T
    padded_rows = -(-VOCAB // 64) * 64 // tp  # each rank's shard: its part of the vocab padded to 64
    for r in results:
        assert r["method"] == "ModelOptFp8LinearMethod"
        # SGLang stores the weight transposed, float8, with one scale (no CUTLASS on CPU), or
        # (per_row) one per row of the shard.
        assert r["stored"] == ((HIDDEN, padded_rows), torch.float8_e4m3fn, padded_rows if per_row else 1)
        for layout in ("local", "balanced"):
            case = r[layout]
            offset, count = case["columns"]
            mine = hot[offset : offset + count]
            assert torch.equal(case["float32"][:count], dequantized[mine]), (r["rank"], layout)
            assert torch.equal(case["bfloat16"][:count], dequantized[mine].bfloat16()), (r["rank"], layout)
            assert not case["float32"][count:].any()  # padding slots stay zero
            refreshed, in_place = case["refreshed"]
            assert in_place and torch.equal(refreshed[:count], new_dequantized[mine]), (r["rank"], layout)
    assert sum(r["local"]["columns"][1] for r in results) == len(hot)
    for layout in ("local", "balanced"):
        logits = [r[layout]["logits"] for r in results]
        assert all(torch.equal(logits[0], other) for other in logits[1:]), layout
        torch.testing.assert_close(logits[0], reference, rtol=1e-5, atol=1e-5)


def _mixed_precision_head(quant_algo: str, group_size: int):
    """A real ParallelLMHead of a ModelOpt MIXED_PRECISION checkpoint whose lm_head is ``quant_algo``."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    layers = {"lm_head": {"quant_algo": quant_algo, "group_size": group_size}}
    config = quant_config(
        "modelopt_mixed", {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}
    )
    return ParallelLMHead(VOCAB, HIDDEN, quant_config=config, prefix="lm_head", params_dtype=torch.bfloat16)


def _refusal(head) -> str:
    from sglang_frspec.adapters.head import check_head_supported
    from sglang_frspec.core import UnsupportedSetupError

    with pytest.raises(UnsupportedSetupError) as info:
        check_head_supported(head)
    message = str(info.value)
    assert "sglang-frspec dequantizes the hot rows of ModelOpt FP8 per-tensor" in message
    assert "Serve a checkpoint whose lm_head is left unquantized" in message
    assert "drop --speculative-token-map" in message
    return message


@pytest.mark.usefixtures("single_rank")
def test_block_fp8_head_is_refused_as_sglang_cannot_load_it():
    """FP8 block 128x128: SGLang's own vocab-parallel loader rejects the block scales, and the
    plugin names the format if it ever meets such a head."""
    head = _mixed_precision_head("FP8_BLOCK_SCALES", 128)
    assert type(head.quant_method).__name__ == "Fp8LinearMethod"
    block_scales = torch.ones(-(-VOCAB // 128), -(-HIDDEN // 128))
    with pytest.raises(AssertionError, match="org_vocab_size"):
        head.weight_loader(head.weight_scale_inv, block_scales)
    message = _refusal(head)
    assert "quantized (Fp8LinearMethod) and holds weight_scale_inv besides plain rows" in message
    assert (
        "a block-scaled FP8 head (weight_scale_inv), which SGLang 0.5.23's vocab-parallel loader" in message
    )


@pytest.mark.parametrize(
    ("quant_algo", "group_size", "method", "held", "format_name"),
    [
        ("MXFP8", 32, "Fp8LinearMethod", "weight_scale_inv", "an MXFP8 head"),
        ("NVFP4", 16, "ModelOptFp4LinearMethod", "input_scale, weight_scale, weight_scale_2", "a NVFP4 head"),
        ("W4A16_NVFP4", 16, "ModelOptNvFp4A16LinearMethod", "input_scale, weight_scale, weight_scale_2",
         "a W4A16 NVFP4 head"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("single_rank")
def test_other_quantized_heads_are_refused_naming_their_format(
    quant_algo, group_size, method, held, format_name
):
    message = _refusal(_mixed_precision_head(quant_algo, group_size))
    assert f"the target LM head is quantized ({method}) and holds {held} besides plain rows" in message
    assert f"{format_name}, whose layout is not read back" in message


@pytest.mark.usefixtures("single_rank")
def test_modelopt_fp8_head_outside_sglangs_stored_layout_is_refused():
    """Before process_weights_after_loading the FP8 weight is not yet transposed: not read back."""
    head = _mixed_precision_head("FP8", 0)
    assert type(head.quant_method).__name__ == "ModelOptFp8LinearMethod"
    rows = head.num_embeddings_per_partition
    message = _refusal(head)
    assert f"a ModelOpt FP8 head whose weight is torch.float8_e4m3fn of shape ({rows}, {HIDDEN})" in message
    assert f"not float8_e4m3fn ({HIDDEN}, {rows}) as SGLang stores it after loading" in message


@pytest.mark.usefixtures("single_rank")
def test_modelopt_fp8_head_repacked_for_marlin_is_refused():
    quantized, scale, _ = fp8_checkpoint(VOCAB, HIDDEN, seed=0)
    head = modelopt_fp8_head(VOCAB, HIDDEN, quantized, scale)
    # What ModelOptFp8LinearMethod computes on a GPU without native FP8 (or SGLANG_FORCE_FP8_MARLIN=1).
    head.quant_method.use_marlin = True
    assert "a ModelOpt FP8 head repacked for Marlin" in _refusal(head)


@pytest.mark.usefixtures("single_rank")
def test_modelopt_fp8_head_with_one_scale_per_row_is_read_and_other_scale_counts_refused():
    """Where CUTLASS FP8 is supported, SGLang stores the per-tensor scale once per row
    (convert_to_channelwise, every row's equal); any other scale count is not read. Distinct
    per-row scales at TP=2: test_modelopt_fp8_head_hot_rows_are_dequantized[2-True]."""
    from sglang.srt.layers.quantization.utils import convert_to_channelwise

    from sglang_frspec.adapters.head import check_head_supported
    from sglang_frspec.adapters.quantized_head import read_quantized_rows

    quantized, scale, dequantized = fp8_checkpoint(VOCAB, HIDDEN, seed=0)
    head = modelopt_fp8_head(VOCAB, HIDDEN, quantized, scale)
    per_row = convert_to_channelwise(head.weight_scale, head.logical_widths)
    head.weight_scale = torch.nn.Parameter(per_row, requires_grad=False)
    check_head_supported(head)
    rows = torch.tensor([0, 5, VOCAB // 2, VOCAB - 1])
    assert torch.equal(read_quantized_rows(head, rows, torch.float32), dequantized[rows])
    head.weight_scale = torch.nn.Parameter(per_row[:3].clone(), requires_grad=False)
    assert "a ModelOpt FP8 head whose weight_scale has 3 values, neither one nor one per row" in _refusal(
        head
    )


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize(("num_hot", "warns"), [(100, False), (3000, True)])
def test_startup_log_compares_the_hot_head_with_the_quantized_shard(caplog, num_hot, warns):
    """Bytes a draft step reads: the bf16 hot head against the FP8 shard (weight + two scalar
    scales); a warning once the hot head is the larger."""
    import logging

    from sglang_frspec.adapters.head import build_hot_head, describe_head_shard
    from sglang_frspec.adapters.worker import log_quantized_head_bytes
    from sglang_frspec.core import plan_from_ranges

    quantized, scale, _ = fp8_checkpoint(VOCAB, HIDDEN, seed=0)
    shard = describe_head_shard(modelopt_fp8_head(VOCAB, HIDDEN, quantized, scale))
    plan = plan_from_ranges(torch.arange(num_hot), shard.shard_ranges, "balanced")
    hot_head = build_hot_head(shard, plan, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sglang_frspec.adapters.worker"):
        log_quantized_head_bytes(shard, hot_head)
    hot_mib, shard_mib = num_hot * HIDDEN * 2 / 2**20, (-(-VOCAB // 64) * 64 * HIDDEN + 2 * 4) / 2**20
    assert (
        "the target LM head is quantized (ModelOptFp8LinearMethod); its hot rows are dequantized into "
        f"torch.bfloat16: a draft step reads {hot_mib:.2f} MiB of hot head per rank instead of "
        f"{shard_mib:.2f} MiB of the quantized vocab shard"
    ) in caplog.text
    warning = (
        f"the dequantized hot head ({hot_mib:.2f} MiB per rank) is larger than the quantized vocab shard"
    )
    assert (warning in caplog.text) == warns


@pytest.mark.usefixtures("single_rank")
def test_draft_head_whose_quant_method_sglang_would_apply_to_the_hot_head_is_refused():
    """A draft loaded with the target's quantization keeps its head's method. SGLang's logits path
    skips a ModelOpt FP8 method over a bf16 weight, but would apply e.g. MXFP8's Fp8LinearMethod."""
    from sglang_frspec.adapters.head import check_draft_uses_hot_head
    from sglang_frspec.core import UnsupportedSetupError

    hot_head = torch.randn(40, HIDDEN).bfloat16()

    def draft_with(head) -> torch.nn.Module:
        draft = torch.nn.Module()
        draft.lm_head = head
        del head.weight  # as set_embed_and_head does before it assigns the shared head
        head.weight = hot_head
        return draft

    check_draft_uses_hot_head(draft_with(_mixed_precision_head("FP8", 0)), hot_head)
    with pytest.raises(UnsupportedSetupError) as info:
        check_draft_uses_hot_head(draft_with(_mixed_precision_head("MXFP8", 32)), hot_head)
    message = str(info.value)
    assert "computes its logits through a quantized LM head method (lm_head: Fp8LinearMethod)" in message
    assert "--speculative-draft-model-quantization unquant" in message
