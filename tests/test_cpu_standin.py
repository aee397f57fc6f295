"""The CPU ``sgl_kernel`` stand-in's attention ops on DeepSeek's MLA shapes, as SGLang 0.5.23's
intel_amx backend calls them, against an independent einsum reference.

DeepSeek-V2/V3 on the intel_amx backend (no AMX: no fused-rope CPU path) takes three roads
(``models/deepseek_common/attention_backend_handler.py``, the ``triton`` handler):

- a prefill without prefix runs MHA (``forward_mha.py`` ``forward_normal_*``): keys of H_tp heads
  of nope+rope, values of H_tp heads of v_head_dim, ``save_kv_cache=False``, over the new tokens;
  the layer's cache rows hold the latent (kv_lora + rope);
- every other extend (prefix extend, target verify, draft extend) runs absorbed MLA
  (``forward_mla.py`` ``forward_absorb_core``): q of H_tp heads of kv_lora+rope, one latent key
  head, values = the latent's first kv_lora columns (the value buffer is that slice of the cache);
- decode runs absorbed MLA through ``decode_attention_cpu``, which writes the new latent itself.

And on a sliding-window layer (Gemma 3's, one key head as Gemma 3 270M's), past the window:
prefill, prefix extend and decode against Transformers' sliding-window causal mask, with the
window argument SGLang derives from the HF config.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sgl_kernel import _impl

HEADS, NOPE, ROPE, V_DIM, KV_LORA = 2, 32, 16, 32, 64
POOL = 64
SCALE = 0.125


def mla_cache(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA layer's cache (rows of kv_lora + rope, one head) and its value view, as
    ``MLATokenToKVPool.get_key_buffer`` / ``get_value_buffer`` return them."""
    key_buffer = torch.randn(POOL, 1, KV_LORA + ROPE, generator=gen)
    return key_buffer, key_buffer[..., :KV_LORA]


def reference(q, keys, values, allowed):
    """softmax(q·k * scale, masked)·v for one request: q [E, H, D], keys [L, Hk, D], values
    [L, Hk, Dv], Hk = H or 1 (MLA's one latent head serves every query head), allowed [E, L]."""
    heads = q.shape[1]
    keys, values = keys.expand(-1, heads, -1), values.expand(-1, heads, -1)
    scores = torch.einsum("ehd,lhd->ehl", q, keys) * SCALE
    probs = scores.masked_fill(~allowed[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("ehl,lhd->ehd", probs, values)


def batch(ext_lens, prefix_lens, gen):
    """req_to_token (request b's tokens at distinct random pool rows) and the batch's metadata."""
    rows = torch.randperm(POOL, generator=gen)
    req_to_token = torch.zeros(4, POOL, dtype=torch.int32)
    used = 0
    for b, (ext, pre) in enumerate(zip(ext_lens, prefix_lens)):
        req_to_token[b + 1, : pre + ext] = rows[used : used + pre + ext].int()
        used += pre + ext
    seq_lens = torch.tensor([e + p for e, p in zip(ext_lens, prefix_lens)], dtype=torch.int64)
    extend_lens = torch.tensor(ext_lens, dtype=torch.int32)
    starts = torch.cumsum(torch.tensor([0, *ext_lens[:-1]]), 0).int()
    return req_to_token, torch.tensor([1, 2], dtype=torch.int64), seq_lens, extend_lens, starts


def extend(q, k, v, o, key_buffer, value_buffer, meta, tree_mask=None, window=0):
    req_to_token, req_pool_indices, seq_lens, extend_lens, starts = meta
    _impl.extend_attention_cpu(
        q, k, v, o, key_buffer, value_buffer, 1.0, 1.0, req_to_token, req_pool_indices, seq_lens,
        extend_lens, starts, int(extend_lens.max()), SCALE, 0.0, False, window, None, None, tree_mask,
        True,
    )  # fmt: skip


def causal(ext: int, prefix: int) -> torch.Tensor:
    """[ext, prefix + ext]: the prefix and the new tokens up to each query's own."""
    return torch.arange(prefix + ext)[None, :] <= (prefix + torch.arange(ext))[:, None]


def test_mha_prefill_over_an_mla_cache_attends_over_the_new_tokens():
    """DeepSeek's MHA prefill: keys/values shaped unlike the cache rows, no prefix."""
    gen = torch.Generator().manual_seed(0)
    ext_lens = [3, 5]
    n = sum(ext_lens)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=gen)
    k = torch.randn(n, HEADS, NOPE + ROPE, generator=gen)
    v = torch.randn(n, HEADS, V_DIM, generator=gen)
    key_buffer, value_buffer = mla_cache(gen)
    o = torch.full((n, HEADS, V_DIM), float("nan"))
    extend(q, k, v, o, key_buffer, value_buffer, batch(ext_lens, [0, 0], gen))
    start = 0
    for ext in ext_lens:
        rows = slice(start, start + ext)
        expected = reference(q[rows], k[rows], v[rows], causal(ext, 0))
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)
        start += ext


