"""What the plugin keeps on an SGLang draft worker: one object, one attribute, one accessor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_frspec.adapters.coverage import HotCoverage
    from sglang_frspec.adapters.worker import FrSpecDraftHead

ATTRIBUTE = "frspec"  # on the EagleDraftWorker (SGLang's EAGLEWorkerV2 holds it as _draft_worker)


@dataclass
class FrSpecState:
    """A draft worker's map (read at ``init_token_map``), and what ``init_lm_head`` installed."""

    map_source: str
    map_ids: torch.Tensor | None  # file order; dropped once the head is built
    map_error: Exception | None  # raised at init_lm_head, after every rank has compared notes
    head: FrSpecDraftHead | None = None
    coverage: HotCoverage | None = None


def state_of(worker) -> FrSpecState | None:
    """The state on an ``EagleDraftWorker``, an ``EAGLEWorkerV2`` (its draft worker's) or None."""
    worker = getattr(worker, "_draft_worker", worker)
    return getattr(worker, ATTRIBUTE, None)


def attach_state(worker, state: FrSpecState) -> None:
    setattr(worker, ATTRIBUTE, state)
