"""Functions run on every rank of a real SGLang gloo TP group: the draft distribution that
rejection sampling reads (see tests/test_hot_probs.py)."""

from __future__ import annotations

import torch

from tests.rank_cases import _draft_head, _target_head


def draft_probs_over_vocab(payload: dict) -> dict:
    """For each layout and requested exchange, with rejection sampling on: the exchange the
    processor runs, and the draft's hot probabilities at temperature ``payload["temperature"]``
    laid over the target vocab as verify reads them; plus the reference logits ``h @ W[ids].T``
    of the full checkpoint over ``sorted(set(ids))``."""
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges
    from sglang_frspec.core.hot_probs import lay_hot_probs_over_vocab

    vocab, hidden, ids = payload["vocab"], payload["hidden"], payload["ids"]
    target, full = _target_head(vocab, hidden, torch.float32, seed=0)
    shard = describe_head_shard(target)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    hidden_states = torch.randn(payload["rows"], hidden, generator=torch.Generator().manual_seed(1))
    hot = canonical_hot_ids(torch.tensor(ids), vocab).ids
    out = {"reference": hidden_states @ full[torch.tensor(sorted(set(ids)))].T}
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        draft = _draft_head(vocab, hidden, torch.float32, build_local_head(target.weight, plan, shard.rank,
                                                                          shard.all_gather))  # fmt: skip
        for exchange in ("full", "topk"):
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, payload["topk"], "cpu",
                                              needs_distribution=True)  # fmt: skip
            logits = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
            probs = torch.softmax(logits / payload["temperature"], dim=-1)
            out[(layout, exchange)] = (
                processor.exchange,
                lay_hot_probs_over_vocab(probs, plan.hot_ids, vocab),
            )
    return out
