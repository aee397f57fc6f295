"""Rank-side functions of the adaptive map's tests (run on every rank by run_tp_group): swapped
rows crossing ranks, the adapter on a quantized head, and the adapter's refusals at build time."""

from __future__ import annotations

import torch

from tests.rank_cases import _target_head


def swapped_rows(payload: dict) -> dict:
    """A plain head under the balanced layout: swaps whose new rows live on other ranks' shards,
    applied with ``place_hot_rows`` in steps of ``chunk_bytes``, then a weight refresh over the
    swapped (no longer sorted) ids from new weights. Returns this rank's head after each, whether
    it kept its address, the bytes each all-gather of the swaps received and the total it returned."""
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from sglang_frspec.core.gather import place_hot_rows, shard_row_reader

    vocab, hidden = payload["vocab"], payload["hidden"]
    target, _ = _target_head(vocab, hidden, torch.float32, seed=0)
    shard = describe_head_shard(target)
    plan = plan_from_ranges(torch.tensor(payload["hot"]), shard.shard_ranges, "balanced")
    head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
    address = head.data_ptr()
    gathered = []

    def all_gather(output: torch.Tensor, local: torch.Tensor) -> None:
        gathered.append(output.numel() * output.element_size())
        shard.all_gather(output, local)

    positions, ids_in = torch.tensor(payload["positions"]), torch.tensor(payload["ids_in"])
    returned = place_hot_rows(shard_row_reader(target.weight), ids_in, plan, shard.rank, all_gather, head,
                              positions=positions, chunk_bytes=payload["chunk_bytes"])  # fmt: skip
    plan.hot_ids.index_copy_(0, positions, ids_in)  # as the adapter does
    out = {"rank": shard.rank, "swapped": head.clone(), "gathered": gathered, "returned": returned}
    _, new_full = _target_head(vocab, hidden, torch.float32, seed=1)
    start, end = shard.shard_ranges[shard.rank]
    target.weight.data[: end - start].copy_(new_full[start:end])  # a weight update, in place
    build_local_head(target.weight, plan, shard.rank, shard.all_gather, out=head)
    out["refreshed"] = head.clone()
    out["in_place"] = head.data_ptr() == address
    return out


def _adapter(shard, layout: str, hot: list[int], vocab: int):
    """The adapter as the coverage hook builds it (interval 1, no protected id), with its counts."""
    from sglang_frspec.adapters.adapt import HotSetAdapter
    from sglang_frspec.adapters.head import build_hot_head
    from sglang_frspec.adapters.worker import FrSpecDraftHead
    from sglang_frspec.core import plan_from_ranges
    from sglang_frspec.core.coverage import CommittedTokenCounts
    from sglang_frspec.core.options import FrSpecOptions

    plan = plan_from_ranges(torch.tensor(hot), shard.shard_ranges, layout)
    local_head = build_hot_head(shard, plan, torch.float32)
    head = FrSpecDraftHead(plan, shard, FrSpecOptions(layout=layout, adapt=True), local_head)
    hot_token_id = plan.hot_ids.clone()  # a tensor of its own, as init_lm_head sets it
    counts = CommittedTokenCounts(hot_token_id, vocab)
    return HotSetAdapter(head, hot_token_id, counts, 1, ()), counts


def _decided(adapter, shard) -> dict:
    """What an adaptation decision left on this rank: the map, its head rows, its columns."""
    plan = adapter.head.plan
    return {
        "hot_ids": plan.hot_ids.clone(),
        "head": adapter.head.local_head.clone(),
        "columns": (plan.offsets[shard.rank], plan.counts[shard.rank]),
        "swapped": adapter.swapped,
    }


def fp8_head_adapts(payload: dict) -> dict:
    """A real ModelOpt FP8 ParallelLMHead (SGLang's stored, transposed layout): the adapter swaps
    the committed ids in under each layout. Returns, per layout, the hot ids and this rank's hot
    head after the decision and the hot positions it computes."""
    from sglang_frspec.adapters.head import check_head_supported, describe_head_shard
    from tests.rank_cases_quantized import fp8_checkpoint, modelopt_fp8_head

    vocab, hidden = payload["vocab"], payload["hidden"]
    module = modelopt_fp8_head(vocab, hidden, *fp8_checkpoint(vocab, hidden, seed=0)[:2])
    check_head_supported(module)
    shard = describe_head_shard(module)
    out = {"rank": shard.rank, "stored": tuple(module.weight.shape), "dtype": module.weight.dtype}
    committed = torch.tensor(payload["committed"] * 3)  # three times each: beats the margin
    for layout in ("local", "balanced"):
        adapter, counts = _adapter(shard, layout, payload["hot"], vocab)
        counts.add(committed, torch.tensor([committed.numel()]), committed.numel())
        adapter.after_verify()  # rank 0 decides, every rank applies
        out[layout] = _decided(adapter, shard)
    return out


