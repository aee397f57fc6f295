"""Rank-side functions for tests/test_adapters_*.py (run on every rank by run_tp_group)."""

from __future__ import annotations

import torch

from tests.rank_cases import _draft_head, _target_head

HIDDEN_SEED = 1


def hidden_rows(rows: int, hidden: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """The draft hidden states of one step (same on every rank, as under plain TP)."""
    gen = torch.Generator().manual_seed(HIDDEN_SEED * 1000 + step)
    return torch.randn(rows, hidden, generator=gen).to(dtype)


def draft_extend_buffer_logits(payload: dict) -> dict:
    """Draft-extend graph steps that hand the processor SGLang's shared logits buffer.

    The buffer is built as EagleDraftExtendCudaGraphRunner builds it when the draft config has
    no draft_vocab_size/hot_vocab_size: ``GraphSharedOutput.get_logits_buffer(len(hot_token_id),
    rows=max_bs)``, then ``buffer[:bs]`` per batch in the ForwardBatch/LogitsMetadata. Returns,
    per (layout, exchange, bs, path), the returned logits, whether they are the buffer's storage,
    and the buffer contents after the call.
    """
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden, max_bs = payload["vocab"], payload["hidden"], payload["max_bs"]
    dtype = getattr(torch, payload["dtype"])
    target, _ = _target_head(vocab, hidden, dtype, seed=0)
    shard = describe_head_shard(target)
    hot_token_id = canonical_hot_ids(torch.tensor(payload["map"]), vocab).ids
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    shared = GraphSharedOutput(device=torch.device("cpu"), max_rows=max_bs)
    buffer = shared.get_logits_buffer(len(hot_token_id), rows=max_bs)
    out = {"rank": shard.rank, "buffer_shape": tuple(buffer.shape)}
    step = 0
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot_token_id, shard.shard_ranges, layout)
        local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
        draft = _draft_head(vocab, hidden, dtype, local_head)
        for exchange in ("full", "topk"):
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, payload["topk"], "cpu")
            for bs in payload["batch_sizes"]:
                step += 1
                buffer.fill_(float("nan"))  # stale contents must not survive a step
                batch_buffer = buffer[:bs]
                # _get_logits as the draft-extend graph calls it (use_logits_buffer defaults to True).
                h = hidden_rows(bs, hidden, dtype, step)
                metadata = LogitsMetadata(
                    forward_mode=ForwardMode.DRAFT_EXTEND_V2, next_token_logits_buffer=batch_buffer
                )
                logits = processor._get_logits(h, draft, metadata, use_logits_buffer=True)
                out[(layout, exchange, bs, "get_logits")] = {
                    "step": step,
                    "logits": logits.clone(),
                    "in_buffer": logits.data_ptr() == batch_buffer.data_ptr(),
                    "buffer": batch_buffer.clone(),
                }
                # The whole forward, as the graph path runs it: the tree's rows go in and
                # draft_extend_select_index picks one row per request before the head.
                step += 1
                buffer.fill_(float("nan"))
                tree = hidden_rows(bs * payload["tree_width"], hidden, dtype, step)
                select = torch.arange(bs) * payload["tree_width"] + (torch.arange(bs) % payload["tree_width"])
                metadata = LogitsMetadata(
                    forward_mode=ForwardMode.DRAFT_EXTEND_V2,
                    next_token_logits_buffer=batch_buffer,
                    draft_extend_select_index=select,
                )
                result = processor(torch.zeros(tree.shape[0], dtype=torch.int64), tree, draft, metadata)
                logits = result.next_token_logits
                out[(layout, exchange, bs, "forward")] = {
                    "step": step,
                    "select": select,
                    "logits": logits.clone(),
                    "in_buffer": logits.data_ptr() == batch_buffer.data_ptr(),
                    "buffer": batch_buffer.clone(),
                }
    return out


def head_shard_cases(payload: dict) -> dict:
    """describe_head_shard / check_head_supported on real ParallelLMHeads of this rank.

    Run with DP attention and --enable-dp-lm-head so both the tp and attn_tp groups exist.
    Returns, per case, ("ok", group, rank, ranges, has_all_gather) or ("error", message).
    """
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    from sglang_frspec.adapters.head import check_head_supported, describe_head_shard
    from sglang_frspec.core import UnsupportedSetupError

    vocab, hidden, parallel = payload["vocab"], payload["hidden"], get_parallel()

    def outcome(head) -> tuple:
        try:
            shard = describe_head_shard(head)
            check_head_supported(head)
        except UnsupportedSetupError as e:
            return ("error", str(e))
        return ("ok", shard.group_name, shard.rank, shard.shard_ranges, shard.all_gather is not None)

    out = {"tp_rank": parallel.tp_rank, "attn_tp_rank": parallel.attn_tp_rank}
    out["tp"] = outcome(ParallelLMHead(vocab, hidden))
    out["attn_tp"] = outcome(ParallelLMHead(vocab, hidden, use_attn_tp_group=True))
    out["replicated"] = outcome(ParallelLMHead(vocab, hidden, enable_tp=False))

    def built_as(tp_rank: int, **kwargs):
        """A head built while the parallel context named another (consistent) rank, as a draft
        built under a patched group would be: its rows are not those its group position implies."""
        attn_tp_size = parallel.attn_tp_size
        with parallel.override(tp_rank=tp_rank, attn_tp_rank=tp_rank % attn_tp_size,
                               attn_dp_rank=tp_rank // attn_tp_size):  # fmt: skip
            return ParallelLMHead(vocab, hidden, **kwargs)

    next_tp_rank = (parallel.tp_rank + 1) % parallel.tp_size
    out["tp_other_rank"] = outcome(built_as(next_tp_rank))
    # The next rank of the same attention-TP group (same attention-DP rank).
    next_attn_rank = (parallel.attn_tp_rank + 1) % parallel.attn_tp_size
    other_attn = built_as(
        parallel.attn_dp_rank * parallel.attn_tp_size + next_attn_rank, use_attn_tp_group=True
    )
    out["attn_tp_other_rank"] = outcome(other_attn)
    return out
