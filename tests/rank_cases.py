"""Functions run on every rank of a real SGLang gloo TP group (see run_tp_group)."""

from __future__ import annotations

import torch


def _target_head(vocab: int, hidden: int, dtype: torch.dtype, seed: int):
    """A real vocab-parallel ParallelLMHead loaded from the same full 'checkpoint' on all ranks."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    head.weight_loader(head.weight, full)  # SGLang's loader slices this rank's shard
    return head, full


def _draft_head(vocab: int, hidden: int, dtype: torch.dtype, weight: torch.Tensor):
    """A draft ParallelLMHead whose weight is swapped like ``set_embed_and_head`` does."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    del head.weight
    head.weight = weight
    return head


def hot_logits(payload: dict) -> dict:
    """Draft logits of the plugin's processor for every (map, layout, exchange) case.

    Returns, per case, this rank's logits, the exchange the processor chose, plus the
    independent single-rank reference ``h @ W[hot].T`` computed from the full checkpoint, whose
    columns are ``sorted(set(ids))`` (not the plugin's own canonicalisation).
    """
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden = payload["vocab"], payload["hidden"]
    dtype = getattr(torch, payload.get("dtype", "float32"))
    target, full = _target_head(vocab, hidden, dtype, seed=0)
    shard = describe_head_shard(target)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    hidden_states = torch.randn(payload["rows"], hidden, generator=torch.Generator().manual_seed(1))
    hidden_states = hidden_states.to(dtype)
    out = {"rank": shard.rank, "ranges": shard.shard_ranges}
    for name, ids in payload["maps"].items():
        hot = canonical_hot_ids(torch.tensor(ids), vocab).ids
        columns = torch.tensor(sorted(set(ids)))
        reference = (hidden_states.float() @ full[columns].float().T).float()
        for layout in payload["layouts"]:
            plan = plan_from_ranges(hot, shard.shard_ranges, layout)
            local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
            draft = _draft_head(vocab, hidden, dtype, local_head)
            for exchange in payload["exchanges"]:
                processor = FrSpecLogitsProcessor(config, plan, shard, exchange, payload["topk"], "cpu")
                logits = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
                out[(name, layout, exchange)] = {
                    "logits": logits,
                    "exchange": processor.exchange,
                    "reference": reference,
                    "counts": plan.counts,
                    "local_rows": local_head.shape[0],
                }
    return out


def agree(payload: dict) -> dict[str, str]:
    """For each case of ``payload["cases"]`` (name -> its ``maps``, one per rank, and PD ``mode``),
    each rank's draft worker runs the plugin's start-up (its ``init_lm_head`` hook, which checks
    the map and joins the agreement step; on a PD node, with the map file's order) with its own
    map's ids, on this one group; returns, per case, the error text or "agreed"."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel

    from sglang_frspec.core import TokenMapError
    from tests.harness.tp_group import republish
    from tests.rank_cases_graphs import plugin_worker

    load_plugins()
    out = {}
    for name, case in payload["cases"].items():
        republish(disaggregation_mode=case["mode"])  # what get_disagg() tells the start-up
        try:
            plugin_worker(payload | {"map_ids": case["maps"][get_parallel().tp_rank]})
        except TokenMapError as e:
            out[name] = str(e)
        else:
            out[name] = "agreed"
    return out


def dp_lm_head_logits(payload: dict) -> dict:
    """Under DP attention with --enable-dp-lm-head the head is sharded over the attention-TP
    group; build it as Llama does and check the plugin plans and gathers on that group."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden, parallel = payload["vocab"], payload["hidden"], get_parallel()
    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    target = ParallelLMHead(vocab, hidden, params_dtype=torch.float32,
                            use_attn_tp_group=parallel.enable_dp_lm_head)  # fmt: skip
    target.weight_loader(target.weight, full)
    shard = describe_head_shard(target)
    hot = canonical_hot_ids(torch.tensor(payload["map"]), vocab).ids
    # Each DP rank has its own tokens: the hidden states differ between attention-TP groups.
    hidden_states = torch.randn(3, hidden, generator=torch.Generator().manual_seed(parallel.attn_dp_rank))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    out = {"tp_rank": parallel.tp_rank, "attn_dp_rank": parallel.attn_dp_rank,
           "group": shard.group_name, "shard_rank": shard.rank, "ranges": shard.shard_ranges}  # fmt: skip
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
        processor = FrSpecLogitsProcessor(config, plan, shard, "full", 2, "cpu")
        assert not processor.do_tensor_parallel_all_gather_dp_attn
        draft = _draft_head(vocab, hidden, torch.float32, local_head)
        out[layout] = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
    out["reference"] = hidden_states @ full[sorted(set(payload["map"]))].T  # independent columns
    return out


