"""The draft's hot-column probabilities laid over the target vocab, for rejection sampling.

SGLang's rejection-sampling verify (``chain_speculative_sampling_triton``) reads the draft
distribution q as ``[bs, steps, V]`` over the target vocab and accepts a draft token t with
min(1, p(t) / q(t)); the bonus token comes from relu(p - q). A hot-vocab draft samples only hot
ids, so q is its softmax over the H hot columns at those ids and exactly zero elsewhere: tokens
outside the map keep their full target mass in relu(p - q), which keeps the sampling exact.
"""

from __future__ import annotations

import torch


def lay_hot_probs_over_vocab(hot_probs: torch.Tensor, hot_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., H]`` probabilities whose column j is token ``hot_ids[j]`` -> ``[..., vocab_size]``,
    zero outside the map. ``hot_ids`` must be distinct (the plan's canonical ids)."""
    if hot_probs.shape[-1] != hot_ids.numel():
        raise ValueError(f"{hot_probs.shape[-1]} probability columns for {hot_ids.numel()} hot ids")
    out = hot_probs.new_zeros((*hot_probs.shape[:-1], vocab_size))
    return out.index_copy_(-1, hot_ids.to(hot_probs.device), hot_probs)


def one_hot_probs(index: torch.Tensor, width: int) -> torch.Tensor:
    """``[...]`` column indices -> ``[..., width]`` float32 probabilities, one at each index: the
    proposal q of a draft taken with certainty (a PD decode node receives drafts, not their q)."""
    probs = torch.zeros((*index.shape, width), dtype=torch.float32, device=index.device)
    return probs.scatter_(-1, index.unsqueeze(-1), 1.0)
