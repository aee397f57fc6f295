"""Pure-torch versions of SGLang 0.5.23's EAGLE sampling ops (the sampling family).

- ``tree_speculative_sampling_target_only``: the CUDA kernel of
  ``kernels/jit/include/sgl_kernel/speculative/sampling.cuh`` (target-only tree verify).
- ``chain_speculative_sampling_triton``: the Triton kernel of ``kernels/ops/speculative/
  reject_sampling.py`` (rejection sampling, with ``--speculative-use-rejection-sampling``).
- ``row_argmax`` (Triton: the draft proposal's pick under rejection sampling) and the verify's
  top-k / top-p renormalisation of the target (``top_k_renorm_prob``, ``top_p_renorm_prob``),
  which SGLang leaves None on CPU.

Same arguments, same in-place outputs, same use of the uniform ``coins``; scalars are kept in
float32 as the kernels keep them, so a coin compares against the same float. Python loops: slow,
exact, for tiny test models. This file imports only torch (the tests load it on its own).
"""

import torch


def _first_above(values: torch.Tensor, u: torch.Tensor) -> int:
    """First index whose running sum exceeds ``u`` (-1 if none), the kernels' inverse-CDF step."""
    hits = torch.nonzero(torch.cumsum(values, dim=0) > u)
    return int(hits[0]) if hits.numel() else -1


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
):
    """Walk the tree from the root: a child is accepted while its coin is below the running target
    mass of the siblings tried; a rejected sibling's target mass is written into ``draft_probs``,
    and the bonus token is drawn from relu(target - draft) of the last accepted row."""
    num_spec = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    zero = torch.zeros((), dtype=torch.float32)
    t_single = torch.tensor(threshold_single, dtype=torch.float32)
    t_acc = torch.tensor(max(float(threshold_acc), 1e-9), dtype=torch.float32)
    for bx in range(candidates.shape[0]):
        prob_acc = zero.clone()
        row = 0  # the draft slot whose target row the next children are checked against
        coin = uniform_samples[bx, 0]
        last = int(retrive_index[bx, 0])
        accept_index[bx, 0] = last
        num_accepted = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[bx, cur])
            while cur != -1:
                token = int(candidates[bx, cur])
                p = target_probs[bx, row, token]
                prob_acc = prob_acc + p
                if p > 0 and (coin < prob_acc / t_acc or p >= t_single):
                    prob_acc = zero.clone()
                    row = cur
                    coin = uniform_samples[bx, cur]
                    predicts[last] = token
                    num_accepted += 1
                    last = int(retrive_index[bx, cur])
                    accept_index[bx, num_accepted] = last
                    break
                draft_probs[bx, row, token] = p
                cur = int(retrive_next_sibling[bx, cur])
            if cur == -1:
                break
        accept_token_num[bx] = num_accepted
        q = target_probs[bx, row]
        # there is no draft row for the bonus token after a fully accepted path
        p_draft = draft_probs[bx, row] if num_accepted != num_spec - 1 else torch.zeros_like(q)
        relu = torch.clamp(q - p_draft, min=0)
        u = uniform_samples_for_final_sampling[bx] * relu.sum()
        sampled = _first_above(relu, u)
        if sampled < 0:  # u at the very top of the mass: the last token with mass, else d - 1
            valid = torch.nonzero(relu > 0)
            sampled = int(valid[-1]) if valid.numel() else vocab - 1
        predicts[last] = sampled


def _is_prob(q: torch.Tensor) -> torch.Tensor:
    return (q > 0) & (q <= 1)


