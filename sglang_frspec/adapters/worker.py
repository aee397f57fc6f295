"""Seam 3: ``EagleDraftWorker`` start-up (token map and LM head) and weight refreshes.

SGLang calls ``init_token_map()`` then ``init_lm_head()`` on every TP rank after the models are
loaded and before any graph capture. With a token map, this module replaces both:

1. ``init_token_map`` reads the file on every rank but raises nothing yet.
2. ``init_lm_head`` validates the map against the target head, then all ranks compare
   (ok/error, digest) over the TP CPU group, so every rank raises the same clear error together
   instead of one rank waiting in a collective. Then it plans the hot shards, builds this rank's
   hot head, installs the draft-only logits processor and sets ``hot_token_id`` to the canonical
   ids on the device: the contract the rest of the EAGLE worker relies on.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
from sglang.srt.utils.common import is_cpu

from sglang_frspec.adapters import pd
from sglang_frspec.adapters.contract import running_form
from sglang_frspec.adapters.head import (
    HeadShard,
    build_hot_head,
    check_draft_supported,
    check_draft_uses_hot_head,
    check_head_supported,
    find_head_shard,
    quantized_head_bytes,
)
from sglang_frspec.adapters.hooks import ON_WORKER, hooked_targets
from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
from sglang_frspec.adapters.state import FrSpecState, attach_state, state_of
from sglang_frspec.adapters.token_map import load_token_map_ids
from sglang_frspec.core import (
    HotIds,
    HotShardPlan,
    HotWireOrder,
    TokenMapError,
    UnsupportedSetupError,
    canonical_hot_ids,
    check_hot_ids_cover_topk,
    plan_from_ranges,
)
from sglang_frspec.core.hot_probs import lay_hot_probs_over_vocab
from sglang_frspec.core.options import FrSpecOptions

logger = logging.getLogger(__name__)


@dataclass
class FrSpecDraftHead:
    """What the plugin installed on a draft worker (kept for refreshes and inspection)."""

    plan: HotShardPlan
    shard: HeadShard
    options: FrSpecOptions
    local_head: torch.Tensor  # [plan.width, hidden], shared with the draft's lm_head

    def refresh(self) -> None:
        """Re-read the hot rows after the target weights changed in place (all ranks call)."""
        # In place: captured graphs keep pointing at the head, and no second head is allocated.
        build_hot_head(self.shard, self.plan, self.local_head.dtype, out=self.local_head)


def _uses_token_map(worker) -> bool:
    return not worker.speculative_algorithm.is_eagle3() and (get_spec().speculative_token_map is not None)


# Set while stock's start-up refusal of rejection sampling with a hot vocab is lifted (the flag
# then reads False to stock's check, not to this plugin).
_REJECTION_SAMPLING = contextvars.ContextVar("frspec_rejection_sampling", default=False)


def _rejection_sampling() -> bool:
    """Whether verify runs rejection sampling (``--speculative-use-rejection-sampling``, or block
    verification, which turns it on): the draft's whole hot distribution is then needed."""
    return _REJECTION_SAMPLING.get() or bool(get_spec().speculative_use_rejection_sampling)


# The hook that sizes the draft-decode CUDA graph's q buffer for a hot draft (below).
_GRAPH_Q_HOOKS = hooked_targets(f"{ON_WORKER}around_draft_graph_capture_one_shape")


def around_alloc_memory_pool(original: Callable, worker, *args, **kwargs) -> None:
    """AROUND hook: lift stock's start-up refusal of rejection sampling with a hot vocab (its
    FIXME "scatter draft probs into the target vocab"): ``after_draft`` does that scatter. Stock's
    check, the method's last step, runs with the flag off; the plugin's own start-up reads it."""
    spec = get_spec()
    if not (_uses_token_map(worker) and spec.speculative_use_rejection_sampling):
        return original(worker, *args, **kwargs)
    _check_draft_graph_takes_hot_q()
    token = _REJECTION_SAMPLING.set(True)
    try:
        with spec.override(speculative_use_rejection_sampling=False):
            return original(worker, *args, **kwargs)
    finally:
        _REJECTION_SAMPLING.reset(token)


def _check_draft_graph_takes_hot_q() -> None:
    """Every rank alike (the same server arguments): refuse rejection sampling with a map where
    SGLang will capture the draft-decode CUDA graph without the plugin's hook that sizes its q
    buffer (the drop-in worker without the plugin): the capture would fail with a shape error."""
    if any(target not in HookRegistry._patched for target in _GRAPH_Q_HOOKS) and not (
        is_cpu() or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
    ):
        raise UnsupportedSetupError(
            "--speculative-use-rejection-sampling with --speculative-token-map under CUDA graphs "
            "needs sglang-frspec's hook on the draft-decode graph runner ("
            + ", ".join(_GRAPH_Q_HOOKS)
            + "), which is not active: the graph's draft-probability buffer is as wide as the "
            "target vocab, the map's draft probabilities are not. Load the plugin (SGLANG_PLUGINS "
            "must include frspec), or pass --disable-cuda-graph."
        )


