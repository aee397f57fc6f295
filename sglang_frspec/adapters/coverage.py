"""Seam 5: how many of the tokens the target commits the token map holds, while serving.

Five hooks (``adapters/hooks.py``), all outside captured CUDA graphs:

1. AFTER ``EagleDraftWorker.init_lm_head``: with the plugin's hot head installed and coverage on
   (``SGLANG_FRSPEC_COVERAGE``, default 1), every rank gets a ``CommittedTokenCounts`` over the
   canonical hot ids (the same on every rank).
2. AFTER ``EAGLEWorkerV2.verify``: the verify output holds, on every TP rank, each request's
   accepted draft tokens and bonus token (``next_token_ids`` viewed ``[bs, stride]``, the first
   ``accept_lens[i]`` of row i, the accepted path already at the front for topk > 1); they are
   counted on the device, "in the map" against the map of that step (after an adaptive decision
   that swapped, later tokens count against the new map; the totals never fall). The first token
   after a prefill is not: no speculative step made it.
3. AFTER ``SchedulerMetricsReporter.report_decode_stats``: at SGLang's decode-log interval the
   ranks that log (TP rank 0), export metrics or write the counts file start a host copy of the
   totals; once it has landed (a later step on CUDA, at once on CPU) they log a line after
   SGLang's ``Decode batch`` line, add to the Prometheus counters and write the counts file.
   That copy is the only host transfer while serving, and it never waits for the device.
4. AFTER ``Scheduler.on_idle`` (no batch to run): if verify steps were counted since the last
   copy, the same ranks publish the totals at once, so a burst shorter than the log interval,
   or the tail after the last interval, is exported when the traffic stops (as SGLang's own
   token counters are). The device has no work then, so waiting for the copy costs nothing.
5. AFTER ``Scheduler.release_host_resources`` (graceful shutdown only): every rank logs its final
   totals and TP rank 0 writes the counts file once more.

"Committed" means what verify accepts on the device: at a request's last step it includes the
tokens past its stop (max_new_tokens or a stop token) that SGLang then drops, and with the
overlap scheduler (GPU) one more step of a request that has just finished.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sglang.srt.runtime_context import get_parallel, get_serving, get_spec

from sglang_frspec.adapters.adapt import HotSetAdapter
from sglang_frspec.adapters.state import state_of
from sglang_frspec.core.coverage import CommittedTokenCounts, CoverageTotals, PendingSnapshot
from sglang_frspec.maps.counts_file import TokenCounts, save_atomically

logger = logging.getLogger(__name__)

COMMITTED_METRIC = "sglang:frspec_committed_tokens_total"
IN_MAP_METRIC = "sglang:frspec_committed_in_map_tokens_total"
SWAPS_METRIC = "sglang:frspec_map_swaps_total"
ADAPTED_MAP_SUFFIX = ".map.pt"  # beside the counts file: the adapted map, sorted
COUNTS_CORPUS = "tokens committed by an SGLang server (sglang-frspec SGLANG_FRSPEC_COUNTS)"


@dataclass
class HotCoverage:
    """A scheduler rank's coverage state: the device counts and what was last reported."""

    counts: CommittedTokenCounts
    counts_path: str | None
    pending: PendingSnapshot | None = None
    exported: CoverageTotals = field(default_factory=lambda: CoverageTotals(0, 0))
    prometheus: tuple | None = None  # the (committed, in map, swaps) counter children, once created
    unsnapshotted_steps: int = 0  # verify steps counted since the last snapshot (a host count)
    adapter: HotSetAdapter | None = None  # SGLANG_FRSPEC_ADAPT=1: the map follows these counts
    exported_swaps: int = 0


def install_after_init_lm_head(result, worker):
    """AFTER hook: counters for a draft worker that got the plugin's hot head (coverage on), and
    the adaptive map on them when asked for."""
    state = state_of(worker)
    head = state.head if state is not None else None
    if head is None or not head.options.coverage:
        return result
    counts = CommittedTokenCounts(worker.hot_token_id, head.shard.vocab_size)
    coverage = HotCoverage(counts, head.options.counts_path)
    if head.options.adapt:
        eos = worker.target_worker.model_config.hf_eos_token_id or ()
        coverage.adapter = HotSetAdapter(head, worker.hot_token_id, counts, head.options.adapt_interval,
                                         tuple(eos))  # fmt: skip
        if get_parallel().tp_rank == 0:
            logger.info("sglang-frspec: %s", coverage.adapter.describe())
    state.coverage = coverage
    return result


def count_after_verify(result, worker, batch, *args, **kwargs):
    """AFTER hook on ``EAGLEWorkerV2.verify``: add this step's committed tokens (device only)."""
    coverage = _coverage_of_worker(worker)
    if coverage is not None and result.accept_lens is not None and not batch.forward_mode.is_idle():
        stride = result.speculative_output_stride or result.speculative_num_draft_tokens
        coverage.counts.add(result.next_token_ids, result.accept_lens, stride)
        coverage.unsnapshotted_steps += 1
        if coverage.adapter is not None:  # between forward passes, on every rank alike
            swapped = coverage.adapter.swapped
            coverage.adapter.after_verify()
            if coverage.adapter.swapped != swapped:  # later tokens count against the new map
                coverage.counts.map_changed()
    return result


def _coverage_of_worker(worker) -> HotCoverage | None:
    state = state_of(worker)
    return state.coverage if state is not None else None


def _coverage_of(scheduler) -> HotCoverage | None:
    return _coverage_of_worker(scheduler.draft_worker)  # EAGLEWorkerV2, or None without speculation


