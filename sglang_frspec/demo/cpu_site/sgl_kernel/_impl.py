"""Pure-torch versions of the sgl_kernel CPU ops that SGLang 0.5.23's CPU engine calls for
plain and EAGLE decoding on a CPU without AMX.

Semantics follow SGLang's own Triton reference kernels (``kernels/ops/speculative``:
spec_tree, eagle, cache_locs; ``srt/mem_cache/allocation.py``). Python loops: slow, exact, for
tiny test models.
"""

import ctypes

import torch

# ---------------------------------------------------------------------------- KV cache


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (base pointer, row stride in bytes) copy rows src -> tgt."""
    if src_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride)
        rows[tgt] = rows[src].clone()  # read all sources first: src and tgt may overlap


# ---------------------------------------------------------------------------- req_to_token


def _segments(start_offset, end_offset):
    """(flat offset, length) of each request's run in a packed location buffer."""
    lengths = (end_offset.long() - start_offset.long()).tolist()
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += n
    return zip(offsets, lengths)


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    segments = _segments(start_offset, end_offset)
    for (flat, n), req, start in zip(segments, req_pool_indices.tolist(), start_offset.tolist()):
        if n > 0:
            req_to_token[req, start : start + n] = out_cache_loc[flat : flat + n].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    segments = _segments(start_offset, end_offset)
    for (flat, n), req, start in zip(segments, req_pool_indices.tolist(), start_offset.tolist()):
        if n > 0:
            out_cache_loc[flat : flat + n] = req_to_token[req, start : start + n].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
):
    n = topk * num_steps
    for i, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[req, seq_len : seq_len + n].to(out_cache_loc.dtype)


# ---------------------------------------------------------------------------- EAGLE helpers


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    kept = [src for src in accept_index.reshape(-1).tolist() if src > -1]
    for dst, src in enumerate(kept):
        accept_out_cache_loc[dst] = out_cache_loc[src]


# ---------------------------------------------------------------------------- tree build/verify


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
):
    """Python port of spec_tree's build_tree_efficient kernel (one program per request)."""
    num_draft = draft_token_num
    batch = verified_seq_len.shape[0]
    seq_lens = verified_seq_len.tolist()
    selected = selected_index.tolist()  # [bs][num_draft - 1]
    if parent_list.dim() > 1:
        parents = parent_list.tolist()
    else:  # flat input: the Triton kernel strides it by its length
        flat, stride = parent_list.tolist(), parent_list.shape[0]
        parents = [flat[b * stride : (b + 1) * stride] for b in range(batch)]
    mask, pos = tree_mask.reshape(-1), positions.reshape(-1)
    r_index = retrive_index.reshape(-1)
    r_next = retrive_next_token.reshape(-1)
    r_sibling = retrive_next_sibling.reshape(-1)

    def parent_position(b: int, node: int):
        """Tree position (1-based) of node's parent, 0 for the root, None if absent."""
        parent_tb = selected[b][node] // topk
        if parent_tb == 0:
            return 0
        target = parents[b][parent_tb]
        for p in range(num_draft - 1):
            if selected[b][p] == target:
                return p + 1
        return None

    prefix = 0
    for b in range(batch):
        seq_len = seq_lens[b]
        base = b * num_draft
        pos[base] = seq_len
        for i in range(num_draft - 1, 0, -1):
            r_index[base + i] = base + i
            parent = parent_position(b, i - 1)
            if parent is not None:
                previous = int(r_next[base + parent])
                r_next[base + parent] = i
                if previous != -1:
                    r_sibling[base + i] = previous
        r_index[base] = base
        for x in range(num_draft):
            if tree_mask_mode == 0:
                row = num_draft * num_draft * b + prefix * num_draft + (seq_len + num_draft) * x
                row += seq_len + 1
            else:
                row = num_draft * num_draft * b + num_draft * x + 1
            mask[row - 1] = True
            mask[row : row + num_draft - 1] = False
            if x == 0:
                continue
            node, position = x - 1, 0
            for _ in range(depth):
                position += 1
                mask[row + node] = True
                parent = parent_position(b, node)
                if not parent:  # root reached (0) or parent missing (None)
                    break
                node = parent - 1
            pos[base + x] = position + seq_len
        prefix += seq_len


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
):
    batch, num_draft = candidates.shape
    num_spec_steps = accept_index.shape[1]
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sibling = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.reshape(-1)
    for b in range(batch):
        last = r_index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, num_spec_steps):
            node = r_next[b][node]
            want = target[last]
            while node != -1 and cand[b][node] != want:
                node = r_sibling[b][node]
            if node == -1:
                break
            pred[last] = want
            accepted += 1
            last = r_index[b][node]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        pred[last] = target[last]


# ---------------------------------------------------------------------------- attention
# Exact reference versions of torch.ops.sgl_kernel.{decode,extend}_attention_cpu and
# build_draft_decode_metadata_cpu: enough for the intel_amx backend with EAGLE.


