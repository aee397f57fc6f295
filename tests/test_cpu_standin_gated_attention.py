"""The CPU stand-in's Qwen3.5 full-attention ops (``cpu_site/sgl_kernel/_gated_attention.py``)
against SGLang's own non-CPU path for each op, run in one child process: its Triton kernels under
Triton's interpreter (``TRITON_INTERPRET=1``; bfloat16, where those kernels store their norm
output: ``srt/models/utils.py:582,680``) and its ``GemmaRMSNorm.forward_native`` (float32).

Shapes as in a Qwen3.5 layer: grouped query heads (4 query, 2 key/value heads), a head size that
is not a power of two (the kernels mask their blocks), q, gate and k read from strided views of
one fused qkv projection. The stand-in file is loaded by path (importing the ``sgl_kernel``
stand-in package would install its import hook into this process).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglang_frspec.demo.cpu import CPU_SITE
from tests.harness.triton_child import run_interpreted

pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location(
    "frspec_cpu_site_gated_attention", CPU_SITE / "sgl_kernel" / "_gated_attention.py"
)
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

TOKENS, HEADS, KV_HEADS, HEAD_DIM = 5, 4, 2, 12
EPS = 1e-6

TRITON_CHILD = """
import os, sys, torch
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # SGLang's non-CPU path (the conftest sets it)
from sglang.kernels.ops.elementwise.elementwise import fused_sigmoid_mul
from sglang.srt.layers.layernorm import GemmaRMSNorm
from sglang.srt.models.utils import fused_qk_gemma_rmsnorm, fused_qk_gemma_rmsnorm_with_gate

def native(x, weight, eps, head_dim):
    norm = GemmaRMSNorm(head_dim, eps=eps)
    norm.weight.data = weight.clone()
    return norm.forward_native(x.reshape(-1, head_dim))

kernels = {"qk_norm": fused_qk_gemma_rmsnorm, "qk_norm_gate": fused_qk_gemma_rmsnorm_with_gate}
cases = torch.load(sys.argv[1])
for case in cases.values():
    if case["kernel"] == "sigmoid_mul":
        case["out"] = fused_sigmoid_mul(*case["args"], inplace=True)
    elif case["kernel"] == "native":
        x, weight = case["args"]
        case["out"] = native(x, weight, case["eps"], case["head_dim"])
    else:
        case["out"] = kernels[case["kernel"]](*case["args"])
torch.save(cases, sys.argv[2])
"""


def _projection(dtype: torch.dtype, seed: int) -> dict:
    """q_gate, k, v as strided column views of one fused qkv output, plus the two norm weights."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = (torch.randn(TOKENS, 2 * q_size + 2 * kv_size, generator=g) * 3).to(dtype)
    q_gate, k, _ = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
    return {
        "q_gate": q_gate,
        "k": k,
        "q_weight": torch.randn(HEAD_DIM, generator=g).to(dtype),
        "k_weight": torch.randn(HEAD_DIM, generator=g).to(dtype),
    }


def _qk_norm_case(dtype: torch.dtype) -> dict:
    """fused_qk_gemma_rmsnorm on q and k without a gate (the first HEADS * HEAD_DIM columns as q)."""
    p = _projection(dtype, 1)
    q = p["q_gate"][:, : HEADS * HEAD_DIM]
    return {"kernel": "qk_norm", "args": (q, p["k"], p["q_weight"], p["k_weight"], EPS, HEAD_DIM)}


def _qk_norm_gate_case(dtype: torch.dtype) -> dict:
    p = _projection(dtype, 2)
    args = (p["q_gate"], p["k"], p["q_weight"], p["k_weight"], EPS, HEAD_DIM, HEADS)
    return {"kernel": "qk_norm_gate", "args": args}


def _sigmoid_mul_case(dtype: torch.dtype, strided_gate: bool) -> dict:
    """attn_output (tokens, heads * head_dim) and its gate: flat, or the (tokens, heads, head_dim)
    strided view that Qwen3.5's native prepare keeps (qwen3_5.py:1504-1507)."""
    g = torch.Generator().manual_seed(3 + strided_gate)
    attn = torch.randn(TOKENS, HEADS * HEAD_DIM, generator=g).to(dtype)
    q_gate = (torch.randn(TOKENS, HEADS, 2 * HEAD_DIM, generator=g) * 4).to(dtype)
    gate = q_gate[..., HEAD_DIM:] if strided_gate else q_gate[..., HEAD_DIM:].reshape(TOKENS, -1)
    return {"kernel": "sigmoid_mul", "args": (attn, gate)}


def _native_case(which: str) -> dict:
    """float32: SGLang's torch GemmaRMSNorm over the heads of q, of k or of the gate's q half."""
    p = _projection(torch.float32, 4)
    x = {
        "q": p["q_gate"].reshape(TOKENS, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM],
        "k": p["k"],
    }[which]
    weight = p["q_weight"] if which == "q" else p["k_weight"]
    return {"kernel": "native", "args": (x.contiguous(), weight), "eps": EPS, "head_dim": HEAD_DIM}