def absorbed(gen, ext_lens, prefix_lens):
    """Absorbed-MLA extend inputs: q over the latent, one latent key head per new token, written
    to the cache first (``set_kv_buffer``), values the latent's first kv_lora columns."""
    meta = batch(ext_lens, prefix_lens, gen)
    n = sum(ext_lens)
    q = torch.randn(n, HEADS, KV_LORA + ROPE, generator=gen)
    k = torch.randn(n, 1, KV_LORA + ROPE, generator=gen)
    key_buffer, value_buffer = mla_cache(gen)
    req_to_token, _, _, _, starts = meta
    for b, (ext, pre, start) in enumerate(zip(ext_lens, prefix_lens, starts.tolist())):
        key_buffer[req_to_token[b + 1, pre : pre + ext].long()] = k[start : start + ext]
    return q, k, key_buffer, value_buffer, meta


@pytest.mark.parametrize("prefix_lens", [[4, 7], [0, 2]], ids=["prefix", "one-without-prefix"])
def test_absorbed_mla_extend_reads_values_by_the_value_buffer(prefix_lens):
    """Prefix extend / draft extend / chain verify: causal over prefix + new latent rows."""
    gen = torch.Generator().manual_seed(1)
    ext_lens = [3, 4]
    q, k, key_buffer, value_buffer, meta = absorbed(gen, ext_lens, prefix_lens)
    o = torch.full((sum(ext_lens), HEADS, KV_LORA), float("nan"))
    extend(q, k, k[..., :KV_LORA], o, key_buffer, value_buffer, meta)
    req_to_token, _, seq_lens, _, starts = meta
    for b, (ext, pre, start) in enumerate(zip(ext_lens, prefix_lens, starts.tolist())):
        latent = key_buffer[req_to_token[b + 1, : pre + ext].long()]
        rows = slice(start, start + ext)
        expected = reference(q[rows], latent, latent[..., :KV_LORA], causal(ext, pre))
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)


def test_absorbed_mla_tree_verify_follows_the_tree_mask():
    """Target verify of a draft tree (topk > 1): each draft token sees the prefix and its ancestors."""
    gen = torch.Generator().manual_seed(2)
    ext_lens, prefix_lens = [4, 4], [5, 3]
    q, k, key_buffer, value_buffer, meta = absorbed(gen, ext_lens, prefix_lens)
    # root, two children of the root, a child of the first child
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree_mask = torch.cat([tree.flatten(), tree.flatten()])
    o = torch.full((sum(ext_lens), HEADS, KV_LORA), float("nan"))
    extend(q, k, k[..., :KV_LORA], o, key_buffer, value_buffer, meta, tree_mask)
    req_to_token, _, _, _, starts = meta
    for b, (ext, pre, start) in enumerate(zip(ext_lens, prefix_lens, starts.tolist())):
        latent = key_buffer[req_to_token[b + 1, : pre + ext].long()]
        allowed = torch.cat([torch.ones(ext, pre, dtype=torch.bool), tree], dim=1)
        rows = slice(start, start + ext)
        expected = reference(q[rows], latent, latent[..., :KV_LORA], allowed)
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)


