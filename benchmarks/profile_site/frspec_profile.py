"""Benchmark-only SGLang plugin: the wall time of each phase of every scheduler cycle.

Selected by ``--profile`` of ``benchmarks/bench_server.py`` (``cycle_profile.profiled_env`` puts this
folder on PYTHONPATH, names ``frspec_profile`` in SGLANG_PLUGINS and sets SGLANG_FRSPEC_PROFILE_DIR).
AROUND hooks (``PHASES``) time the scheduler loop's calls and, nested inside them, the EAGLE stages,
every model forward, its logits processor (the head, and the draft's exchange) and every TP
collective. A cycle is one pass of the scheduler loop, from one ``ingest_requests`` to the next.
For each cycle that ran a batch, each rank appends one JSON line to ``<dir>/<pid>.jsonl``: its rank,
the batch's forward mode and size, the cycle's wall ms, and per phase path
(``run batch > verify > forward 1 > head``) the wall ms and calls in that cycle. Writing a line is
itself a phase of the next cycle (``profiler``), so every pass of the loop is accounted for.

Wall time is the work on a CPU, where every op runs synchronously; on a GPU it would be launch time.
A collective's time on one rank includes waiting for the other ranks to reach it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

DIR_ENV = "SGLANG_FRSPEC_PROFILE_DIR"
SEP = " > "
CYCLE = "recv requests"  # the first call of each pass of the scheduler loop
WRITE = "profiler"  # writing the last cycle's line, at the start of the next cycle
RUN = "run batch"
_S = "sglang.srt."
PHASES = (
    (f"{_S}managers.scheduler.Scheduler.ingest_requests", CYCLE),
    (f"{_S}managers.scheduler.Scheduler.get_next_batch_to_run", "schedule"),
    (f"{_S}managers.scheduler.Scheduler.run_batch", RUN),
    (f"{_S}managers.scheduler.Scheduler.process_batch_result", "process result"),
    (f"{_S}speculative.eagle_worker_v2.EagleDraftWorker.draft", "draft"),
    (f"{_S}speculative.eagle_worker_v2.EAGLEWorkerV2.verify", "verify"),
    (f"{_S}speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode", "draft extend"),
    (f"{_S}model_executor.model_runner.ModelRunner.forward", "forward"),
    (f"{_S}model_executor.model_runner.ModelRunner.sample", "sample"),
    (f"{_S}layers.logits_processor.LogitsProcessor.forward", "head"),
    (f"{_S}distributed.parallel_state.GroupCoordinator.all_reduce", "all-reduce"),
    (f"{_S}distributed.parallel_state.GroupCoordinator.all_gather", "all-gather"),
    (f"{_S}distributed.parallel_state.GroupCoordinator.all_gather_into_tensor", "all-gather"),
)
NUMBERED = ("forward",)  # numbered per parent (draft > forward 1, forward 2: the draft steps)
COLLECTIVES = ("all-reduce", "all-gather")  # a collective inside another is not timed again


class _Recorder:
    """One scheduler rank's cycles, appended to its file as they end."""

    def __init__(self, folder: str):
        from sglang.srt.runtime_context import get_parallel

        self.rank = get_parallel().tp_rank
        self.thread = threading.get_ident()  # the scheduler loop's; other threads are not timed
        self.file = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
        self.stack: list[tuple[str, str, dict]] = []  # path, label, numbered children so far
        self.cycle: dict | None = None
        self.top: dict = {}  # numbered top-level calls
        self.hook_us = 0.0

    def next_cycle(self, now: float) -> None:
        """Close the last cycle (written if it ran a batch) and open one starting ``now``."""
        last = self.cycle
        self.cycle = {"rank": self.rank, "start": now, "hook_us": self.hook_us, "phases": {}}
        self.top = {}
        if last is not None and "mode" in last:
            last["ms"] = (now - last.pop("start")) * 1e3
            self.file.write(json.dumps(last) + "\n")
            self.cycle["phases"][WRITE] = [(time.perf_counter() - now) * 1e3, 1]

    def calibrate(self, calls: int = 500, repeats: int = 5) -> float:
        """Microseconds one timed call adds to what it times (this hook's own work, measured here;
        the fastest of ``repeats``, so that a preemption does not count)."""

        def noop() -> None:
            return None

        def seconds(call: Callable) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                call()
            return time.perf_counter() - start

        hook = around("calibration")
        self.cycle = {"phases": {}}
        timed = min(seconds(lambda: hook(noop)) for _ in range(repeats))
        bare = min(seconds(noop) for _ in range(repeats))
        self.cycle = None
        return max(timed - bare, 0.0) / calls * 1e6


_recorders: dict[int, _Recorder | None] = {}  # by pid: a forked child starts its own


def _recorder(create: bool) -> _Recorder | None:
    pid = os.getpid()
    if pid not in _recorders and create:
        folder = os.environ.get(DIR_ENV)
        rec = _recorders[pid] = _Recorder(folder) if folder else None
        if rec is not None:
            rec.hook_us = rec.calibrate()  # after registering it: the hook looks it up
    return _recorders.get(pid)


def around(label: str) -> Callable:
    """The AROUND hook that times one call as the phase ``label`` under the call running now."""

    def hook(original: Callable, *args, **kwargs):
        rec = _recorder(create=label == CYCLE)
        if rec is None or threading.get_ident() != rec.thread:
            return original(*args, **kwargs)
        if label == CYCLE and not rec.stack:
            rec.next_cycle(time.perf_counter())
        if rec.cycle is None or (label in COLLECTIVES and rec.stack and rec.stack[-1][1] in COLLECTIVES):
            return original(*args, **kwargs)
        if label == RUN:
            batch = args[1]
            rec.cycle["mode"], rec.cycle["bs"] = batch.forward_mode.name, batch.batch_size()
        parent_path, _, siblings = rec.stack[-1] if rec.stack else ("", "", rec.top)
        name = label
        if label in NUMBERED:
            siblings[label] = siblings.get(label, 0) + 1
            name = f"{label} {siblings[label]}"
        path = f"{parent_path}{SEP}{name}" if parent_path else name
        rec.stack.append((path, label, {}))
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            rec.stack.pop()
            entry = rec.cycle["phases"].setdefault(path, [0.0, 0])
            entry[0] += elapsed * 1e3
            entry[1] += 1

    return hook


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, label in PHASES:
        HookRegistry.register(target, around(label), HookType.AROUND)
