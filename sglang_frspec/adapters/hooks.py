"""The one table of the SGLang hooks this plugin installs: target, handler, hook type.

``plugin.register()`` loops over ``HOOKS``, ``contract.CONTRACT`` checks every target's signature,
and the tests read it. Targets are spelled as the contract spells them (``module:Qualified.name``);
handlers are ``module:function`` of this package, imported only once the contract holds (they
import SGLang). Hooks on one target wrap in table order: a later hook wraps an earlier one. This
module imports nothing from SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKER = "sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker"
EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2"
DRAFT_GRAPH = "sglang.srt.speculative.eagle_draft_cuda_graph_runner:EAGLEDraftCudaGraphRunner"
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater:SchedulerWeightUpdaterManager"
REPORTER = "sglang.srt.managers.scheduler_components.metrics_reporter:SchedulerMetricsReporter"
SCHEDULER = "sglang.srt.managers.scheduler:Scheduler"
# Handler modules of this package.
ON_WORKER = "sglang_frspec.adapters.worker:"
ON_COVERAGE = "sglang_frspec.adapters.coverage:"
ON_PD = "sglang_frspec.adapters.pd:"


@dataclass(frozen=True)
class Hook:
    target: str  # "module:Qualified.name" in SGLang
    handler: str  # "module:function" in this package
    kind: str  # a HookType member name: BEFORE, AFTER or AROUND
    params: str | None  # the target's parameters the handler relies on (None: passed through)


HOOKS: tuple[Hook, ...] = (
    # worker.py: the map and the hot head, at start-up (every scheduler rank, before graph capture)
    Hook(f"{WORKER}.init_token_map", f"{ON_WORKER}around_init_token_map", "AROUND", "(self)"),
    Hook(f"{WORKER}.init_lm_head", f"{ON_WORKER}around_init_lm_head", "AROUND", "(self)"),
    # worker.py: rejection sampling with a map (stock's start-up refusal lifted, hot probs laid
    # over the target vocab for verify)
    Hook(
        f"{WORKER}.alloc_memory_pool",
        f"{ON_WORKER}around_alloc_memory_pool",
        "AROUND",
        "(self, memory_pool_config=, req_to_token_pool=, token_to_kv_pool_allocator=)",
    ),
    Hook(f"{WORKER}.draft", f"{ON_WORKER}after_draft", "AFTER", "(self, batch, *, with_topology=)"),
    # ... and every q the draft-decode CUDA graph reads made H wide: its buffer, an idle batch's
    Hook(
        f"{DRAFT_GRAPH}.capture_one_shape",
        f"{ON_WORKER}around_draft_graph_capture_one_shape",
        "AROUND",
        "(self, size, forward, stream_idx=, variant_label=, attention_variant=)",
    ),
    Hook(f"{WORKER}.draft", f"{ON_WORKER}before_draft", "BEFORE", "(self, batch, *, with_topology=)"),
    # coverage.py: counters over the hot head installed just above (this hook wraps that one)
    Hook(f"{WORKER}.init_lm_head", f"{ON_COVERAGE}install_after_init_lm_head", "AFTER", "(self)"),
    Hook(
        f"{EAGLE_V2}.verify",
        f"{ON_COVERAGE}count_after_verify",
        "AFTER",
        "(self, batch, pp_proxy_tensors=, grammar_barrier=)",
    ),
    Hook(f"{REPORTER}.report_decode_stats", f"{ON_COVERAGE}report_after_decode_stats", "AFTER", None),
    Hook(f"{SCHEDULER}.on_idle", f"{ON_COVERAGE}publish_after_idle", "AFTER", "(self)"),
    Hook(f"{SCHEDULER}.release_host_resources", f"{ON_COVERAGE}flush_after_release", "AFTER", "(self)"),
    # pd.py: hot indices between prefill and decode nodes, in stock's order on the wire
    Hook(
        "sglang.srt.disaggregation.utils:MetadataBuffers.set_buf",
        f"{ON_PD}to_wire_before_set_buf",
        "BEFORE",
        "(self, req)",
    ),
    Hook(
        "sglang.srt.speculative.eagle_disaggregation:build_eagle_disagg_draft_input",
        f"{ON_PD}from_wire_around_draft_input",
        "AROUND",
        "(batch, last_tokens_tensor, future_map)",
    ),
    # worker.py: weight updates; one-call updates, and the end of a begin/end session (tensor,
    # distributed and P2P/RDMA updates)
    *(
        Hook(f"{WEIGHT_UPDATER}.{method}", f"{ON_WORKER}refresh_after_complete_update", "AFTER", None)
        for method in ("update_weights_from_disk", "update_weights_from_ipc")
    ),
    Hook(f"{WEIGHT_UPDATER}.end_weight_update", f"{ON_WORKER}refresh_after_session_end", "AFTER", None),
)


def hook_target(target: str) -> str:
    """The dotted path ``HookRegistry.register`` takes for a contract target."""
    return target.replace(":", ".")


def hooked_targets(handler: str) -> list[str]:
    """The dotted targets a handler is registered on (for checks that the hooks are active)."""
    return [hook_target(h.target) for h in HOOKS if h.handler == handler]
