"""Test-only SGLang plugin ``frspec_gpu_defaults``: speculative decoding with the overlap scheduler
on, on a CPU, as every GPU server runs it.

SGLang turns the overlap scheduler off for speculative decoding on a CPU device
(``arg_groups/speculative_hook.py:66-78``, "not implemented"). What a CPU actually lacks on that
path is one Triton kernel: ``FutureMap._resolve_spec_extras`` gathers the relayed draft inputs with
``gather_spec_extras`` (``kernels/ops/speculative/gather_spec_extras.py:100``; no CPU driver), and
``overlap_utils`` imports that name directly (``managers/overlap_utils.py:9``). The rest is SGLang's
own code and already CPU-aware: events and the copy stream only ``if _is_cuda``
(``overlap_utils.py:220-229, 327-334``), no ``record_stream`` for CPU tensors (``:123-127``), and
``torch.cpu.Stream``/``Event`` are no-op stubs. This plugin lifts the switch-off and gives the gather
its torch equivalent (equal to the kernel under ``TRITON_INTERPRET=1``, ``tests/test_gpu_defaults.py``),
so the scheduler's overlap loop, the future map, its relay buffers and the results processed one
step late all run as on a GPU.

What it cannot show: concurrency. A CPU device has one stream and the forward returns finished, so
a race between the forward stream and the scheduler's next batch (a buffer freed or reused while a
kernel still reads it) never happens here.

Servers load it when ``site/`` is on ``PYTHONPATH`` and ``overlap_env`` named it in
``SGLANG_PLUGINS``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

PLUGIN = "frspec_gpu_defaults"
SITE = Path(__file__).resolve().parent / "site"
CPU_SWITCH_OFF = "sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu"
RELAY_GATHER = "sglang.srt.managers.overlap_utils.gather_spec_extras"
RELAY_LINE = "frspec-gpu-defaults: overlap scheduler on, draft inputs relayed through the future map"
RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
DECODE_LINE = "frspec-gpu-defaults: first decode batch, overlap scheduler "  # + "on" or "off"
FIRST_RELAY_LINE = "frspec-gpu-defaults: first relayed draft input, topk_index "  # + its rows

logger = logging.getLogger(__name__)
_relayed = False  # the relay line is logged at the first gather of each scheduler
_decoded = False  # the decode line, at the first decode batch of each scheduler


def register() -> None:
    """The entry point: keep overlap on for speculative decoding on CPU; the relay's gather in torch."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CPU_SWITCH_OFF, keep_overlap_on, HookType.REPLACE)
    HookRegistry.register(RELAY_GATHER, gather_spec_extras, HookType.REPLACE)
    HookRegistry.register(RUN_BATCH, log_first_decode, HookType.AFTER)
    torch.Tensor.record_stream = _record_stream_on_device_only(torch.Tensor.record_stream)


def _record_stream_on_device_only(record_stream):
    """``Tensor.record_stream`` that does nothing for a CPU tensor. SGLang before 0.5.22 records the
    relay's indices on the current stream without the CPU guard later releases have
    (``overlap_utils.FutureMap._resolve_spec_extras``), and torch refuses a CPU tensor there
    ("unknown parameter type"); a CPU has one stream and no reuse hazard, as that guard says."""

    def record(tensor: torch.Tensor, stream) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    return record


def keep_overlap_on(server_args) -> None:
    """Replaces SGLang's CPU switch-off: the overlap scheduler stays as the arguments set it."""


def gather_spec_extras(
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    output_tokens_buf: torch.Tensor,
    hidden_states_buf: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """SGLang's fused relay gather: each buffer's rows at ``indices``, as new tensors."""
    global _relayed
    if not _relayed:
        _relayed = True
        logger.info(RELAY_LINE)
        # What the first draft step reads: on a PD decode node, the draft input the node built
        # from the received metadata (and the plugin translated), stashed for the next forward.
        logger.info(FIRST_RELAY_LINE + "%s", topk_index_buf[indices].tolist())
    hidden = None if hidden_states_buf is None else hidden_states_buf[indices]
    return topk_p_buf[indices], topk_index_buf[indices], output_tokens_buf[indices], hidden


def log_first_decode(result, scheduler, batch, *args, **kwargs):
    """AFTER hook on ``Scheduler.run_batch``: log, once, whether the first decode batch ran under
    the overlap scheduler. A server can turn overlap off after this plugin lifted the CPU switch-off
    (another argument, a release that moved the switch-off): its tests then still pass, under the
    CPU's loop instead of the GPU's, unless this line is read (``ranks_not_under_overlap``)."""
    global _decoded
    if not _decoded and batch.forward_mode.is_decode():
        _decoded = True
        logger.info(DECODE_LINE + ("on" if scheduler.enable_overlap else "off"))
    return result


def overlap_env(env: dict) -> dict:
    """``env`` (a CPU server's, from ``cpu_env``) with this plugin loaded too. Its ``site/`` must be
    on ``PYTHONPATH``: the test suite puts it there for every process (``tests/conftest.py``), so
    servers with and without the plugin fork from one zygote, whose key holds ``PYTHONPATH``."""
    return env | {"SGLANG_PLUGINS": f"{env['SGLANG_PLUGINS']},{PLUGIN}"}


def relayed_ranks(log: str) -> set[int]:
    """The TP ranks of a server log whose scheduler read draft inputs back from the future map."""
    return set(_lines_by_rank(log, re.escape(RELAY_LINE)))


def first_relayed_topk_index(log: str) -> dict[int, list[list[int]]]:
    """Each TP rank's first relayed ``topk_index`` rows (``FIRST_RELAY_LINE``)."""
    rows = _lines_by_rank(log, re.escape(FIRST_RELAY_LINE) + r"(?P<rows>\[[-\d, \[\]]*\])")
    return {rank: json.loads(m["rows"]) for rank, m in rows.items()}


def ranks_not_under_overlap(log: str, speculative: bool) -> list[int]:
    """The TP ranks of a server log that decoded, but not as a GPU does: with the overlap scheduler
    off or, on a speculative server, without reading draft inputs back from the future map. A rank
    that never decoded (a server refused at start-up, or sent no request) is none of them."""
    relayed = relayed_ranks(log)
    decoded = _lines_by_rank(log, re.escape(DECODE_LINE) + "(?P<overlap>on|off)")
    return sorted(rank for rank, line in decoded.items()
                  if line["overlap"] == "off" or (speculative and rank not in relayed))  # fmt: skip


def _lines_by_rank(log: str, line: str) -> dict[int, re.Match]:
    """Each TP rank's line matching the regex ``line`` in a server log (rank 0 for a TP=1 server,
    whose lines carry no rank)."""
    return {int(m["rank"] or 0): m for m in re.finditer(rf"(?: TP(?P<rank>\d+))?\] {line}", log)}