def _attend(q, keys, values, sm_scale, logit_cap, allowed=None):
    """q [E, Hq, D]; keys/values [L, Hkv, D]; allowed [E, L] bool or None -> [E, Hq, Dv]."""
    num_q_heads, num_kv_heads = q.shape[1], keys.shape[1]
    if num_q_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
    scores = torch.einsum("ehd,lhd->hel", q.float(), keys.float()) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    return torch.einsum("hel,lhd->ehd", torch.softmax(scores, dim=-1), values.float())


def decode_attention_cpu(
    q,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    o,
    k_new,
    v_new,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap,
    is_cross,
    window,
    encoder_lens,
    sinks,
):
    if k_new is not None and v_new is not None:
        k_buffer[loc.long()] = k_new.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc.long()] = v_new.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    for b, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        # A sliding-window layer reads its last ``window`` keys, its own included (sgl-kernel's
        # decode.cpp; the intel_amx backend passes the layer's sliding_window_size + 1, 0 for a
        # full-attention layer): the key at position k is seen from position p when k > p - window.
        first = max(seq_len - window, 0) if window > 0 else 0
        idx = req_to_token[req, first:seq_len].long()
        out = _attend(q[b : b + 1], k_buffer[idx] * k_scale, v_buffer[idx] * v_scale, sm_scale, logit_cap)
        o[b] = out[0].to(o.dtype)


def _with_prefix(cached: torch.Tensor, new: torch.Tensor, what: str) -> torch.Tensor:
    """A request's prefix rows from the cache followed by its new tokens' rows (cache dtype)."""
    if cached.shape[0] == 0:  # no prefix: the new rows may be shaped unlike the cache's (MHA over MLA)
        return new.to(cached.dtype)
    if cached.shape[1:] != new.shape[1:]:
        raise RuntimeError(
            f"extend_attention_cpu stand-in: the new tokens' {what}s {tuple(new.shape[1:])} do not "
            f"match the cache's {tuple(cached.shape[1:])} under a prefix"
        )
    return torch.cat([cached, new.to(cached.dtype)])


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap,
    is_cross,
    window,
    encoder_lens,
    sinks,
    tree_mask,
    is_causal,
):
    seq_list, ext_list = seq_lens.tolist(), extend_seq_lens.tolist()
    full_mask = query_mask = None
    if tree_mask is not None:
        flat = tree_mask.reshape(-1).bool()
        if flat.numel() == sum(e * s for e, s in zip(ext_list, seq_list)):
            full_mask = flat  # [E, L] per request
        elif flat.numel() == sum(e * e for e in ext_list):
            query_mask = flat  # [E, E] per request, prefix fully visible
        else:
            raise RuntimeError(f"extend_attention_cpu stand-in: tree_mask size {flat.numel()}")
    used = 0
    requests = zip(req_pool_indices.tolist(), seq_list, ext_list, extend_start_loc.tolist())
    for req, seq_len, ext, start in requests:
        prefix = seq_len - ext
        if k_extend is not None:
            # The new tokens' keys and values go by their own head sizes (q's and o's), not the
            # cache's: DeepSeek's MHA prefill (no prefix) hands H_tp heads of nope+rope keys and
            # v_head_dim values while each cache row holds the MLA latent (kv_lora + rope).
            prefix_idx = req_to_token[req, :prefix].long()
            new_keys = k_extend[start : start + ext].reshape(ext, -1, q_extend.shape[-1])
            new_values = v_extend[start : start + ext].reshape(ext, -1, o_extend.shape[-1])
            keys = _with_prefix(k_buffer[prefix_idx], new_keys, "key")
            values = _with_prefix(v_buffer[prefix_idx], new_values, "value")
        else:
            idx = req_to_token[req, :seq_len].long()
            keys, values = k_buffer[idx], v_buffer[idx]
        if full_mask is not None:
            allowed = full_mask[used : used + ext * seq_len].view(ext, seq_len)
            used += ext * seq_len
        elif query_mask is not None:
            allowed = torch.ones(ext, seq_len, dtype=torch.bool)
            allowed[:, prefix:] = query_mask[used : used + ext * ext].view(ext, ext)
            used += ext * ext
        elif is_causal:
            allowed = torch.arange(seq_len)[None, :] <= (prefix + torch.arange(ext))[:, None]
        else:
            allowed = None
        if window > 0:
            # As sgl-kernel's extend.cpp: the extend's row i stands at position prefix + i (also
            # under a tree mask, whose rows are not positions) and sees keys after it - window.
            in_window = torch.arange(seq_len)[None, :] > (prefix + torch.arange(ext))[:, None] - window
            allowed = in_window if allowed is None else allowed & in_window
        out = _attend(
            q_extend[start : start + ext], keys * k_scale, values * v_scale, sm_scale, logit_cap, allowed
        )
        o_extend[start : start + ext] = out.to(o_extend.dtype)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    out = torch.zeros(seq_lens.shape[0] * topk, pool_len, dtype=req_to_token.dtype)
    for b, (req, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for k in range(topk):
            row = b * topk + k
            out[row, :seq_len] = req_to_token[req, :seq_len]
            branch = seq_len + k * num_steps
            out[row, seq_len : seq_len + num_steps] = req_to_token[req, branch : branch + num_steps]
    return out


TORCH_OPS = [
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "verify_tree_greedy_cpu",
]