def around_draft_graph_capture_one_shape(original: Callable, runner, *args, **kwargs):
    """AROUND hook on ``EAGLEDraftCudaGraphRunner.capture_one_shape``: under rejection sampling
    the runner allocates its q buffer (``spec_info.draft_probs`` at replay, stacked in
    ``draft_forward`` with each step's q) as wide as the draft model's vocab; with a map q has
    one column per hot id. Re-allocated H wide before the first shape is captured (each shape
    captures slices of it); SGLang's own V-wide buffer stays unused."""
    worker, buffers = runner.eagle_worker, runner.buffers
    width = worker.hot_token_id.numel() if state_of(worker) is not None else None
    if buffers.draft_probs is not None and width is not None and buffers.draft_probs.shape[1] != width:
        buffers.draft_probs = buffers.draft_probs.new_zeros((buffers.draft_probs.shape[0], width))
    return original(runner, *args, **kwargs)


def before_draft(worker, batch, *args, **kwargs) -> None:
    """BEFORE hook on ``draft``: an idle batch's q (``EagleDraftInput.create_idle_input``, as wide
    as the target vocab) made as wide as the hot q, since an idle DP rank replays the draft-decode
    graph with the others and the replay copies q into the H-wide buffer. Empty either way."""
    q = getattr(batch.spec_info, "draft_probs", None)
    if state_of(worker) is None or q is None or not batch.forward_mode.is_idle():
        return None
    if q.shape[-1] != worker.hot_token_id.numel():
        batch.spec_info.draft_probs = q.new_empty((0, worker.hot_token_id.numel()))
    return None


def after_draft(result, worker, *args, **kwargs):
    """AFTER hook on ``draft``: lay the draft's ``[bs, steps, H]`` hot probabilities over the target
    vocab where SGLang's rejection-sampling verify reads them (``EagleVerifyInput.draft_probs``).
    Outside any graph; the same on every rank (every rank holds the same gathered hot logits)."""
    state = state_of(worker)
    verify_input = result[0] if isinstance(result, tuple) else result  # with_topology: a tuple
    if state is None or state.head is None or verify_input.draft_probs is None:
        return result
    vocab = worker.target_worker.model_config.vocab_size
    verify_input.draft_probs = lay_hot_probs_over_vocab(verify_input.draft_probs, worker.hot_token_id, vocab)
    return result


def around_init_token_map(original: Callable, worker) -> None:
    """AROUND hook: read the map on this rank; errors are held until all ranks compare notes."""
    if not _uses_token_map(worker):
        return original(worker)
    path = get_spec().speculative_token_map
    try:
        state = FrSpecState(path, load_token_map_ids(path), None)
    except TokenMapError as e:
        state = FrSpecState(path, torch.empty(0, dtype=torch.int64), e)
    attach_state(worker, state)
    worker.hot_token_id = state.map_ids  # file order, as upstream; init_lm_head canonicalises


def map_status(hot: HotIds, wire: HotWireOrder | None = None) -> tuple:
    """This rank's part of the agreement on the map it uses: the canonical ids and, on a PD node
    (``wire``), the map file's order too, since positions in it are what goes on the wire."""
    return ("ok", hot.digest, len(hot), None if wire is None else wire.tag)


def agree_across_ranks(status: tuple, group) -> None:
    """Raise the same error on every rank if any rank failed or the ranks' maps differ.

    ``status`` is ``map_status(...)`` or ("error", error class name, message). Runs on the gloo
    CPU group.
    """
    statuses = [status] if group.world_size == 1 else group.all_gather_object(status)
    failed = [(r, s) for r, s in enumerate(statuses) if s[0] == "error"]
    if failed:
        rank, (_, kind, message) = failed[0]
        error = UnsupportedSetupError if kind == UnsupportedSetupError.__name__ else TokenMapError
        raise error(f"[sglang-frspec, TP rank {rank} of {len(statuses)}] {message}")
    digests = {s[1] for s in statuses}
    if len(digests) > 1:
        per_rank = ", ".join(f"rank {r}: {s[1][:16]} ({s[2]} ids)" for r, s in enumerate(statuses))
        raise TokenMapError(
            "[sglang-frspec] the TP ranks loaded different token maps (sha256 of the canonical "
            f"ids: {per_rank}). Every node must see the same --speculative-token-map file; "
            "copy the same file to every node."
        )
    tags = [s[3] for s in statuses]
    if len(set(tags)) > 1:
        per_rank = ", ".join(f"rank {r}: {tag}" for r, tag in enumerate(tags))
        raise TokenMapError(
            "[sglang-frspec] prefill/decode: the TP ranks loaded the same hot ids in different "
            f"orders (map file tags: {per_rank}). A PD node ships and receives each request's first "
            "drafts as positions in its --speculative-token-map file, so the ranks of one TP group "
            "would read the same row as different tokens. Copy one map file to every rank of every "
            "prefill and decode node."
        )


