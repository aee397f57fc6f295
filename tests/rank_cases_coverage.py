"""Rank-side functions (run on every rank by run_tp_group) of the coverage tests."""

from __future__ import annotations

import torch

from tests.rank_cases import _target_head


def adaptive_metrics_export(payload: dict) -> dict:
    """The coverage seam's hooks on a real hot head with the adaptive map on (local layout), fed
    SGLang's own verify results: ``phases`` of (committed ids, steps), one request committing
    all the ids at each step, exported after each phase to the Prometheus counters of SGLang's
    own scheduler collector (``SchedulerMetricsCollector.init_new``, ``--enable-metrics``).
    Returns, per phase, the exported in-map and committed values and an independent count of
    the committed tokens the draft worker's ``hot_token_id`` held at the step that committed
    them; and the ids swapped in."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.runtime_context import get_server_args

    from sglang_frspec.adapters import coverage as seam
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.state import FrSpecState
    from sglang_frspec.adapters.worker import FrSpecDraftHead
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from sglang_frspec.core.options import FrSpecOptions

    target, _ = _target_head(payload["vocab"], payload["hidden"], torch.float32, seed=0)
    shard = describe_head_shard(target)
    plan = plan_from_ranges(torch.tensor(payload["map"]), shard.shard_ranges, "local")
    head = FrSpecDraftHead(
        plan,
        shard,
        FrSpecOptions(layout="local", adapt=True, adapt_interval=1),
        build_local_head(target.weight, plan, shard.rank, shard.all_gather),
    )
    # The draft worker's side that the seam reads (what init_lm_head leaves on an EagleDraftWorker).
    worker = SimpleNamespace(
        frspec=FrSpecState("map.pt", None, None, head=head),
        hot_token_id=plan.hot_ids.to(target.weight.device, copy=True),  # as init_lm_head sets it
        target_worker=SimpleNamespace(model_config=SimpleNamespace(hf_eos_token_id=None)),
    )
    seam.install_after_init_lm_head(None, worker)
    coverage = worker.frspec.coverage
    collector = SchedulerMetricsCollector.init_new(
        server_args=get_server_args(),
        enable_priority_scheduling=False,
        enable_lora=False,
        enable_hierarchical_cache=False,
    ).collector
    labels = {name: str(value) for name, value in collector.labels.items()}
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    in_map_then, phases = 0, []
    for ids, steps in payload["phases"]:
        for _ in range(steps):
            held = set(worker.hot_token_id.tolist())  # before this step's decision
            result = GenerationBatchResult(
                next_token_ids=torch.tensor(ids),
                accept_lens=torch.tensor([len(ids)]),
                speculative_num_draft_tokens=len(ids),
                speculative_output_stride=len(ids),
            )
            seam.count_after_verify(result, worker, decode)
            in_map_then += sum(1 for i in ids if i in held)
        seam._export(coverage, coverage.counts.snapshot().result(), collector)
        phases.append(
            {
                "in_map": REGISTRY.get_sample_value(seam.IN_MAP_METRIC, labels),
                "committed": REGISTRY.get_sample_value(seam.COMMITTED_METRIC, labels),
                "swaps": REGISTRY.get_sample_value(seam.SWAPS_METRIC, labels),
                "in_map_then": in_map_then,
            }
        )
    return {"phases": phases, "hot_ids": sorted(worker.hot_token_id.tolist())}
