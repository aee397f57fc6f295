"""The one table of the SGLang hooks this plugin installs, and where SGLang releases differ.

``HOOKS`` holds the hooks every supported release takes: target, handler, hook type.
``VARIANTS`` holds each seam where the supported releases differ: its forms, each named by the
contract entries that identify it in an SGLang and carrying the hooks installed with it. The
running SGLang takes, per seam, the first form whose entries hold (read from its
signatures and names at start-up, never from its version string; ``contract.running_forms``).

``plugin.register()`` installs ``HOOKS`` plus the chosen forms' hooks, ``contract`` checks every
target's signature, and the tests read both. Targets are spelled as the contract spells them
(``module:Qualified.name``); handlers are ``module:function`` of this package, imported only once
the contract holds (they import SGLang). Hooks on one target wrap in table order: a later hook
wraps an earlier one. This module imports nothing from SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_frspec.adapters.contract_check import Attribute, Entry, Signature

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
    Hook(f"{WORKER}.draft", f"{ON_WORKER}after_draft", "AFTER", None),  # (self, batch, ...): VARIANTS
    # ... and every q the draft-decode CUDA graph reads made H wide: its buffer, an idle batch's
    Hook(
        f"{DRAFT_GRAPH}.capture_one_shape",
        f"{ON_WORKER}around_draft_graph_capture_one_shape",
        "AROUND",
        "(self, size, forward, stream_idx=, variant_label=, attention_variant=)",
    ),
    Hook(f"{WORKER}.draft", f"{ON_WORKER}before_draft", "BEFORE", None),
    # coverage.py: counters over the hot head installed just above (this hook wraps that one)
    Hook(f"{WORKER}.init_lm_head", f"{ON_COVERAGE}install_after_init_lm_head", "AFTER", "(self)"),
    Hook(f"{EAGLE_V2}.verify", f"{ON_COVERAGE}count_after_verify", "AFTER", None),  # (self, batch, ...)
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
    # worker.py: weight updates that complete in one call (the others: VARIANTS)
    *(
        Hook(f"{WEIGHT_UPDATER}.{method}", f"{ON_WORKER}refresh_after_complete_update", "AFTER", None)
        for method in ("update_weights_from_disk", "update_weights_from_ipc")
    ),
)


@dataclass(frozen=True)
class Form:
    """One form of a seam: the entries that identify it in an SGLang (the plugin relies on them
    where it takes this form) and the hooks installed with it."""

    name: str
    entries: tuple[Entry, ...]
    hooks: tuple[Hook, ...] = ()


@dataclass(frozen=True)
class Variant:
    """A seam where the supported releases differ, with its forms in the order they are tried
    (a form whose entries also hold in releases of another form goes after that one)."""

    seam: str
    forms: tuple[Form, ...]


LOGITS = "sglang.srt.layers.logits_processor:LogitsProcessor"

# To serve a new release that changes a seam: add its form here (first), branch the handler on
# ``contract.running_form(seam)``, and docs/compatibility.md says the rest.
VARIANTS: tuple[Variant, ...] = (
    # hooks.py's draft and verify hooks rely on (self, batch) only; the rest is passed through
    Variant(
        "draft",
        (
            Form("with_topology", (Signature(f"{WORKER}.draft", "(self, batch, *, with_topology=)"),)),
            Form("batch", (Signature(f"{WORKER}.draft", "(self, batch)"),)),
        ),
    ),
    Variant(
        "verify",
        (
            Form(
                "pp_proxy_tensors",
                (Signature(f"{EAGLE_V2}.verify", "(self, batch, pp_proxy_tensors=, grammar_barrier=)"),),
            ),
            Form("batch", (Signature(f"{EAGLE_V2}.verify", "(self, batch, grammar_barrier=)"),)),
        ),
    ),
    # worker.py: where the draft's embedding and the target's head shard come from
    Variant(
        "shared_embed_and_head",
        (
            Form("resolver", (Signature(f"{WORKER}._resolve_shared_embed_and_head", "(self)"),)),
            Form(
                "target_model",
                (Signature("sglang.srt.models.llama:LlamaForCausalLM.get_embed_and_head", "(self)"),),
            ),
        ),
    ),
    # worker.py: tensor and distributed weight updates (and P2P/RDMA writes) run inside a
    # begin/end session, so they refresh once at its end; before sessions, each is one call
    Variant(
        "weight_updates",
        (
            Form(
                "sessions",
                (
                    Signature(f"{WEIGHT_UPDATER}.end_weight_update", "(self, recv_req)"),
                    Attribute("sglang.srt.managers.io_struct:EndWeightUpdateReqOutput.success"),
                ),
                (
                    Hook(
                        f"{WEIGHT_UPDATER}.end_weight_update",
                        f"{ON_WORKER}refresh_after_session_end",
                        "AFTER",
                        None,
                    ),
                ),
            ),
            Form(
                "one_call",
                tuple(
                    Signature(f"{WEIGHT_UPDATER}.{method}", "(self, recv_req)")
                    for method in ("update_weights_from_tensor", "update_weights_from_distributed")
                ),
                tuple(
                    Hook(
                        f"{WEIGHT_UPDATER}.{method}",
                        f"{ON_WORKER}refresh_after_complete_update",
                        "AFTER",
                        None,
                    )
                    for method in ("update_weights_from_tensor", "update_weights_from_distributed")
                ),
            ),
        ),
    ),
    # logits.py: stock casts and caps half-precision CUDA logits in one fused copy, or caps after
    # the copy
    Variant(
        "softcap",
        (
            Form(
                "fused_with_copy",
                (
                    Signature(
                        f"{LOGITS}._copy_logits_to_buffer",
                        "(self, logits, logits_metadata, use_buffer=, softcap=)",
                    ),
                ),
            ),
            Form(
                "after_copy",
                (
                    Signature(
                        f"{LOGITS}._copy_logits_to_buffer", "(self, logits, logits_metadata, use_buffer=)"
                    ),
                ),
            ),
        ),
    ),
    # args.py: DP attention's width at argument time (the adaptive map is refused under it), an
    # argument or, before SGLang 0.5.22, derived from dp_size and enable_dp_attention
    Variant(
        "attn_dp_size",
        (
            Form("derived", (Signature("sglang.srt.runtime_context:attn_dp_size_of", "(cfg)"),)),
            Form("argument", (Attribute("sglang.srt.arg_groups.fields.parallel:Parallel.attn_dp_size"),)),
        ),
    ),
    # logits.py calls stock's GEMM as (hidden_states, lm_head); newer releases add an output buffer
    Variant(
        "lm_head_gemm",
        (
            Form(
                "out_buffer",
                (
                    Signature(
                        f"{LOGITS}._compute_lm_head",
                        "(self, hidden_states, lm_head, embedding_bias=, *, out=)",
                    ),
                ),
            ),
            Form(
                "plain",
                (Signature(f"{LOGITS}._compute_lm_head", "(self, hidden_states, lm_head, embedding_bias=)"),),
            ),
        ),
    ),
)


def hook_target(target: str) -> str:
    """The dotted path ``HookRegistry.register`` takes for a contract target."""
    return target.replace(":", ".")


def hooked_targets(handler: str) -> list[str]:
    """The dotted targets a handler is registered on (for checks that the hooks are active)."""
    return [hook_target(h.target) for h in HOOKS if h.handler == handler]
