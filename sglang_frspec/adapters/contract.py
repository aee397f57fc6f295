"""The contract with SGLang: every SGLang name this plugin relies on, in one declarative list.

``CONTRACT`` is checked two ways with the same entries (``adapters/contract_check.py``):

- live, at ``register()``, against the running SGLang, so a changed SGLang installs none of the
  plugin's hooks instead of failing half-way;
- from source, against a release's files, so ``scripts/check_sglang_releases.py`` proves the
  declared range without installing it.

The hooked targets come from the hook table (``adapters/hooks.py``); to rely on any other SGLang
name, add one line to ``CONTRACT``. This module imports nothing from SGLang at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from sglang_frspec.adapters.contract_check import (
    Attribute,
    Contains,
    Entry,
    LiveSGLang,
    Named,
    Signature,
    SourceSGLang,
    problems,
)
from sglang_frspec.adapters.hooks import (
    DRAFT_GRAPH,
    EAGLE_V2,
    HOOKS,
    LOGITS,
    REPORTER,
    SCHEDULER,
    VARIANTS,
    WEIGHT_UPDATER,
    WORKER,
    Form,
    Hook,
)

logger = logging.getLogger(__name__)

VOCAB_MODULE = "sglang.srt.layers.vocab_parallel_embedding"
VOCAB = f"{VOCAB_MODULE}:VocabParallelEmbedding"
BATCH_RESULT = "sglang.srt.managers.utils:GenerationBatchResult"
COMMITTED_FIELDS = (
    "next_token_ids",
    "accept_lens",
    "speculative_output_stride",
    "speculative_num_draft_tokens",
)
REPORTER_FIELDS = (
    "scheduler",
    "forward_ct_decode",
    "decode_log_interval",
    "is_stats_logging_rank",
    "current_scheduler_metrics_enabled",
    "metrics_collector",
)
METRICS = "sglang.srt.observability.metrics_collector"


# What the argument-time refusal itself needs (see ``refuse_token_map_at_tp``).
ARGUMENT_TIME: tuple[Entry, ...] = (
    Signature("sglang.srt.arg_groups.resolution_hooks:register_resolution_hook", "(name)"),
    Contains("sglang.srt.arg_groups.resolution_hooks:_OVERRIDABLE_HOOKS", "handle_speculative_decoding"),
    Signature("sglang.srt.arg_groups.model_override_base:resolving_view", "(server_args)"),
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.speculative_token_map"),
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.speculative_algorithm"),
    Attribute("sglang.srt.arg_groups.fields.parallel:Parallel.tp_size"),
)

CONTRACT: tuple[Entry, ...] = (
    *ARGUMENT_TIME,
    # plugin.py: the hook registry
    Signature(
        "sglang.srt.plugins.hook_registry:HookRegistry.register",
        "classmethod (cls, target, hook, hook_type=, *, source=)",
    ),
    Attribute("sglang.srt.plugins.hook_registry:HookRegistry._patched"),
    *(
        Attribute(f"sglang.srt.plugins.hook_registry:HookType.{k}")
        for k in sorted(
            {h.kind for h in HOOKS} | {h.kind for v in VARIANTS for f in v.forms for h in f.hooks}
        )
    ),
    # hooks.py: every hooked target, with the parameters its handler relies on (those of the
    # variants' hooks: the running form's, below)
    *(Signature(target, params) for target, params in dict.fromkeys((h.target, h.params) for h in HOOKS)),
    # args.py: server arguments read through resolving_view
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.enable_multi_layer_eagle"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.model_path"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.load_format"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.trust_remote_code"),
    Attribute("sglang.srt.arg_groups.fields.model:Model.revision"),
    # worker.py: the EAGLE draft worker (hooked methods, what the hooks call and read)
    Attribute(f"{WORKER}.hot_token_id"),
    Attribute(f"{WORKER}.draft_runner"),
    Attribute(f"{WORKER}.target_worker"),
    Attribute(f"{WORKER}.speculative_algorithm"),
    Attribute(f"{WORKER}.topk"),
    # worker.py: rejection sampling with a map (the flag, its scoped override, where verify reads q)
    Attribute("sglang.srt.arg_groups.fields.spec:Spec.speculative_use_rejection_sampling"),
    Signature("sglang.srt.runtime_context:_ConfigBag.override", "(self, **kwargs)"),
    Attribute("sglang.srt.speculative.eagle_info:EagleVerifyInput.draft_probs"),
    Attribute("sglang.srt.configs.model_config:ModelConfig.vocab_size"),
    # ... the draft-decode CUDA graph's q buffer, an idle batch's q, and where no graph is captured
    Attribute(f"{DRAFT_GRAPH}.eagle_worker"),
    Attribute(f"{DRAFT_GRAPH}.buffers"),
    Attribute("sglang.srt.speculative.eagle_draft_cuda_graph_runner:EagleDraftInputBuffers.draft_probs"),
    Attribute("sglang.srt.managers.schedule_batch:ScheduleBatch.spec_info"),
    Signature("sglang.srt.utils.common:is_cpu", "()"),
    Signature("sglang.srt.model_executor.cuda_graph_config:check_cuda_graph_backend", "(phase, backend)"),
    Attribute("sglang.srt.model_executor.cuda_graph_config:Phase.DECODE"),
    Attribute("sglang.srt.model_executor.cuda_graph_config:Backend.DISABLED"),
    Signature("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.is_eagle3", "(self)"),
    Attribute("sglang.srt.managers.tp_worker:TpModelWorker.model_runner"),
    Attribute("sglang.srt.managers.tp_worker:TpModelWorker.model_config"),  # adapt.py: the EOS ids
    Attribute("sglang.srt.model_executor.model_runner:ModelRunner.model"),
    Attribute("sglang.srt.model_executor.model_runner:ModelRunner.dtype"),
    # the EAGLE draft model (Llama family): its head swap and the attributes the plugin replaces
    Signature("sglang.srt.models.llama:LlamaForCausalLM.set_embed_and_head", "(self, embed, head)"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.lm_head"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.logits_processor"),
    Attribute("sglang.srt.models.llama_eagle:LlamaForCausalLMEagle.config"),
    # worker.py and head.py: parallel state
    Signature("sglang.srt.runtime_context:get_parallel", "()"),
    Signature("sglang.srt.runtime_context:get_spec", "()"),
    Named("sglang.srt.runtime_context", "tp_group"),
    Named("sglang.srt.runtime_context", "tp_rank"),
    Named("sglang.srt.runtime_context", "attn_tp_group"),
    Named("sglang.srt.runtime_context", "attn_tp_rank"),
    # args.py and adapt.py: DP attention's width (the adaptive map is refused under it)
    Named("sglang.srt.runtime_context", "attn_tp_size"),  # head.py: the group a table slice is over
    Signature(
        "sglang.srt.distributed.parallel_state:GroupCoordinator.all_gather_into_tensor",
        "(self, output, input)",
    ),
    Signature("sglang.srt.distributed.parallel_state:GroupCoordinator.all_gather_object", "(self, obj)"),
    Attribute("sglang.srt.distributed.parallel_state:GroupCoordinator.world_size"),
    # plugin.py and worker.py: weight updates (AFTER hooks pass the arguments through)
    Attribute(f"{WEIGHT_UPDATER}.draft_worker"),
    Attribute(f"{EAGLE_V2}._draft_worker"),
    # coverage.py (and an AFTER hook on init_lm_head, above): the committed tokens of each verify
    # step, and where the scheduler reports
    *(Attribute(f"{BATCH_RESULT}.{name}") for name in COMMITTED_FIELDS),
    Attribute("sglang.srt.managers.schedule_batch:ScheduleBatch.forward_mode"),
    Signature("sglang.srt.model_executor.forward_batch_info:ForwardMode.is_idle", "(self)"),
    *(Attribute(f"{REPORTER}.{name}") for name in REPORTER_FIELDS),
    Attribute(f"{SCHEDULER}.metrics_reporter"),
    Attribute(f"{SCHEDULER}.draft_worker"),
    Attribute(f"{SCHEDULER}.model_config"),
    Attribute("sglang.srt.configs.model_config:ModelConfig.hf_eos_token_id"),
    Attribute(f"{METRICS}:SchedulerMetricsCollector.labels"),
    Attribute(f"{METRICS}:_StatLoggerDIMixin._counter_cls"),
    Signature("sglang.srt.runtime_context:get_serving", "()"),
    Attribute("sglang.srt.arg_groups.fields.serving:Serving.tokenizer_path"),
    Named("sglang.srt.runtime_context", "tp_size"),
    # pd.py: the hot indices a PD prefill node ships and a decode node receives, and the mode
    # that makes a node a PD node
    Attribute("sglang.srt.managers.schedule_batch:Req.output_topk_index"),
    Attribute("sglang.srt.speculative.eagle_info:EagleDraftInput.topk_index"),
    # ... the metadata row the prefill node's map tag rides in, and the decode batch's requests
    # whose rows (as received) are checked against this node's map
    Attribute("sglang.srt.disaggregation.utils:MetadataBuffers.output_topk_index"),
    Attribute("sglang.srt.managers.schedule_batch:Req.metadata_buffer_index"),
    Attribute("sglang.srt.managers.schedule_batch:ScheduleBatch.reqs"),
    Signature("sglang.srt.runtime_context:get_disagg", "()"),
    Attribute("sglang.srt.arg_groups.fields.disagg:Disagg.disaggregation_mode"),
    # ... and, under rejection sampling, the decode node's first proposal q (rebuilt one-hot over
    # the hot columns where stock builds one)
    Attribute("sglang.srt.speculative.eagle_info:EagleDraftInput.draft_probs"),
    # ... and, under the overlap scheduler, the stash the builder makes of that input (held until
    # translated)
    Signature("sglang.srt.managers.overlap_utils:FutureMap.stash", "(self, future_indices, payload)"),
    Attribute("sglang.srt.managers.overlap_utils:RelayPayload.topk_index"),
    Attribute("sglang.srt.managers.overlap_utils:RelayPayload.draft_probs"),
    # token_map.py: SGLang's own map loader (hub paths)
    Signature("sglang.srt.speculative.spec_utils:load_token_map", "(token_map_path)"),
    # head.py: the target's vocab-parallel LM head
    Attribute(f"{VOCAB_MODULE}:ParallelLMHead"),
    # head.py: SGLang's own test of whether a draft head's quant method runs over its weight
    Signature(
        "sglang.srt.layers.logits_processor:should_apply_lm_head_quant_method", "(lm_head, quant_method)"
    ),
    # quantized_head.py: the ModelOpt FP8 head whose stored layout it reads back
    Attribute("sglang.srt.layers.quantization.modelopt_quant:ModelOptFp8LinearMethod"),
    Attribute("sglang.srt.layers.quantization.modelopt_quant:ModelOptFp8LinearMethod.use_marlin"),
    Signature(
        f"{VOCAB}._get_indices",
        "classmethod (cls, vocab_size_padded, org_vocab_size_padded, vocab_size, org_vocab_size, "
        "tp_rank, tp_size)",
    ),
    *(
        Attribute(f"{VOCAB}.{name}")
        for name in (
            "quant_method",
            "embedding_dim",
            "enable_tp",
            "tp_size",
            "use_attn_tp_group",
            "num_embeddings",
            "num_embeddings_padded",
            "num_embeddings_per_partition",
            "org_vocab_size",
            "org_vocab_size_padded",
            "shard_indices",
        )
    ),
    Attribute(f"{VOCAB_MODULE}:VocabParallelEmbeddingShardIndices.org_vocab_start_index"),
    Attribute(f"{VOCAB_MODULE}:VocabParallelEmbeddingShardIndices.org_vocab_end_index"),
    # logits.py: the draft logits processor subclass
    Attribute("sglang.srt.layers.logits_processor:LogitsMetadata"),
    Signature(f"{LOGITS}.__init__", "(self, config, skip_all_gather=, logit_scale=, return_full_logits=)"),
    Signature(
        f"{LOGITS}._get_logits",
        "(self, hidden_states, lm_head, logits_metadata, embedding_bias=, use_logits_buffer=)",
    ),
    Attribute("sglang.srt.layers.logits_processor:fused_softcap"),
    Signature(f"{LOGITS}._gather_dp_attn_hidden_states", "(self, hidden_states, logits_metadata)"),
    Signature(f"{LOGITS}._scatter_dp_attn_logits", "(self, logits, local_hidden_states, logits_metadata)"),
    *(
        Attribute(f"{LOGITS}.{name}")
        for name in (
            "vocab_size",
            "use_fp32_lm_head",
            "logit_scale",
            "final_logit_softcapping",
        )
    ),
)


def declared_range() -> str:
    """The SGLang requirement this installed sglang-frspec declares (from its metadata)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        for requirement in requires("sglang-frspec") or ():
            if requirement.replace(" ", "").startswith("sglang") and requirement[6:7] in "<>=!~ ":
                return requirement.replace(" ", "")
    except PackageNotFoundError:
        pass
    return "sglang (see the README's compatibility table)"