def test_absorbed_mla_decode_writes_the_latent_and_attends_over_it():
    """Decode: the kernel stores the new latent row (key and its value slice) and attends."""
    gen = torch.Generator().manual_seed(3)
    meta = batch([1, 1], [6, 2], gen)
    req_to_token, req_pool_indices, seq_lens, _, _ = meta
    q = torch.randn(2, HEADS, KV_LORA + ROPE, generator=gen)
    k = torch.randn(2, 1, KV_LORA + ROPE, generator=gen)
    key_buffer, value_buffer = mla_cache(gen)
    loc = torch.stack([req_to_token[b + 1, int(seq_lens[b]) - 1] for b in range(2)]).long()
    o = torch.full((2, HEADS, KV_LORA), float("nan"))
    _impl.decode_attention_cpu(
        q, key_buffer, value_buffer, 1.0, 1.0, o, k, k[..., :KV_LORA], loc, None, req_to_token,
        req_pool_indices, seq_lens, SCALE, 0.0, False, 0, None, None,
    )  # fmt: skip
    torch.testing.assert_close(key_buffer[loc], k)
    for b in range(2):
        latent = key_buffer[req_to_token[b + 1, : int(seq_lens[b])].long()]
        expected = reference(q[b : b + 1], latent, latent[..., :KV_LORA], causal(1, int(seq_lens[b]) - 1))
        torch.testing.assert_close(o[b : b + 1], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- sliding window

SLIDING_WINDOW = 8  # the HF config's sliding_window (Gemma 3 270M: 512)
HEAD_DIM = 16


def op_window() -> int:
    """The window the ops get: SGLang's Gemma 3 gives the layer ``sliding_window - 1``
    (``models/gemma3_causal.py:65``), the intel_amx backend passes that + 1
    (``intel_amx_backend.py:308,400``)."""
    from sglang.srt.models.gemma3_causal import get_attention_sliding_window_size

    layer_window = get_attention_sliding_window_size(SimpleNamespace(sliding_window=SLIDING_WINDOW))
    return layer_window + 1


def hf_window(positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[queries, num_keys]: Transformers' sliding-window causal mask for queries at ``positions``."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask = sliding_window_causal_mask_function(SLIDING_WINDOW)
    return mask(0, 0, positions[:, None], torch.arange(num_keys)[None, :])


def window_cache(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A regular layer's key and value buffers with one key/value head."""
    return torch.randn(POOL, 1, HEAD_DIM, generator=gen), torch.randn(POOL, 1, HEAD_DIM, generator=gen)


@pytest.mark.every_release
def test_sliding_window_prefill_and_prefix_extend_follow_transformers_mask():
    """A prefill of 2.5 windows, and 5 tokens after a prefix of 2 windows + 1."""
    gen = torch.Generator().manual_seed(4)
    ext_lens, prefix_lens = [20, 5], [0, 2 * SLIDING_WINDOW + 1]
    meta = batch(ext_lens, prefix_lens, gen)
    n = sum(ext_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(n, 1, HEAD_DIM, generator=gen), torch.randn(n, 1, HEAD_DIM, generator=gen)
    key_buffer, value_buffer = window_cache(gen)
    o = torch.full((n, HEADS, HEAD_DIM), float("nan"))
    extend(q, k, v, o, key_buffer, value_buffer, meta, window=op_window())
    req_to_token, _, _, _, starts = meta
    for b, (ext, pre, start) in enumerate(zip(ext_lens, prefix_lens, starts.tolist())):
        cached = req_to_token[b + 1, :pre].long()
        rows = slice(start, start + ext)
        keys, values = torch.cat([key_buffer[cached], k[rows]]), torch.cat([value_buffer[cached], v[rows]])
        expected = reference(q[rows], keys, values, hf_window(pre + torch.arange(ext), pre + ext))
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.every_release
def test_sliding_window_decode_reads_the_last_window_keys():
    """Decode after 2.5 windows and inside the window, the new key written by the op."""
    gen = torch.Generator().manual_seed(5)
    meta = batch([1, 1], [19, 4], gen)
    req_to_token, req_pool_indices, seq_lens, _, _ = meta
    q = torch.randn(2, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, 1, HEAD_DIM, generator=gen), torch.randn(2, 1, HEAD_DIM, generator=gen)
    key_buffer, value_buffer = window_cache(gen)
    loc = torch.stack([req_to_token[b + 1, int(seq_lens[b]) - 1] for b in range(2)]).long()
    o = torch.full((2, HEADS, HEAD_DIM), float("nan"))
    _impl.decode_attention_cpu(
        q, key_buffer, value_buffer, 1.0, 1.0, o, k, v, loc, None, req_to_token, req_pool_indices,
        seq_lens, SCALE, 0.0, False, op_window(), None, None,
    )  # fmt: skip
    for b in range(2):
        seq_len = int(seq_lens[b])
        idx = req_to_token[b + 1, :seq_len].long()
        allowed = hf_window(torch.tensor([seq_len - 1]), seq_len)
        expected = reference(q[b : b + 1], key_buffer[idx], value_buffer[idx], allowed)
        torch.testing.assert_close(o[b : b + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.every_release
def test_sliding_window_tree_verify_places_rows_as_sgl_kernel_does():
    """Target verify of a draft tree past the window: sgl-kernel's extend.cpp takes row i of the
    verify to stand at prefix + i (not at the draft token's tree depth) for the window, and the
    stand-in does the same; the tree mask still decides which draft tokens a row sees."""
    gen = torch.Generator().manual_seed(6)
    ext_lens, prefix_lens = [4, 4], [2 * SLIDING_WINDOW + 3, 5]
    meta = batch(ext_lens, prefix_lens, gen)
    n = sum(ext_lens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(n, 1, HEAD_DIM, generator=gen), torch.randn(n, 1, HEAD_DIM, generator=gen)
    key_buffer, value_buffer = window_cache(gen)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    o = torch.full((n, HEADS, HEAD_DIM), float("nan"))
    extend(q, k, v, o, key_buffer, value_buffer, meta, torch.cat([tree.flatten()] * 2), op_window())
    req_to_token, _, _, _, starts = meta
    for b, (ext, pre, start) in enumerate(zip(ext_lens, prefix_lens, starts.tolist())):
        cached = req_to_token[b + 1, :pre].long()
        rows = slice(start, start + ext)
        keys, values = torch.cat([key_buffer[cached], k[rows]]), torch.cat([value_buffer[cached], v[rows]])
        allowed = torch.cat([torch.ones(ext, pre, dtype=torch.bool), tree], dim=1)
        allowed &= hf_window(pre + torch.arange(ext), pre + ext)
        expected = reference(q[rows], keys, values, allowed)
        torch.testing.assert_close(o[rows], expected, rtol=1e-5, atol=1e-5)