def adapter_refusal(payload: dict) -> str | None:
    """Build the adapter on this rank (plain head, balanced layout); the error it raises, if any."""
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.core import UnsupportedSetupError

    target, _ = _target_head(payload["vocab"], payload["hidden"], torch.float32, seed=0)
    shard = describe_head_shard(target)
    try:
        _adapter(shard, "balanced", payload["hot"], payload["vocab"])
    except UnsupportedSetupError as e:
        return str(e)
    return None


def adapter_after_replaced_weights(payload: dict) -> dict:
    """A weight update that replaces the head's tensor instead of copying into it, then the refresh
    the update hook runs, then a decision: for a vocab-parallel ``ParallelLMHead`` whose
    ``weight`` becomes a new ``Parameter``, and for a table every rank holds whole (Gemma 3's tied
    head) whose ``weight.data`` is set to new storage (as SGLang's post-load staging does). Returns,
    per case, the hot ids and this rank's hot head after the decision and the hot positions it
    computes."""
    from sglang_frspec.adapters.head import describe_head_shard, describe_table_slice
    from sglang_frspec.core import table_slice_ranges

    vocab, hidden = payload["vocab"], payload["hidden"]
    new_full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1))
    target, _ = _target_head(vocab, hidden, torch.float32, seed=0)
    table = torch.nn.Embedding(vocab, hidden)
    table.weight.data.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)))
    shard = describe_head_shard(target)
    start, end = table_slice_ranges(vocab, shard.tp_size)[shard.rank]
    shards = {"vocab_parallel": shard, "replicated": describe_table_slice(table, table.weight[start:end])}
    committed = torch.tensor(payload["committed"] * 3)  # three times each: beats the margin
    out = {"rank": shard.rank}
    for case, shard in shards.items():
        adapter, counts = _adapter(shard, "balanced", payload["hot"], vocab)
        if case == "vocab_parallel":
            first, last = shard.shard_ranges[shard.rank]
            rows = torch.zeros_like(target.weight)  # padding rows stay zero
            rows[: last - first] = new_full[first:last]
            target.weight = torch.nn.Parameter(rows, requires_grad=False)
        else:
            table.weight.data = new_full.clone()
        adapter.head.refresh()  # what the weight-update hook runs on every rank
        counts.add(committed, torch.tensor([committed.numel()]), committed.numel())
        adapter.after_verify()  # rank 0 decides, every rank applies
        out[case] = _decided(adapter, shard)
    return out


def start_up_swap_refresh(payload: dict) -> dict:
    """The plugin's start-up (``init_lm_head`` and the coverage hook after it, with the adaptive map
    on), an adaptive swap of committed ids outside the map, then a weight update in place (the
    target's head times 1.5) and the head refresh the update hook runs. Returns this rank's
    ``hot_token_id``, the plan's ids, its hot head and the hot positions it computes."""
    from sglang.srt.plugins import load_plugins

    from sglang_frspec.adapters.state import state_of
    from tests.rank_cases_graphs import plugin_worker

    load_plugins()
    worker = plugin_worker(payload)
    state = state_of(worker)
    committed = torch.tensor(payload["committed"] * 3)  # three times each: beats the margin
    state.coverage.counts.add(committed, torch.tensor([committed.numel()]), committed.numel())
    state.coverage.adapter.after_verify()  # rank 0 decides, every rank applies
    with torch.no_grad():
        worker.target_worker.model_runner.model.lm_head.weight.mul_(1.5)
    state.head.refresh()
    plan, rank = state.head.plan, state.head.shard.rank
    return {
        "hot_token_id": worker.hot_token_id.clone(),
        "plan_ids": plan.hot_ids.clone(),
        "head": state.head.local_head.clone(),
        "columns": (plan.offsets[rank], plan.counts[rank]),
    }
