"""The draft logits processor fills SGLang's draft-extend logits buffer (sized from
len(hot_token_id)) on a real gloo TP group, with the values of the single-rank reference."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.testing.tp_group import run_tp_group
from tests.rank_cases_adapters import hidden_rows

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
        "tests.rank_cases_adapters:draft_extend_buffer_logits",
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
