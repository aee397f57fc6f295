"""Where a decoding cycle's time goes (``bench_server.py --profile``), and the tokens/s it predicts.

``profiled_env`` gives a CPU server the benchmark-only plugin ``profile_site/frspec_profile.py``,
whose schedulers then record every cycle (one pass of the scheduler loop) phase by phase into a
folder; ``CycleLog`` reads the records as they come; ``summarize_cycles`` averages one
configuration's decode cycles on one rank; ``phase_table`` prints configurations side by side.

The cost model: at accept length ``a`` (tokens committed per request per cycle), a speculative
configuration's tokens/s over plain decoding's is ``a * t_plain / t_cycle``, with ``t_plain`` plain
decoding's cycle and ``t_cycle`` the speculative one (``predicted_ratio``). ``gpu_cycle`` predicts
both on a GPU from the same phases: there a forward over a few rows is memory-bound, so the target's
verify over the draft tokens costs what plain decoding's one-token forward costs, and the draft
extend over the accepted tokens what one draft step costs.
"""

from __future__ import annotations

import json
from pathlib import Path

# The plugin's names (the module imports no SGLang at its top); its folder goes on the servers' path.
from benchmarks.profile_site.frspec_profile import DIR_ENV, SEP
from sglang_frspec.demo.cpu import pythonpath_with

PROFILE_SITE = Path(__file__).resolve().parent / "profile_site"

PLUGIN = "frspec_profile"  # its entry point (profile_site/frspec_profile-0.1.0.dist-info)
DECODE = "DECODE"  # the scheduler's forward mode of a decode cycle, plain or speculative
# The top-level phases (the scheduler loop's calls) must cover the measured cycle within this
# fraction; the rest is the loop's own code between them.
COVERAGE_TOLERANCE = 0.05
# Phase paths of the cost model (rank 0's first forward under each stage).
PLAIN_FORWARD = f"run batch{SEP}forward 1"
VERIFY_FORWARD = f"run batch{SEP}verify{SEP}forward 1"
EXTEND_FORWARD = f"run batch{SEP}draft extend{SEP}forward 1"
DRAFT_STEP = f"run batch{SEP}draft{SEP}forward "  # + the step's number


def profiled_env(env: dict, folder: Path) -> dict:
    """``env`` of a CPU server whose schedulers record their cycles into ``folder`` (created).
    The profiling plugin's site joins ``PYTHONPATH`` unless it is there already (the test suite
    puts it on every process's path, so a profiled server forks from the zygote of the others)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = pythonpath_with(env, PROFILE_SITE)
    plugins = ",".join(filter(None, [env.get("SGLANG_PLUGINS"), PLUGIN]))
    return env | {"PYTHONPATH": path, "SGLANG_PLUGINS": plugins, DIR_ENV: str(folder)}


class CycleLog:
    """The cycle records of one server's schedulers (one file per rank), read as they are written."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._read: dict[Path, int] = {}  # bytes of whole lines read per file

    def read_new(self) -> list[dict]:
        """Records completed since the last call, every rank's."""
        records = []
        for path in sorted(self.folder.glob("*.jsonl")):
            data = path.read_bytes()
            start, end = self._read.get(path, 0), data.rfind(b"\n") + 1
            records += [json.loads(line) for line in data[start:end].splitlines()]
            self._read[path] = max(start, end)
        return records


def summarize_cycles(records: list[dict], batch_size: int, rank: int = 0) -> dict | None:
    """Mean wall ms per cycle of every phase over ``rank``'s decode cycles of ``batch_size``
    requests (means, so that phases add up), or None if there are none."""
    cycles = [r for r in records if r["rank"] == rank and r["mode"] == DECODE and r["bs"] == batch_size]
    if not cycles:
        return None
    n = len(cycles)
    phases: dict[str, float] = {}
    calls: dict[str, float] = {}
    for cycle in cycles:
        for path, (ms, count) in cycle["phases"].items():
            phases[path] = phases.get(path, 0.0) + ms / n
            calls[path] = calls.get(path, 0.0) + count / n
    cycle_ms = sum(c["ms"] for c in cycles) / n
    top = sum(ms for path, ms in phases.items() if SEP not in path)
    return {
        "rank": rank,
        "batch_size": batch_size,
        "cycles": n,
        "cycle_ms": cycle_ms,
        "top_level_ms": top,
        "covered": top / cycle_ms,
        # What the hooks themselves add per cycle (timed calls x their measured cost).
        "profiler_overhead_ms": sum(c["hook_us"] * sum(k for _, k in c["phases"].values()) for c in cycles)
        / n
        / 1e3,
        "phases_ms": phases,
        "calls": calls,
    }