def chain_speculative_sampling_triton(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single,
    threshold_acc,
    deterministic,
    *,
    block_verification: bool = False,
):
    """Chain rejection sampling: accept draft i with min(1, p/q) (coin * q < p), or with block
    verification (arXiv 2403.10444, Algorithm 2) the longest prefix; the bonus token is drawn
    from relu(scale * p - q) of the first rejected row, or from p after a full acceptance."""
    num_slots = candidates.shape[1]
    vocab = target_probs.shape[-1]
    one = torch.ones((), dtype=torch.float32)
    for pid in range(candidates.shape[0]):
        T, D, coins = target_probs[pid], draft_probs[pid], uniform_samples[pid]
        last = int(retrive_index[pid, 0])
        accept_index[pid, 0] = last
        num_accept = 0
        residual_scale = one.clone()
        norm_sum = -one
        if block_verification:
            prefix_prob, prefix_probs = one.clone(), []
            for step in range(1, num_slots):
                token = int(candidates[pid, step])
                p, q = T[step - 1, token], D[step - 1, token]
                prefix_prob = torch.minimum(prefix_prob * p / q, one) if _is_prob(q) else 0 * one
                prefix_probs.append(prefix_prob)
            for step in range(num_slots - 1, 0, -1):
                prefix_prob, coin = prefix_probs[step - 1], coins[step - 1]
                if coin < prefix_prob:
                    accept_prob, residual_mass = prefix_prob, -one
                    if step < num_slots - 1 and 0 < prefix_prob < 1:
                        residual_mass = torch.clamp(prefix_prob * T[step] - D[step], min=0).sum()
                        accept_prob = residual_mass / (residual_mass + 1.0 - prefix_prob)
                    if coin < accept_prob:
                        num_accept, residual_scale, norm_sum = step, prefix_prob, residual_mass
                        break
            for step in range(1, num_accept + 1):
                predicts[last] = candidates[pid, step]
                last = int(retrive_index[pid, step])
                accept_index[pid, step] = last
        else:
            for step in range(1, num_slots):
                token = int(candidates[pid, step])
                p, q = T[step - 1, token], D[step - 1, token]
                if not (_is_prob(q) and coins[step - 1] * q < p):
                    break
                num_accept += 1
                predicts[last] = token
                last = int(retrive_index[pid, step])
                accept_index[pid, num_accept] = last
        accept_token_num[pid] = num_accept
        row = num_accept
        if num_accept == num_slots - 1:
            residual = T[row]
        else:  # any non-probability q (NaN, inf, negative) counts as 0
            q_row = D[row]
            q_row = torch.where((q_row >= 0) & (q_row <= 1), q_row, torch.zeros_like(q_row))
            residual = torch.clamp(residual_scale * T[row] - q_row, min=0)
        if norm_sum < 0:
            norm_sum = residual.sum()
        sampled = _first_above(residual, uniform_samples_for_final_sampling[pid] * norm_sum)
        predicts[last] = sampled if sampled >= 0 else vocab - 1


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``kernels/ops/speculative/row_argmax.py`` (Triton): the draft proposal's Gumbel-max pick,
    ``x.argmax(-1)`` of float32 rows, ties to the lowest index."""
    return x.argmax(dim=-1)


def _renorm_from_pivots(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Keep each row's probabilities >= its pivot (ties at the pivot kept), renormalised."""
    kept = torch.where(probs >= pivots.unsqueeze(1), probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=1, keepdim=True)


def _per_row(value, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or one value per row, as one value per row."""
    return torch.as_tensor(value, dtype=dtype).reshape(-1).expand(rows)


def top_k_renorm_prob(probs: torch.Tensor, top_k) -> torch.Tensor:
    """FlashInfer's ``top_k_renorm_probs`` (SGLang's ``renorm_triton.top_k_renorm_probs_triton`` on
    ROCm): the k highest probabilities of each row and every tie at the k-th, renormalised."""
    probs = probs.float()
    rows, vocab = probs.shape
    cutoff = (_per_row(top_k, rows, torch.int64) - 1).clamp(min=0, max=vocab - 1)
    pivots = torch.sort(probs, dim=-1, descending=True).values.gather(1, cutoff.unsqueeze(1)).squeeze(1)
    return _renorm_from_pivots(probs, pivots)


def top_p_renorm_prob(probs: torch.Tensor, top_p) -> torch.Tensor:
    """FlashInfer's ``top_p_renorm_probs`` (as ``renorm_triton.top_p_renorm_probs_triton``): drop the
    ascending prefix whose cumulative mass is below 1 - p, keep every tie at the pivot, renormalise."""
    probs = probs.float()
    rows, vocab = probs.shape
    ascending = torch.sort(probs, dim=-1).values
    threshold = (1.0 - _per_row(top_p, rows, torch.float32)).unsqueeze(1)
    cutoff = torch.searchsorted(torch.cumsum(ascending, dim=-1), threshold).squeeze(1).clamp(max=vocab - 1)
    return _renorm_from_pivots(probs, ascending.gather(1, cutoff.unsqueeze(1)).squeeze(1))
