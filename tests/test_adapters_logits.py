"""The draft logits processor on a real gloo TP group: equal to SGLang's own LogitsProcessor over
the full head (its hot columns) in every config branch, and filling SGLang's draft-extend logits
buffer (sized from len(hot_token_id)) with the values of the single-rank reference."""

from __future__ import annotations

import pytest
import torch

from tests import rank_cases_adapters
from tests.harness.tp_group import run_tp_group
from tests.rank_cases_adapters import hidden_rows, skewed_ids

pytestmark = pytest.mark.multirank

VOCAB, HIDDEN, MAX_BS, TREE_WIDTH, TOPK = 3001, 32, 5, 3, 3
BATCH_SIZES = [MAX_BS, 2, 1]


def _map() -> list[int]:
    """Unsorted, repeated ids on every shard of TP 2 and 3, both ends of the vocab included."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randperm(VOCAB, generator=gen)[:203].tolist()
    return [VOCAB - 1, *ids, 0, ids[5], VOCAB - 1]


@pytest.mark.parametrize(("tp", "dtype"), [(2, "float32"), (3, "bfloat16")])
def test_draft_extend_logits_land_in_the_hot_width_buffer(tp, dtype):
    ids = _map()
    results = run_tp_group(
        rank_cases_adapters.draft_extend_buffer_logits,
        tp,
        {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "max_bs": MAX_BS,
            "tree_width": TREE_WIDTH,
            "topk": TOPK,
            "map": ids,
            "batch_sizes": BATCH_SIZES,
            "dtype": dtype,
        },  # fmt: skip
    )
    hot = sorted(set(ids))  # the reference column order, independent of the plugin
    torch_dtype = getattr(torch, dtype)
    # The "checkpoint" of rank_cases._target_head (seed 0), in the same dtype.
    full = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
    head = full[hot].float()
    assert [r["rank"] for r in results] == list(range(tp))
    assert {r["buffer_shape"] for r in results} == {(MAX_BS, len(hot))}
    cases = [key for key in results[0] if isinstance(key, tuple)]
    assert len(cases) == 2 * 2 * len(BATCH_SIZES) * 2
    for key in cases:
        layout, exchange, bs, path = key
        case = results[0][key]
        for other in results[1:]:  # bit-identical on every rank, buffer included
            assert torch.equal(case["logits"], other[key]["logits"]), key
            assert torch.equal(case["buffer"], other[key]["buffer"]), key
        logits = case["logits"]
        assert all(r[key]["in_buffer"] for r in results), f"{key}: logits not written into the buffer"
        assert logits.dtype == torch.float32 and logits.shape == (bs, len(hot)), key
        assert torch.equal(case["buffer"], logits), key  # every buffer cell of the batch was written
        if path == "get_logits":
            h = hidden_rows(bs, HIDDEN, torch_dtype, case["step"])
        else:
            h = hidden_rows(bs * TREE_WIDTH, HIDDEN, torch_dtype, case["step"])[case["select"]]
        reference = h.float() @ head.T
        if exchange == "full":
            if dtype == "float32":
                torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-4, msg=str(key))
            else:
                scale = reference.abs().max().item()
                torch.testing.assert_close(logits, reference, rtol=1e-2, atol=8e-3 * scale, msg=str(key))
        else:  # the top-k packet keeps the reference's top-k ids and probabilities
            want_p, want_i = reference.softmax(-1).topk(TOPK, dim=-1)
            got_p, got_i = logits.softmax(-1).topk(TOPK, dim=-1)
            # Same ids up to ties: exact in float32; in bf16 the plugin's logits round distinct
            # reference values together (12.3010 and 12.3349 are both 12.3125), so a tied id may
            # differ, with a reference value equal at bf16 resolution.
            if dtype == "float32":
                assert torch.equal(reference.gather(1, got_i), reference.gather(1, want_i)), key
            else:
                torch.testing.assert_close(
                    reference.gather(1, got_i), reference.gather(1, want_i), rtol=2**-7, atol=0, msg=str(key)
                )  # rtol: one bf16 step
            tolerance = {"rtol": 1e-4, "atol": 1e-6} if dtype == "float32" else {"rtol": 0.05, "atol": 0.02}
            torch.testing.assert_close(got_p, want_p, **tolerance, msg=str(key))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_draft_logits_equal_sglangs_logits_processor(dtype):
    """Every config branch of the head computation, against SGLang's LogitsProcessor over the
    full target head (its hot columns), on the same inputs: full exchange bit-identical, top-k
    exchange with the identical top-k values and ids."""
    vocab, hidden, topk = 5003, 48, 4
    variants = {
        "plain": {},
        "fp32_head": {"config": {"enable_lm_head_fp32": True}},
        "fp32_output": {"config": {"enable_lm_head_output_fp32": True}},
        "logit_scale": {"logit_scale": 0.37},
        "softcap": {"config": {"final_logit_softcapping": 20.0}},
        "softcap_fp32_head": {"config": {"final_logit_softcapping": 20.0, "enable_lm_head_fp32": True}},
    }
    payload = {"vocab": vocab, "hidden": hidden, "dtype": dtype, "rows": 5, "scale": 1.5, "topk": topk,
               "map": skewed_ids(vocab, 600), "variants": variants}  # fmt: skip
    results = run_tp_group(rank_cases_adapters.logits_vs_stock, 2, payload, timeout=300)
    for name in variants:
        stock = results[0][name]["stock"]
        assert stock.dtype == torch.float32
        if "softcap" in name:  # the cap really bites, without saturating into ties
            assert stock.abs().max() < 20.0 and (stock - results[0]["plain"]["stock"]).abs().max() > 0.5
        for layout in ("local", "balanced"):
            assert torch.equal(results[0][name][layout, "full"], stock), (name, layout)
            assert torch.equal(results[1][name][layout, "full"], stock), (name, layout)
            got = results[0][name][layout, "topk"]
            want_values, want_ids = stock.topk(topk, dim=1)
            got_values, got_ids = got.topk(topk, dim=1)
            assert torch.equal(got_values, want_values) and torch.equal(got_ids, want_ids), (name, layout)
            torch.testing.assert_close(
                torch.softmax(got, 1).gather(1, got_ids), torch.softmax(stock, 1).gather(1, want_ids),
                rtol=1e-5, atol=1e-7,
            )  # fmt: skip