CASES = {
    "qk_norm": _qk_norm_case(torch.bfloat16),
    "qk_norm_gate": _qk_norm_gate_case(torch.bfloat16),
    "sigmoid_mul_flat_bf16": _sigmoid_mul_case(torch.bfloat16, strided_gate=False),
    "sigmoid_mul_strided_f32": _sigmoid_mul_case(torch.float32, strided_gate=True),
    "native_q_f32": _native_case("q"),
    "native_k_f32": _native_case("k"),
}


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory) -> dict:
    """Every case run once by SGLang (Triton interpreted; torch native) in one child process."""
    return run_interpreted(TRITON_CHILD, CASES, tmp_path_factory.mktemp("gated"), timeout=300)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == theirs.dtype, what
    # bfloat16 outputs: the float32 math may round the other way at one ulp (2**-7 relative).
    tol = {"atol": 1e-5, "rtol": 1e-5} if theirs.dtype == torch.float32 else {"atol": 2e-2, "rtol": 8e-3}
    torch.testing.assert_close(ours, theirs, msg=what, **tol)


def test_qk_gemma_rmsnorm_against_triton(sglang_run):
    """q and k normed per head with (1 + weight); outputs shaped like the inputs (the CPU op), the
    same values as the Triton kernel's (rows, head_dim) outputs."""
    case = CASES["qk_norm"]
    q, k = case["args"][:2]
    q_out, k_out = ops.fused_qk_gemma_rmsnorm_cpu(*case["args"])
    assert q_out.shape == q.shape and k_out.shape == k.shape
    theirs = sglang_run["qk_norm"]["out"]
    _assert_same(q_out.reshape(-1, HEAD_DIM), theirs[0], "q")
    _assert_same(k_out.reshape(-1, HEAD_DIM), theirs[1], "k")


def test_qk_gemma_rmsnorm_with_gate_against_triton(sglang_run):
    """Interleaved [q_h, gate_h] per head: normed q, normed k and the gate copied out."""
    ours = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(*CASES["qk_norm_gate"]["args"])
    theirs = sglang_run["qk_norm_gate"]["out"]
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    for name, a, b in zip(("q", "k", "gate"), ours, theirs, strict=True):
        _assert_same(a, b, name)
    q_gate = CASES["qk_norm_gate"]["args"][0].reshape(TOKENS, HEADS, 2 * HEAD_DIM)
    assert torch.equal(ours[2], q_gate[..., HEAD_DIM:].reshape(-1, HEAD_DIM))


@pytest.mark.parametrize("name", ["sigmoid_mul_flat_bf16", "sigmoid_mul_strided_f32"])
def test_sigmoid_mul_against_triton(sglang_run, name):
    """attn_output * sigmoid(gate) written in place, for a flat and a strided per-head gate."""
    attn, gate = (a.clone() for a in CASES[name]["args"])
    assert ops.fused_sigmoid_mul_cpu(attn, gate) is None
    _assert_same(attn, sglang_run[name]["out"], name)
    torch.testing.assert_close(gate, CASES[name]["args"][1])  # the gate is only read


@pytest.mark.parametrize("which", ["q", "k"])
def test_float32_norms_against_sglang_native(sglang_run, which):
    """In float32 (where the Triton kernels would round to bfloat16), both norm ops equal SGLang's
    torch GemmaRMSNorm; the gated op on an interleaved buffer built around the same q."""
    x, weight = CASES[f"native_{which}_f32"]["args"]
    expected = sglang_run[f"native_{which}_f32"]["out"]
    plain = ops.fused_qk_gemma_rmsnorm_cpu(x, x, weight, weight, EPS, HEAD_DIM)[0]
    _assert_same(plain.reshape(-1, HEAD_DIM), expected, f"{which}: fused_qk_gemma_rmsnorm_cpu")
    if which == "q":
        q_gate = torch.cat([x, torch.randn_like(x)], dim=-1).reshape(TOKENS, -1)
        k = torch.randn(TOKENS, KV_HEADS * HEAD_DIM)
        gated = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, weight, weight, EPS, HEAD_DIM, HEADS)
        _assert_same(gated[0], expected, "q: fused_qk_gemma_rmsnorm_with_gate_cpu")


def test_bad_shapes_are_named():
    """A gate that does not cover the input, or a q_gate of the wrong width, is refused by name."""
    with pytest.raises(ValueError, match="does not cover"):
        ops.fused_sigmoid_mul_cpu(torch.zeros(2, 8), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="num_head \\* 2 \\* head_dim"):
        ops.fused_qk_gemma_rmsnorm_with_gate_cpu(
            torch.zeros(2, 40), torch.zeros(2, 8), torch.ones(8), torch.ones(8), EPS, 8, 3
        )


def test_exported_where_sglang_looks():
    """The names qwen3_5.py binds at import (torch.ops.sgl_kernel.<op>, lines 284-297) resolve to
    the stand-in's ops."""
    import sgl_kernel  # noqa: F401  (the stand-in sets the torch.ops names)
    from sgl_kernel import _gated_attention

    for name in _gated_attention.TORCH_OPS:
        assert getattr(torch.ops.sgl_kernel, name) is getattr(_gated_attention, name)
