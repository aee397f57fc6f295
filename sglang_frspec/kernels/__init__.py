"""Triton kernels of the draft head (torch + triton only, never SGLang).

``topk_packet`` (served): the per-rank top-k exchange packet in one read of the local logits;
its torch reference is ``HotLogitsExchange.topk_packet_reference``. ``kernels.gemv`` (measured
by ``benchmarks/bench_head_gemm.py``, not served until a GPU benchmark shows it pays):
``hot_head_gemv``, the hot-head product for small row counts, split over enough programs to keep
HBM streaming on small shards, and ``gemv_topk_packet``, both fused so the logits are never
written. Under ``TRITON_INTERPRET=1`` (set before triton is imported) they run on CPU tensors.
"""

from sglang_frspec.kernels.packet import topk_packet

__all__ = ["topk_packet"]