def _writes_counts(coverage: HotCoverage) -> bool:
    return coverage.counts_path is not None and get_parallel().tp_rank == 0


def _exports_metrics(reporter) -> bool:
    return reporter.current_scheduler_metrics_enabled and reporter.metrics_collector is not None


def _publishes(reporter, coverage: HotCoverage) -> bool:
    """Whether this rank logs, exports metrics or writes the counts file."""
    return reporter.is_stats_logging_rank or _exports_metrics(reporter) or _writes_counts(coverage)


def _start_snapshot(coverage: HotCoverage) -> None:
    coverage.pending = coverage.counts.snapshot(with_counts=_writes_counts(coverage))
    coverage.unsnapshotted_steps = 0


def _publish(coverage: HotCoverage, reporter) -> None:
    """Log, export and write the pending snapshot (waits for its copy if it has not landed)."""
    totals, coverage.pending = coverage.pending.result(), None
    if _writes_counts(coverage):
        write_counts(totals, coverage, reporter.scheduler)
    if _exports_metrics(reporter):
        _export(coverage, totals, reporter.metrics_collector)
    if reporter.is_stats_logging_rank:
        logger.info("sglang-frspec: %s", totals.describe())


def report_after_decode_stats(result, reporter, *args, **kwargs):
    """AFTER hook: start a host copy at each decode-log interval; publish it once it has landed."""
    coverage = _coverage_of(reporter.scheduler)
    if coverage is None:
        return result
    if (
        coverage.pending is None
        and reporter.forward_ct_decode % reporter.decode_log_interval == 0
        and _publishes(reporter, coverage)
    ):
        _start_snapshot(coverage)
    if coverage.pending is not None and coverage.pending.ready():
        _publish(coverage, reporter)
    return result


def publish_after_idle(result, scheduler, *args, **kwargs):
    """AFTER hook on ``Scheduler.on_idle``: publish what was counted since the last snapshot."""
    coverage = _coverage_of(scheduler)
    if coverage is None or not (coverage.unsnapshotted_steps or coverage.pending):
        return result
    reporter = scheduler.metrics_reporter
    if _publishes(reporter, coverage):
        if coverage.pending is None:
            _start_snapshot(coverage)
        _publish(coverage, reporter)
    else:
        coverage.unsnapshotted_steps = 0  # nothing to publish on this rank
    return result


def flush_after_release(result, scheduler, *args, **kwargs):
    """AFTER hook on the graceful-shutdown path: final totals on every rank, the counts file."""
    coverage = _coverage_of(scheduler)
    if coverage is None:
        return result
    totals = coverage.counts.snapshot(with_counts=_writes_counts(coverage)).result()
    if _writes_counts(coverage):
        write_counts(totals, coverage, scheduler)
    parallel = get_parallel()
    logger.info(
        "sglang-frspec: at shutdown, TP rank %d of %d: %s",
        parallel.tp_rank,
        parallel.tp_size,
        totals.describe(),
    )
    return result


def _export(coverage: HotCoverage, totals: CoverageTotals, collector) -> None:
    """Add what was committed since the last export to the Prometheus counters."""
    if coverage.prometheus is None:
        # SGLang creates its scheduler metrics the same way (multiprocess mode: the server's
        # /metrics sums every process's files); its stat-logger classes may replace Counter.
        from prometheus_client import Counter as PrometheusCounter

        counter_class = collector._counter_cls or PrometheusCounter
        labels = collector.labels
        coverage.prometheus = tuple(
            counter_class(name=name, documentation=doc, labelnames=list(labels)).labels(**labels)
            for name, doc in (
                (COMMITTED_METRIC, "Tokens committed by speculative verify steps (sglang-frspec)."),
                (IN_MAP_METRIC, "Committed tokens that the token map held when committed (sglang-frspec)."),
                (SWAPS_METRIC, "Ids swapped into the token map by SGLANG_FRSPEC_ADAPT (sglang-frspec)."),
            )
        )
    committed, in_map, swaps = coverage.prometheus
    committed.inc(totals.committed - coverage.exported.committed)
    in_map.inc(totals.in_map - coverage.exported.in_map)
    coverage.exported = CoverageTotals(totals.committed, totals.in_map)
    if coverage.adapter is not None:
        swaps.inc(coverage.adapter.swapped - coverage.exported_swaps)
        coverage.exported_swaps = coverage.adapter.swapped


def write_counts(totals: CoverageTotals, coverage: HotCoverage, scheduler) -> None:
    """Save the per-id counts as a ``build-map`` counts file (and, when the map adapts, that map).

    With them go the accepted drafts per id and the speculative settings, which ``size`` uses to
    model what a smaller map would keep of this server's acceptance."""
    eos = scheduler.model_config.hf_eos_token_id or ()
    spec = get_spec()
    TokenCounts(
        counts=totals.counts,
        num_documents=0,  # serving counts are not split by request
        tokenizer=get_serving().tokenizer_path,
        eos_token_ids=tuple(sorted(eos)),
        corpus=(COUNTS_CORPUS,),
        text_field="",
        accepted=totals.accepted_counts,
        speculative={
            "verify_rows": totals.verify_rows,
            "accept_length": totals.accept_length,
            "num_steps": spec.speculative_num_steps,
            "topk": spec.speculative_eagle_topk,
            "num_draft_tokens": spec.speculative_num_draft_tokens,
            "hot_ids": int(coverage.counts.hot_ids.numel()),
        },
    ).save(coverage.counts_path)
    if coverage.adapter is not None:  # the map served now, for the next start
        save_atomically(
            coverage.counts.hot_ids.sort().values.cpu(), f"{coverage.counts_path}{ADAPTED_MAP_SUFFIX}"
        )