def mismatch_message(version: str, found: list[str], refused: bool = True) -> str:
    """The one line logged at register() (and raised at argument time)."""
    from importlib.metadata import version as installed_version

    consequence = (
        "so --speculative-token-map at --tp-size > 1 is refused (TP=1 runs stock SGLang)"
        if refused
        else "and SGLang's argument-resolution hooks changed too, so a token map at --tp-size > 1 "
        "is not even refused: it crashes as in stock SGLang"
    )
    plugin = f"sglang-frspec {installed_version('sglang-frspec')}"
    return (
        f"{plugin} does not support SGLang {version}: {'; '.join(found)}. "
        f"None of its hooks are installed, {consequence}. Install a supported SGLang "
        f"({declared_range()}) or a sglang-frspec release that supports this one."
    )


def refuse_token_map_at_tp(message: str) -> None:
    """Register the one resolution hook left when the contract fails: a token map with EAGLE at
    TP > 1 (what stock SGLang crashes on) fails at argument time with ``message``."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from sglang_frspec.core import UnsupportedSetupError

    def refuse(server_args, previous: Callable) -> None:
        previous(server_args)  # resolves NEXTN to EAGLE
        cfg = resolving_view(server_args)
        if cfg.speculative_token_map is not None and cfg.speculative_algorithm == "EAGLE" and cfg.tp_size > 1:
            raise UnsupportedSetupError(message)

    register_resolution_hook("handle_speculative_decoding")(refuse)


@dataclass(frozen=True)
class ContractCheck:
    """What ``check_running_sglang`` found: ``holds``, or the logged ``message`` and whether the
    argument-time refusal can still be registered (``refusable``)."""

    holds: bool
    message: str = ""
    refusable: bool = False


def choose_forms(sglang: LiveSGLang | SourceSGLang) -> tuple[dict[str, Form], list[str]]:
    """Per seam of ``VARIANTS``, the first form whose entries all hold in ``sglang``; and one
    problem for each seam that none of its forms fits (each form's own problems named)."""
    chosen: dict[str, Form] = {}
    unmatched: list[str] = []
    for variant in VARIANTS:
        found = {form.name: problems(sglang, form.entries) for form in variant.forms}
        fitting = [form for form in variant.forms if not found[form.name]]
        if fitting:
            chosen[variant.seam] = fitting[0]
        else:
            tried = " / ".join(f"as {name}: {'; '.join(p)}" for name, p in found.items())
            unmatched.append(f"no known form of the {variant.seam} seam ({tried})")
    return chosen, unmatched


def contract_problems(sglang: LiveSGLang | SourceSGLang) -> list[str]:
    """Everything in ``sglang`` that breaks the contract: ``CONTRACT``'s entries and the seams
    that no known form fits."""
    return problems(sglang, CONTRACT) + choose_forms(sglang)[1]


def active_hooks(forms: dict[str, Form]) -> tuple[Hook, ...]:
    """The hooks installed on an SGLang of these forms: the table's, then the forms' own."""
    return HOOKS + tuple(hook for form in forms.values() for hook in form.hooks)


@cache
def running_forms() -> dict[str, Form]:
    """The forms of the SGLang this process runs (read once; the same on every rank)."""
    return choose_forms(LiveSGLang())[0]


def running_form(seam: str) -> str:
    """The name of the running SGLang's form of ``seam`` (handlers branch on it)."""
    form = running_forms().get(seam)
    if form is None:  # the contract check refused this SGLang: no handler runs on it
        raise RuntimeError(f"sglang-frspec: the running SGLang has no known form of the {seam} seam")
    return form.name


def check_running_sglang() -> ContractCheck:
    """Check the running SGLang against the contract; a broken one is logged in one line."""
    live = LiveSGLang()
    found = contract_problems(live)
    if not found:
        return ContractCheck(holds=True)
    refusable = not problems(live, ARGUMENT_TIME)
    message = mismatch_message(live.version, found, refused=refusable)
    logger.error(message)
    return ContractCheck(holds=False, message=message, refusable=refusable)


@dataclass(frozen=True)
class ReleaseCheck:
    """One release as the source check found it: the torch it pins, its problems, its forms."""

    version: str
    torch: str
    problems: list[str]
    forms: dict[str, str]  # seam -> form name


def compatibility_table(releases: list[ReleaseCheck], tests: dict[str, str]) -> str:
    """The README's compatibility table, newest release first (its forms are the newest); ``tests``
    says, per release, which tests run on it and where (absent: none)."""
    newest = releases[0].forms if releases else {}
    lines = [
        f"| SGLang | torch | contract ({len(CONTRACT)} entries, {len(VARIANTS)} seams with forms) "
        "| older forms it takes | tests |",
        "|---|---|---|---|---|",
    ]
    for release in releases:
        contract = "holds" if not release.problems else "broken: " + "; ".join(release.problems)
        older = [f"{seam}: {name}" for seam, name in release.forms.items() if name != newest[seam]]
        lines.append(
            f"| {release.version} | {release.torch} | {contract} | {', '.join(older) or '-'} "
            f"| {tests.get(release.version, 'not run')} |"
        )
    return "\n".join(lines)
