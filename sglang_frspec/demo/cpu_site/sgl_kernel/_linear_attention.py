"""Pure-torch versions of the sgl_kernel CPU ops that SGLang 0.5.23's gated-delta-net (GDN) linear
attention calls on CPU (the linear-attention family; Qwen3.5 / Qwen3-Next target layers).

Call sites: ``srt/layers/attention/linear/gdn_backend.py:183-188`` (conv, gating) and
``srt/layers/attention/linear/kernels/gdn_triton.py:27-33`` (the delta rule). Semantics follow
SGLang's Triton kernels: ``kernels/ops/mamba/causal_conv1d_triton.py`` (conv, with the EAGLE tree
walk of ``_causal_conv1d_update_kernel``), ``kernels/ops/attention/linear/fused_gdn_gating.py`` and
``fused_sigmoid_gating_recurrent.py``. Recurrent states are laid out ``[slot, HV, V, K]`` as
SGLang's pools hold them (Transformers' are ``[HV, K, V]``); key heads are shared by
``HV // H`` consecutive value heads. Math in float32; the chunked prefill runs token by token
(the same recurrence). Python loops: slow, exact, for tiny test models. Imports only torch.
"""

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1  # kernels/ops/mamba/causal_conv1d_triton.py:15


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in (True, "silu", "swish"):
        return F.silu(x)
    if activation in (None, False):
        return x
    raise ValueError(f"sgl_kernel CPU stand-in: conv1d activation {activation!r} is not silu/swish/None")


def _conv_width(weight: torch.Tensor, conv_state: torch.Tensor | None) -> int:
    """Kernel width; the state must hold exactly width - 1 columns (what SGLang's pools allocate)."""
    width = weight.shape[1]
    if conv_state is not None and conv_state.shape[-1] != width - 1:
        raise ValueError(
            f"sgl_kernel CPU stand-in: conv state has {conv_state.shape[-1]} columns, expected "
            f"width - 1 = {width - 1}"
        )
    return width


# ---------------------------------------------------------------------------- causal conv1d


def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_states: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation="silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Prefill conv over ``x`` (dim, tokens), sequences back to back by ``query_start_loc``.

    A sequence with ``has_initial_state`` continues from ``conv_states[cache_indices[i]]``, else
    from zeros; that state row is then overwritten with the sequence's last width - 1 inputs."""
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("sgl_kernel CPU stand-in: causal_conv1d_fn_cpu has no block_table")
    if x.dim() != 2:
        raise ValueError(
            f"sgl_kernel CPU stand-in: causal_conv1d_fn_cpu takes x as (dim, tokens), got {tuple(x.shape)}"
        )
    width = _conv_width(weight, conv_states)
    dim, tokens = x.shape
    bounds = query_start_loc.tolist() if query_start_loc is not None else [0, tokens]
    out = torch.zeros_like(x)
    w = weight.float().unsqueeze(1)  # (dim, 1, width): one filter per channel
    b = bias.float() if bias is not None else None
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == pad_slot_id:
            continue
        history = torch.zeros(dim, width - 1)
        if conv_states is not None and has_initial_state is not None and bool(has_initial_state[i]):
            history = conv_states[slot].float()
        full = torch.cat([history, x[:, start:end].float()], dim=1)
        y = F.conv1d(full.unsqueeze(0), w, b, groups=dim)[0]
        out[:, start:end] = _activate(y, activation).to(x.dtype)
        if conv_states is not None:
            conv_states[slot] = full[:, full.shape[1] - (width - 1) :].to(conv_states.dtype)
    return out


