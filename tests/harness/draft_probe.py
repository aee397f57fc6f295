"""Test-only SGLang plugin ``frspec_draft_probe``: what SGLang's own draft objects hold, in the log.

A server started with ``probed_launch`` also loads this plugin (its entry point is in
``probe_site/``, on the test session's ``PYTHONPATH``; SGLang loads it only where
``SGLANG_PLUGINS`` names it, as ``probed_launch`` does). Each scheduler then logs, when it
is idle and what it reads has changed since its last line, the address and ids of its
``EagleDraftWorker.hot_token_id`` (which the draft's top-k indices are mapped through) and the
address of the draft model's ``lm_head.weight`` (what the draft's logits are computed from): read
from the objects SGLang drafts with, not from the plugin's record of its own tensors.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from sglang_frspec.demo.cpu import pythonpath_with
from tools.serving.zygote import ForkedProcess, forked_launch

logger = logging.getLogger(__name__)

PLUGIN = "frspec_draft_probe"
PROBE_SITE = Path(__file__).resolve().parent / "probe_site"
SCHEDULER_ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
LINE = re.compile(
    r"frspec-probe: TP rank (\d+): hot_token_id at (0x[0-9a-f]+), "
    r"lm_head\.weight at (0x[0-9a-f]+), ids \[([\d, ]*)\]"
)


@dataclass(frozen=True)
class DraftTensors:
    """One probe line: a rank's draft ``hot_token_id`` (address, ids) and ``lm_head.weight`` address."""

    rank: int
    hot_token_id_at: int
    lm_head_at: int
    ids: tuple[int, ...]


def register() -> None:
    """The entry point: an AFTER hook on ``Scheduler.on_idle``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_ON_IDLE, log_draft_tensors, HookType.AFTER)


_last_logged: dict[str, tuple] = {}


def log_draft_tensors(result, scheduler, *args, **kwargs):
    """AFTER hook: log the draft worker's tensors when they differ from the last line."""
    worker = getattr(scheduler.draft_worker, "_draft_worker", None)  # EAGLEWorkerV2's draft worker
    if worker is None or worker.hot_token_id is None:
        return result
    from sglang.srt.runtime_context import get_parallel

    hot, weight = worker.hot_token_id, worker.draft_runner.model.lm_head.weight
    seen = (hot.data_ptr(), weight.data_ptr(), hot.tolist())
    if _last_logged.get("seen") != seen:
        _last_logged["seen"] = seen
        logger.info(
            "frspec-probe: TP rank %d: hot_token_id at %#x, lm_head.weight at %#x, ids %s",
            get_parallel().tp_rank,
            *seen,
        )
    return result


def probed_launch(env: dict, args: list[str], log_path: Path) -> ForkedProcess:
    """``forked_launch`` with this plugin loaded too (a launch for ``start_server(launch=...)``).
    The test session has ``PROBE_SITE`` on ``PYTHONPATH`` already (tests/conftest.py), so the
    launch shares the suite's zygote; elsewhere it is added here."""
    env = env | {
        "PYTHONPATH": pythonpath_with(env, PROBE_SITE),
        "SGLANG_PLUGINS": f"{env['SGLANG_PLUGINS']},{PLUGIN}",
    }
    return forked_launch(env, args, log_path)


def draft_tensors(log: str) -> dict[int, list[DraftTensors]]:
    """Each rank's probe lines, in log order."""
    lines: dict[int, list[DraftTensors]] = {}
    for m in LINE.finditer(log):
        ids = tuple(int(i) for i in m[4].split(",") if i.strip())
        lines.setdefault(int(m[1]), []).append(DraftTensors(int(m[1]), int(m[2], 16), int(m[3], 16), ids))
    return lines