def dp_attention_logits(payload: dict) -> dict:
    """DP attention without --enable-dp-lm-head: the head is sharded over the whole TP group and
    each DP rank brings its own rows (some none); the processor's inherited DP gather/scatter
    must hand every rank the hot logits of its own rows."""
    from sglang.srt.layers.dp_attention import DpPaddingMode, _DpGatheredBufferWrapper
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden, parallel = payload["vocab"], payload["hidden"], get_parallel()
    rows_per_dp_rank = payload["rows_per_dp_rank"]
    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    target = ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
    target.weight_loader(target.weight, full)
    shard = describe_head_shard(target)
    hot = canonical_hot_ids(torch.tensor(payload["map"]), vocab).ids
    _DpGatheredBufferWrapper.set_metadata(hidden, torch.float32, torch.device("cpu"))
    local_rows = rows_per_dp_rank[parallel.attn_dp_rank]
    hidden_states = torch.randn(
        local_rows, hidden, generator=torch.Generator().manual_seed(parallel.attn_dp_rank)
    )
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    out = {"attn_dp_rank": parallel.attn_dp_rank, "group": shard.group_name, "ranges": shard.shard_ranges}
    for layout in ("local", "balanced"):
        for exchange in ("full", "topk"):
            plan = plan_from_ranges(hot, shard.shard_ranges, layout)
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, 2, "cpu")
            assert processor.do_tensor_parallel_all_gather_dp_attn
            local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
            draft = _draft_head(vocab, hidden, torch.float32, local_head)
            metadata = LogitsMetadata(
                forward_mode=ForwardMode.DECODE,
                global_num_tokens_for_logprob_cpu=list(rows_per_dp_rank),
                global_num_tokens_for_logprob_gpu=torch.tensor(rows_per_dp_rank),
                global_num_tokens_gpu=torch.tensor(rows_per_dp_rank),
                dp_padding_mode=DpPaddingMode.SUM_LEN,
            )
            out[f"{layout}/{exchange}"] = processor._get_logits(
                hidden_states, draft, metadata, use_logits_buffer=False
            )
    out["reference"] = hidden_states @ full[sorted(set(payload["map"]))].T  # independent columns
    return out


def store_after_rank0_returns(payload: dict) -> int:
    """Rank 0 returns at once; the others then create a group through rank 0's TCPStore.

    SGLang's ``initialize_model_parallel`` ends like this: a rank outside the last groups leaves
    while their members still rendezvous through the store that rank 0's process serves.
    """
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    if rank:
        time.sleep(payload["delay"])
        group = dist.new_group(list(range(1, dist.get_world_size())), use_local_synchronization=True)
        dist.barrier(group=group)
    return rank


def degenerate_rows(payload: dict) -> dict:
    """Rows of zeros, NaNs, all -inf and fewer than k finite logits through the processor.

    The target head's column 0 is 1e10 except at ``finite_ids`` and column 1 is 1e10 everywhere,
    so a hidden state of -1e30 in dimension 1 makes every logit -inf (fp32 overflow) and one in
    dimension 0 every logit but those of ``finite_ids``. Returns, per (layout, exchange), this
    rank's logits and the draft's pick from them (SGLang's softmax + ``fast_topk`` and the map to
    token ids, as ``draft_forward`` does), with the single-rank reference ``h @ W[hot].T``.
    """
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.utils.common import fast_topk
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden, topk = payload["vocab"], payload["hidden"], payload["topk"]

    full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    full[:, 0] = 1e10
    full[payload["finite_ids"], 0] = 0.0
    full[:, 1] = 1e10
    target = ParallelLMHead(vocab, hidden)
    target.weight_loader(target.weight, full)
    shard = describe_head_shard(target)
    states = torch.randn(6, hidden, generator=torch.Generator().manual_seed(1))
    states[:, :2] = 0.0  # rows 4, 5: ordinary logits
    states[0] = 0.0  # all zero
    states[1] = float("nan")  # all NaN
    states[2, 1] = -1e30  # all -inf
    states[3, 0] = -1e30  # finite only at finite_ids
    hot = canonical_hot_ids(torch.tensor(payload["ids"]), vocab).ids
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    out = {"reference": states @ full[hot].T, "hot": hot}
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
        for exchange in ("full", "topk"):
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, topk, "cpu")
            draft = _draft_head(vocab, hidden, torch.float32, local_head)
            logits = processor._get_logits(states, draft, None, use_logits_buffer=False)
            _, picked = fast_topk(torch.softmax(logits, dim=-1), topk, dim=-1)
            out[(layout, exchange)] = {"logits": logits, "picked": picked, "counts": plan.counts,
                                       "exchange": processor.exchange}  # fmt: skip
    return out


def exchange_ties(payload: dict) -> dict:
    """Both exchanges of given hot logits on this group, and the draft's picks from each.

    ``payload["logits"]`` is ``[rows, H]`` float32 over the canonical hot ids ``payload["ids"]``
    (ties, NaN, -inf: values no GEMM of a random head would give). Each rank takes the columns
    its plan computes, as its head GEMM would, and runs ``HotLogitsExchange.full`` and ``.topk``
    over SGLang's group. Per (layout, k): both [rows, H] results and, from each, SGLang's picks
    for EAGLE's top-k (``renorm_draft_probs`` + ``fast_topk``) and the CPU top-1 argmax.
    """
    from sglang.srt.speculative.spec_utils import renorm_draft_probs
    from sglang.srt.utils.common import fast_topk

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.core import HotLogitsExchange, plan_from_ranges

    target, _ = _target_head(payload["vocab"], 16, torch.float32, seed=0)
    shard = describe_head_shard(target)
    logits, hot = payload["logits"], torch.tensor(payload["ids"])
    out = {"rank": shard.rank}
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)
        exchange = HotLogitsExchange(plan, shard.rank)
        local = torch.zeros(logits.shape[0], plan.width)
        local[:, : exchange.count] = logits[:, exchange.offset : exchange.offset + exchange.count]
        full = exchange.full(local, shard.all_gather)
        for k in payload["ks"]:
            merged = exchange.topk(local, k, shard.all_gather)
            case = {"full": full, "topk": merged}
            for name in ("full", "topk"):
                case[f"{name}_picks"] = fast_topk(renorm_draft_probs(case[name], None, False), k, dim=-1)[1]
                case[f"{name}_argmax"] = torch.argmax(case[name], dim=-1)
            out[(layout, k)] = case
    return out