def _tree_rows(paths: list[str]) -> list[tuple[str, int, str | None]]:
    """(path, depth, parent if a ``(self)`` row) in depth-first order, a ``(self)`` row closing
    every phase that has children."""
    children: dict[str, list[str]] = {"": []}
    for path in paths:
        parent = path.rpartition(SEP)[0]
        children.setdefault(parent, [])
        children.setdefault(path, [])
        if path not in children[parent]:
            children[parent].append(path)
    rows: list[tuple[str, int, str | None]] = []

    def visit(path: str, depth: int) -> None:
        rows.append((path, depth, None))
        for child in children[path]:
            visit(child, depth + 1)
        if children[path]:
            rows.append((f"{path}{SEP}(self)", depth + 1, path))

    for top in children[""]:
        visit(top, 0)
    return rows


def self_ms(summary: dict, path: str) -> float:
    """A phase's own time: its wall time less its timed children's."""
    phases = summary["phases_ms"]
    inner = sum(ms for p, ms in phases.items() if p.rpartition(SEP)[0] == path)
    return phases[path] - inner


def phase_table(profiles: dict[str, dict]) -> list[str]:
    """Lines of a table: every phase's ms per cycle and % of the cycle, one column pair per
    configuration (``-``: that configuration has no such phase)."""
    paths = list(dict.fromkeys(p for s in profiles.values() for p in s["phases_ms"]))
    width = max(44, *(2 * d + len(p.rpartition(SEP)[2]) + 2 for p, d, _ in _tree_rows(paths)))
    columns = [max(24, len(name) + 2) for name in profiles]
    lines = [
        f"{'phase (rank 0; ms per cycle, % of cycle)':<{width}}"
        + "".join(f"{name:>{c}}" for name, c in zip(profiles, columns))
    ]

    def row(label: str, values: list[float | None]) -> str:
        cells = [
            f"{'-':>{c}}" if value is None else f"{value:.2f} {100 * value / s['cycle_ms']:>6.1f}%".rjust(c)
            for value, s, c in zip(values, profiles.values(), columns)
        ]
        return f"{label:<{width}}" + "".join(cells)

    summaries = list(profiles.values())
    lines.append(row("cycle (one pass of the scheduler loop)", [s["cycle_ms"] for s in summaries]))
    for path, depth, parent in _tree_rows(paths):
        label = "  " * (depth + 1) + path.rpartition(SEP)[2]
        key = parent or path
        values = [
            None if key not in s["phases_ms"] else self_ms(s, parent) if parent else s["phases_ms"][path]
            for s in summaries
        ]
        lines.append(row(label, values))
    lines.append(row("top-level phases, summed", [s["top_level_ms"] for s in summaries]))
    lines.append(
        row("cycle less its top-level phases", [s["cycle_ms"] - s["top_level_ms"] for s in summaries])
    )
    lines.append(
        row("the profiler's hooks, within (estimate)", [s["profiler_overhead_ms"] for s in summaries])
    )
    lines.append(
        f"{'decode cycles averaged':<{width}}"
        + "".join(f"{s['cycles']:>{c}}" for s, c in zip(summaries, columns))
    )
    return lines


def predicted_ratio(accept_length: float, plain_cycle_ms: float, cycle_ms: float) -> float:
    """Tokens/s of a speculative configuration over plain decoding's: each of its cycles commits
    ``accept_length`` tokens per request where a plain cycle commits one."""
    return accept_length * plain_cycle_ms / cycle_ms


def draft_steps_ms(summary: dict) -> list[float]:
    """Each draft step's forward (ms per cycle), in order."""
    phases = summary["phases_ms"]
    steps = []
    while (path := f"{DRAFT_STEP}{len(steps) + 1}") in phases:
        steps.append(phases[path])
    return steps


def gpu_cycle(spec: dict, plain: dict) -> dict:
    """Plain and speculative cycles (ms, CPU scale) predicted for a GPU from CPU phases.

    Assumptions: a forward over a few rows is memory-bound (it reads the weights once whatever
    the rows), so the verify over the draft tokens costs plain's one-token forward and the draft
    extend one draft step; a one-row forward is memory-bound on the CPU too, so one-row forwards
    keep their measured proportions. ``*_with_rest`` keeps every other phase (scheduler, EAGLE
    bookkeeping, collectives outside the forwards) as measured, in proportion to the forwards;
    ``*_forwards_only`` drops them (a GPU whose overheads hide under its kernels): two ends.
    """
    phases = spec["phases_ms"]
    plain_forward = plain["phases_ms"][PLAIN_FORWARD]
    steps = draft_steps_ms(spec)
    extend = phases.get(EXTEND_FORWARD, 0.0)
    extend_gpu = sum(steps) / len(steps) if steps else extend
    verify = phases[VERIFY_FORWARD]
    return {
        "plain_with_rest": plain["cycle_ms"],
        "cycle_with_rest": spec["cycle_ms"] - verify + plain_forward - extend + extend_gpu,
        "plain_forwards_only": plain_forward,
        "cycle_forwards_only": plain_forward + sum(steps) + extend_gpu,
    }
