"""What the running SGLang release does that the tests' expectations depend on (the plugin's own
differences between releases are its forms, ``sglang_frspec/adapters/hooks.py`` VARIANTS)."""

from __future__ import annotations

import importlib
import inspect


def cpu_verify_samples() -> bool:
    """Whether EAGLE's verify can take its sampling path on a CPU: from SGLang 0.5.21 on the CPU
    site lifts ``eagle_utils._verify_uses_greedy``; SGLang 0.5.20 commits argmax there whatever
    the sampling (``speculative/eagle_utils.py:784``, ``or _is_cpu``, and ``_is_cpu`` also picks the
    CPU attention's tree mask, ``:147``), so its sampling-verify kernels never run on a CPU."""
    return hasattr(importlib.import_module("sglang.srt.speculative.eagle_utils"), "_verify_uses_greedy")


def pd_builds_first_proposal() -> bool:
    """Whether a PD decode node's draft-input builder makes a first proposal q under rejection
    sampling (``pd_first_draft_proposal``, SGLang 0.5.22 on; before, it makes none)."""
    return hasattr(
        importlib.import_module("sglang.srt.speculative.eagle_disaggregation"), "pd_first_draft_proposal"
    )


def draft_pick_op() -> set[str]:
    """The CPU site's op a sampled draft proposal runs: ``row_argmax`` (SGLang 0.5.22 on, imported
    by ``speculative/spec_utils.py``), none before (a torch pick)."""
    spec_utils = importlib.import_module("sglang.srt.speculative.spec_utils")
    return {"row_argmax"} if hasattr(spec_utils, "row_argmax") else set()


def refused_flush_fails_the_update() -> bool:
    """Whether a weight update whose cache flush is refused reports failure (SGLang 0.5.22 on);
    before, the scheduler asserts (``flush_cache_after_weight_update``: "Cache flush failed")."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    return (
        "success"
        in inspect.signature(SchedulerWeightUpdaterManager.flush_cache_after_weight_update).parameters
    )
