"""Pure-torch versions of the sgl_kernel CPU ops that SGLang 0.5.23's Qwen3.5 full-attention
layers bind at import on CPU (``srt/models/qwen3_5.py:283-295``): the per-head Gemma RMSNorm of
q and k (``_apply_qk_norm``, ``forward_prepare_fused_gate``) and the sigmoid output gate
(``self_attention``).

Semantics follow SGLang's non-CPU kernels (``srt/models/utils.py:559-760``,
``kernels/ops/elementwise/elementwise.py:14-112``) and the output shapes of sgl-kernel's CPU ops:
``x * rsqrt(mean(x^2) + eps) * (1 + w)`` per head in float32, stored in the input's dtype.
Imports only torch.
"""

import torch


def _gemma_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """(rows, head_dim) Gemma RMSNorm of every head of ``x`` (.., heads * head_dim), float32 math."""
    heads = x.reshape(-1, head_dim).float()
    normed = heads * torch.rsqrt(heads.square().mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def _check_head_dim(name: str, width: int, head_dim: int) -> None:
    if width % head_dim:
        raise ValueError(
            f"sgl_kernel CPU stand-in: {name} has {width} columns, not a multiple of head_dim {head_dim}"
        )


def fused_qk_gemma_rmsnorm_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (tokens, heads * head_dim) and k (tokens, kv_heads * head_dim), each normed per head;
    outputs shaped like the inputs (the CPU op's ``empty_like``)."""
    _check_head_dim("q", q.shape[-1], head_dim)
    _check_head_dim("k", k.shape[-1], head_dim)
    return (
        _gemma_norm_heads(q, q_weight, eps, head_dim).view(q.shape),
        _gemma_norm_heads(k, k_weight, eps, head_dim).view(k.shape),
    )


def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q_gate`` (tokens, num_head * 2 * head_dim) interleaved per head as [q_h, gate_h]: returns
    the normed q (tokens * num_head, head_dim), the normed k (tokens * kv_heads, head_dim) and the
    gate copied out (tokens * num_head, head_dim)."""
    tokens = q_gate.shape[0]
    if q_gate.shape[-1] != num_head * 2 * head_dim:
        raise ValueError(
            f"sgl_kernel CPU stand-in: q_gate has {q_gate.shape[-1]} columns, expected "
            f"num_head * 2 * head_dim = {num_head * 2 * head_dim}"
        )
    _check_head_dim("k", k.shape[-1], head_dim)
    q, gate = q_gate.reshape(tokens, num_head, 2 * head_dim).split(head_dim, dim=-1)
    return (
        _gemma_norm_heads(q, q_weight, eps, head_dim),
        _gemma_norm_heads(k, k_weight, eps, head_dim),
        gate.reshape(-1, head_dim).clone(),
    )


def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor) -> None:
    """In place: ``input *= sigmoid(gate)`` in float32. ``gate`` has ``input``'s elements, either
    in its shape or as (tokens, heads, head_dim) (a strided per-head view) for a 2-D ``input``."""
    if gate.numel() != input.numel() or gate.shape[0] != input.shape[0]:
        raise ValueError(
            f"sgl_kernel CPU stand-in: fused_sigmoid_mul_cpu gate {tuple(gate.shape)} does not "
            f"cover input {tuple(input.shape)}"
        )
    input.copy_(input.float() * torch.sigmoid(gate.reshape(input.shape).float()))


# Bound as torch.ops.sgl_kernel.<name> at import (qwen3_5.py:284-297, muse_glimmer.py:70).
TORCH_OPS = ["fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu"]
