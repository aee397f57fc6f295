"""Triton kernels of the draft head (torch + triton only, never SGLang).

``topk_packet``: the per-rank top-k exchange packet in one read of the local logits;
``hot_head_gemv``: the hot-head product for small row counts, split over enough programs to
keep HBM streaming on small shards; ``gemv_topk_packet``: both, fused so the logits are never
written. Their torch references are ``HotLogitsExchange.topk_packet`` and ``hidden @ weight.T``.
Under ``TRITON_INTERPRET=1`` (set before triton is imported) they run on CPU tensors.
"""

from sglang_frspec.kernels.gemv import gemv_topk_packet, hot_head_gemv
from sglang_frspec.kernels.packet import topk_packet

__all__ = ["gemv_topk_packet", "hot_head_gemv", "topk_packet"]