def around_init_lm_head(original: Callable, worker) -> None:
    """AROUND hook: build this rank's hot head and the draft-only logits path."""
    if not _uses_token_map(worker):
        return original(worker)
    embed, head = _shared_embed_and_head(worker)
    state = state_of(worker)
    options, shard, hot, wire = _check_and_agree(worker, state, head)
    plan = plan_from_ranges(hot.ids, shard.shard_ranges, options.layout)
    processor, local_head = _install(worker, embed, head, options, shard, hot, plan)
    state.head = FrSpecDraftHead(plan, shard, options, local_head)
    pd.install_wire_order(wire, head.device)  # a PD node ships hot indices
    state.map_ids = None
    if get_parallel().tp_rank == 0:
        _report(options, processor, shard, hot, plan, local_head, worker.topk, state.map_source)


def _shared_embed_and_head(worker) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The embedding and target LM-head shard SGLang would give the draft (its own call, per
    release: the resolver also reloads the embedding a pipeline stage lacks)."""
    if running_form("shared_embed_and_head") == "resolver":
        return worker._resolve_shared_embed_and_head()
    return worker.target_worker.model_runner.model.get_embed_and_head()


def _check_and_agree(
    worker, state: FrSpecState, head: torch.Tensor
) -> tuple[FrSpecOptions, HeadShard, HotIds, HotWireOrder | None]:
    """Validate the map and the setup on this rank, then raise the same error on every rank if
    any rank failed (or the ranks' maps differ). Also the PD wire order (None off PD nodes)."""
    draft_model = worker.draft_runner.model
    options = shard = hot = wire = None
    try:
        if state.map_error is not None:
            raise state.map_error
        options = FrSpecOptions.from_env()
        shard = find_head_shard(worker.target_worker.model_runner.model, head)
        check_head_supported(shard.module)
        hot = canonical_hot_ids(state.map_ids, shard.vocab_size, source=state.map_source)
        check_hot_ids_cover_topk(len(hot), worker.topk, source=state.map_source)
        check_draft_supported(draft_model, len(hot))
        wire = pd.wire_order_of(state.map_ids, hot)
        status = map_status(hot, wire)
    except (TokenMapError, UnsupportedSetupError) as e:
        status = ("error", type(e).__name__, str(e))
    agree_across_ranks(status, get_parallel().tp_group)
    return options, shard, hot, wire


def _install(worker, embed, head, options: FrSpecOptions, shard: HeadShard, hot: HotIds,
             plan: HotShardPlan) -> tuple[FrSpecLogitsProcessor, torch.Tensor]:  # fmt: skip
    """Give the draft this rank's hot head and the hot-logits processor, and set ``hot_token_id``:
    the contract the rest of the EAGLE worker relies on."""
    draft_model = worker.draft_runner.model
    # A quantized head's hot rows are dequantized into the dtype the draft computes in.
    local_head = build_hot_head(shard, plan, worker.draft_runner.dtype)
    draft_model.set_embed_and_head(embed, local_head)
    try:
        check_draft_uses_hot_head(draft_model, local_head)
        status = map_status(hot)
    except UnsupportedSetupError as e:
        status = ("error", type(e).__name__, str(e))
    agree_across_ranks(status, get_parallel().tp_group)
    processor = FrSpecLogitsProcessor(
        draft_model.config,
        plan,
        shard,
        options.exchange,
        worker.topk,
        head.device,
        logit_scale=getattr(draft_model.logits_processor, "logit_scale", None),  # keep the draft's
        needs_distribution=_rejection_sampling(),
    )
    draft_model.logits_processor = processor
    # A tensor of its own on every device (on a GPU the move copies anyway): the adaptive map keeps
    # both up to date, and a CPU that shared one tensor would hide an update of either forgotten.
    worker.hot_token_id = plan.hot_ids.to(head.device, copy=True)
    return processor, local_head


def _report(options: FrSpecOptions, processor: FrSpecLogitsProcessor, shard: HeadShard, hot: HotIds,
            plan: HotShardPlan, local_head: torch.Tensor, topk: int, source: str) -> None:  # fmt: skip
    """Rank 0's start-up lines: fallbacks, repeated ids, the quantized head's bytes, the plan."""
    if processor.exchange != options.exchange and _rejection_sampling():
        logger.warning(
            "sglang-frspec: exchange=%s cannot give rejection sampling the draft's whole hot "
            "distribution; using exchange=%s.",
            options.exchange,
            processor.exchange,
        )
    elif processor.exchange != options.exchange:
        logger.warning(
            "sglang-frspec: exchange=%s needs 0 < --speculative-eagle-topk < %d hot ids "
            "(topk is %d); using exchange=%s.",
            options.exchange,
            plan.num_hot,
            topk,
            processor.exchange,
        )
    if hot.num_duplicates:
        logger.warning(
            "sglang-frspec: token map %s repeats %d id(s); using %d distinct ids.",
            source,
            hot.num_duplicates,
            len(hot),
        )
    log_quantized_head_bytes(shard, local_head)
    logger.info(
        "sglang-frspec: %d hot ids over %d rank(s), layout=%s exchange=%s, "
        "columns per rank %s (width %d, max/mean %.2f)",
        plan.num_hot,
        plan.tp_size,
        plan.layout,
        processor.exchange,
        list(plan.counts),
        plan.width,
        plan.imbalance,
    )


def log_quantized_head_bytes(shard: HeadShard, local_head: torch.Tensor) -> None:
    """Rank 0: what a draft step reads per rank with a dequantized hot head against the quantized
    vocab shard; a warning when the hot head reads more (a large map over a small FP8 vocab)."""
    shard_bytes = quantized_head_bytes(shard.module)
    if shard_bytes is None:
        return
    hot_bytes = local_head.numel() * local_head.element_size()
    logger.info(
        "sglang-frspec: the target LM head is quantized (%s); its hot rows are dequantized into %s: "
        "a draft step reads %.2f MiB of hot head per rank instead of %.2f MiB of the quantized vocab shard",
        type(shard.module.quant_method).__name__,
        local_head.dtype,
        hot_bytes / 2**20,
        shard_bytes / 2**20,
    )
    if hot_bytes > shard_bytes:
        logger.warning(
            "sglang-frspec: the dequantized hot head (%.2f MiB per rank) is larger than the quantized "
            "vocab shard it replaces (%.2f MiB); a smaller --speculative-token-map reads less.",
            hot_bytes / 2**20,
            shard_bytes / 2**20,
        )


class ShardedFRSpecEagleDraftWorker(EagleDraftWorker):
    """Drop-in ``EagleDraftWorker`` with TP-correct FR-Spec token maps (no plugin needed)."""

    # super(), not EagleDraftWorker.<method>: a class REPLACE hook rebinds that module name.
    def init_token_map(self) -> None:
        parent = super().init_token_map
        around_init_token_map(lambda _worker: parent(), self)

    def init_lm_head(self) -> None:
        parent = super().init_lm_head
        around_init_lm_head(lambda _worker: parent(), self)

    def alloc_memory_pool(self, *args, **kwargs) -> None:
        parent = super().alloc_memory_pool
        around_alloc_memory_pool(lambda _worker, *a, **k: parent(*a, **k), self, *args, **kwargs)

    def draft(self, batch, **kwargs):
        before_draft(self, batch)
        return after_draft(super().draft(batch, **kwargs), self)


def _refresh_on_every_rank(manager, wanted: bool) -> None:
    """Refresh the hot head if any rank wants it: a refresh (a collective under the balanced
    layout) then runs on every rank or on none, even if the ranks' update results differ."""
    state = state_of(manager.draft_worker)
    head = state.head if state is not None else None
    if head is None:  # the same on every rank: no map, or not an EAGLE draft
        return
    group = get_parallel().tp_group
    if group.world_size > 1:
        wanted = any(group.all_gather_object(wanted))
    if wanted:
        head.refresh()


def refresh_after_complete_update(result, manager, *args, **kwargs):
    """AFTER hook on ``update_weights_from_disk`` / ``_ipc`` (and ``_tensor`` / ``_distributed``
    in releases without update sessions), which complete an update in one call and may have
    loaded the target even when reporting failure (a refused cache flush)."""
    _refresh_on_every_rank(manager, wanted=True)
    return result


def refresh_after_session_end(result, manager, *args, **kwargs):
    """AFTER hook on ``end_weight_update``: tensor and distributed updates (possibly chunked)
    and P2P/RDMA writes all run inside a begin/end session, so they refresh once, here."""
    _refresh_on_every_rank(manager, wanted=bool(getattr(result, "success", False)))
    return result