def _tree_parents(next_token: torch.Tensor, next_sibling: torch.Tensor, seqlen: int) -> list[int]:
    """Parent of each draft slot from the first-child / next-sibling links; 0 when unset (the root's)."""
    parents = [0] * seqlen
    nxt, sib = next_token.tolist(), next_sibling.tolist()
    for t in range(seqlen):
        if nxt[t] != -1:
            parents[nxt[t]] = t
        if sib[t] != -1:
            parents[sib[t]] = parents[t]
    return parents


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation=None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accept_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Decode / verify conv of ``x`` (batch, dim[, seqlen]) against ``conv_state[conv_state_indices]``.

    Token t convolves the inputs on its path: its ancestors in the EAGLE tree when
    ``retrieve_next_token`` is given (their parents are written to ``retrieve_parent_token``),
    else the tokens before it, then the state's history. ``intermediate_conv_window[
    intermediate_state_indices[b], t]`` receives that path's last width - 1 inputs; the state
    row itself is shifted by all seqlen inputs, as the Triton kernel does."""
    if cache_seqlens is not None or num_accept_tokens is not None:
        raise NotImplementedError(
            "sgl_kernel CPU stand-in: causal_conv1d_update_cpu has no cache_seqlens/num_accept_tokens"
        )
    tree = retrieve_next_token is not None
    if tree and (retrieve_next_sibling is None or retrieve_parent_token is None):
        raise ValueError(
            "sgl_kernel CPU stand-in: tree conv needs retrieve_next_sibling and retrieve_parent_token"
        )
    if intermediate_conv_window is not None and intermediate_state_indices is None:
        raise ValueError("sgl_kernel CPU stand-in: intermediate_conv_window needs intermediate_state_indices")
    width = _conv_width(weight, conv_state)
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    out = torch.zeros_like(x)
    w = weight.float()
    b = bias.float() if bias is not None else torch.zeros(dim)
    for i in range(batch):
        slot = int(conv_state_indices[i]) if conv_state_indices is not None else i
        if slot == pad_slot_id:
            continue
        history = conv_state[slot].float()  # (dim, width - 1), oldest first
        xs = x[i].float()
        if tree:
            parents = _tree_parents(retrieve_next_token[i], retrieve_next_sibling[i], seqlen)
            retrieve_parent_token[i, :seqlen] = torch.tensor(parents, dtype=retrieve_parent_token.dtype)
        else:
            parents = [t - 1 for t in range(seqlen)]
        for t in range(seqlen):
            path, node, back = [], t, 0  # newest first: the token, its parent, ..., then history
            while len(path) < width:
                if node >= 0:
                    path.append(xs[:, node])
                    node = parents[node] if node > 0 else -1
                else:
                    back += 1
                    path.append(history[:, width - 1 - back])
            window = torch.stack(path[::-1], dim=1)  # (dim, width), oldest first
            out[i, :, t] = _activate(b + (w * window).sum(dim=1), activation).to(x.dtype)
            if intermediate_conv_window is not None:
                row = int(intermediate_state_indices[i])
                intermediate_conv_window[row, t] = window[:, 1:].to(intermediate_conv_window.dtype)
        conv_state[slot] = torch.cat([history, xs], dim=1)[:, seqlen:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


# ---------------------------------------------------------------------------- gating


def _gates(A_log, a, b, dt_bias, softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """g = -exp(A_log) * softplus(a + dt_bias) (the log decay) and beta = sigmoid(b), in float32."""
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """(g, beta) for a (tokens, HV): g float32, beta in b's dtype, each shaped (1, tokens, HV)."""
    g, beta = _gates(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.to(b.dtype).unsqueeze(0)


# ---------------------------------------------------------------------------- gated delta rule


def _delta_step(state, q, k, v, g, beta):
    """One token: decay the (HV, V, K) state by exp(g), write beta * (v - state k) along k, read q."""
    state = state * torch.exp(g)[:, None, None]
    delta = (v - torch.einsum("hvk,hk->hv", state, k)) * beta[:, None]
    state = state + delta[:, :, None] * k[:, None, :]
    return state, torch.einsum("hvk,hk->hv", state, q)


def _prepare_qk(q, k, heads_v: int, l2norm: bool, eps: float, scale: float | None):
    """float32 (tokens, HV, K) queries and keys: normalized, q scaled, key heads shared by value heads."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    q = q * (scale if scale is not None else k.shape[-1] ** -0.5)
    group = heads_v // k.shape[-2]
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def _bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int) -> list[int]:
    if cu_seqlens is not None:
        return cu_seqlens.tolist()
    return [i * seqlen for i in range(batch + 1)]


def chunk_gated_delta_rule_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: float | None = None,
):
    """Prefill: q, k (1, T, H, K), v (1, T, HV, V), g, beta (1, T, HV); sequence i starts from
    ``initial_state[initial_state_indices[i]]`` and its final state is written back there.

    Returns (o like v, the final states (N, HV, V, K) float32, None: no per-chunk states)."""
    if head_first:
        raise NotImplementedError(
            "sgl_kernel CPU stand-in: chunk_gated_delta_rule_cpu takes head_first=False"
        )
    batch, seqlen, heads_v = v.shape[0], v.shape[1], v.shape[2]
    bounds = _bounds(cu_seqlens, batch, seqlen)
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), heads_v, use_qk_l2norm_in_kernel, eps, scale)
    vf, gf, bf = v.flatten(0, 1).float(), g.flatten(0, 1).float(), beta.flatten(0, 1).float()
    out = torch.zeros_like(v).flatten(0, 1)
    finals = []
    for i in range(len(bounds) - 1):
        slot = int(initial_state_indices[i]) if initial_state_indices is not None else i
        state = initial_state[slot].float()
        for t in range(bounds[i], bounds[i + 1]):
            state, o = _delta_step(state, qf[t], kf[t], vf[t], gf[t], bf[t])
            out[t] = o.to(out.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
        finals.append(state)
    return out.view_as(v), torch.stack(finals), None


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: float | None = None,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Decode and target verify: gates from (a, b) per token, then the delta rule.

    Decode writes each sequence's final state back to ``initial_state_source``. Verify
    (``disable_state_update``) leaves it and stores the state after draft step t in
    ``intermediate_states_buffer[intermediate_state_indices[i], t]``; with
    ``retrieve_parent_token`` step t > 0 starts from its parent's stored state (the EAGLE tree)."""
    if is_kda:
        raise NotImplementedError("sgl_kernel CPU stand-in: the KDA recurrent update is not implemented")
    batch, seqlen, heads_v = v.shape[0], v.shape[1], v.shape[2]
    bounds = _bounds(cu_seqlens, batch, seqlen)
    qf, kf = _prepare_qk(q.flatten(0, 1), k.flatten(0, 1), heads_v, use_qk_l2norm_in_kernel, 1e-6, scale)
    vf = v.flatten(0, 1).float()
    gf, bf = _gates(
        A_log, a.reshape(-1, heads_v), b.reshape(-1, heads_v), dt_bias, softplus_beta, softplus_threshold
    )
    out = torch.zeros(v.shape, dtype=q.dtype).flatten(0, 1)
    for i in range(len(bounds) - 1):
        slot = int(initial_state_indices[i])
        state = (
            initial_state_source[slot].float()
            if slot >= 0
            else initial_state_source.new_zeros(initial_state_source.shape[1:], dtype=torch.float32)
        )
        row = int(intermediate_state_indices[i]) if intermediate_states_buffer is not None else -1
        for step, t in enumerate(range(bounds[i], bounds[i + 1])):
            if retrieve_parent_token is not None and step != 0 and row >= 0:
                state = intermediate_states_buffer[row, int(retrieve_parent_token[i, step])].float()
            state, o = _delta_step(state, qf[t], kf[t], vf[t], gf[t], bf[t])
            out[t] = o.to(out.dtype)
            if row >= 0:
                intermediate_states_buffer[row, step] = state.to(intermediate_states_buffer.dtype)
        if not disable_state_update and slot >= 0:
            initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out.view(v.shape)


# ---------------------------------------------------------------------------- projection, norm


def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_heads_qk: int,
    num_heads_v: int,
    head_qk: int,
    head_v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3.5's contiguous GDN projections [q | k | v | z] and [b | a] (per TP shard) split into
    mixed_qkv (tokens, 2 * H * K + HV * V), z (tokens, HV, V), b and a (tokens, HV)."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    if mixed_qkvz.shape[-1] != qkv_dim + num_heads_v * head_v or mixed_ba.shape[-1] != 2 * num_heads_v:
        raise ValueError(
            f"sgl_kernel CPU stand-in: qkvz {tuple(mixed_qkvz.shape)} / ba {tuple(mixed_ba.shape)} do "
            f"not hold {num_heads_qk} key heads of {head_qk} and {num_heads_v} value heads of {head_v}"
        )
    tokens = mixed_qkvz.shape[0]
    return (
        mixed_qkvz[:, :qkv_dim].contiguous(),
        mixed_qkvz[:, qkv_dim:].reshape(tokens, num_heads_v, head_v).contiguous(),
        mixed_ba[:, :num_heads_v].contiguous(),
        mixed_ba[:, num_heads_v:].contiguous(),
    )


def fused_rmsnorm_gated_cpu(input: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float):
    """The GDN output norm (``kernels/ops/attention/fla/layernorm_gated.py:524-527`` on CPU):
    RMSNorm over the last dim, times weight, times silu(gate), in float32; input's dtype out."""
    if gate.shape != input.shape or weight.shape != input.shape[-1:]:
        raise ValueError(
            f"sgl_kernel CPU stand-in: fused_rmsnorm_gated_cpu input {tuple(input.shape)}, gate "
            f"{tuple(gate.shape)}, weight {tuple(weight.shape)} do not match"
        )
    x = input.float()
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (normed * F.silu(gate.float())).to(input.dtype)


def fused_gate_sigmoid_mul(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    output: torch.Tensor,
    *,
    do_add: bool,
) -> None:
    """Qwen3-Next's (Qwen2-MoE's) gated shared expert, SGLang's
    ``kernels/ops/elementwise/elementwise.py`` ``_launch_fused_gate_sigmoid_mul`` (a Triton launch
    with no CPU branch, called at ``models/qwen2_moe.py:877``): output = sigmoid(hidden . gate)
    * shared, plus output when ``do_add``; float32 math, written into ``output``."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    result = gate * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result)


# ---------------------------------------------------------------------------- post-verify commit


def _scatter_steps(dst, src, dst_rows, steps, src_rows) -> None:
    """dst[l, dst_rows[i]] = src[l, src_rows[i], steps[i]] for every layer l and every request i
    with a step >= 0 and indices in range (what the Triton scatter kernels skip, this skips)."""
    steps = steps.long()
    dst_rows = dst_rows.long()
    src_rows = torch.arange(steps.shape[0]) if src_rows is None else src_rows.long()
    valid = (
        (steps >= 0)
        & (steps < src.shape[2])
        & (dst_rows >= 0)
        & (dst_rows < dst.shape[1])
        & (src_rows >= 0)
        & (src_rows < src.shape[1])
    )
    dst[:, dst_rows[valid]] = src[:, src_rows[valid], steps[valid]]


def scatter_mamba_states_after_mtp_verify(
    mamba_caches,
    state_indices_tensor: torch.Tensor,
    last_correct_step_indices: torch.Tensor,
    mamba_track_indices: torch.Tensor | None,
    mamba_steps_to_track: torch.Tensor | None,
    src_indices_raw: torch.Tensor | None = None,
) -> None:
    """Commit the accepted draft step's states after a verify (SGLang's
    ``kernels/ops/mamba/mamba_state_scatter_triton.py`` function of this name, whose kernels take
    only CUDA/XPU tensors): each request's ssm state and every conv window of its last accepted
    step go to its cache slot, and, where a track step is set, to its track slot.

    ``mamba_caches`` holds ``temporal`` [L, slots, ...] and ``intermediate_ssm`` [L, rows, steps,
    ...], and the lists ``conv`` [L, slots, dim, K - 1] and ``intermediate_conv_window`` [L, rows,
    steps, dim, K - 1] (an overlapping view in SGLang). The CPU-test plugin routes SGLang's
    function here."""
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += list(zip(mamba_caches.conv, mamba_caches.intermediate_conv_window))
    for dst, src in pairs:
        if dst.numel() == 0:
            continue
        _scatter_steps(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None:
            _scatter_steps(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)


# Called as torch.ops.sgl_kernel.<name> (gdn_backend.py:188, gdn_triton.py:31-33,
# qwen3_5.py:296-297, layernorm_gated.py:525).
TORCH_OPS = [
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_rmsnorm_gated_cpu",
]
