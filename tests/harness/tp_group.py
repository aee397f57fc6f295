"""Run a function on every rank of a real SGLang TP group (gloo, SGLang's own distributed init).

``run_tp_group(function, tp_size, payload)`` starts ``tp_size`` processes, each of
which publishes ``ServerArgs(device="cpu", tp_size=...)``, calls SGLang's
``init_distributed_environment`` (gloo) and ``initialize_model_parallel``, then calls
``function(payload)`` (a module-level function, imported by its module's name) and sends back its
(picklable) return value. A rank that raises or a group
that outlives the timeout fails the call with every rank's traceback and the order in which the
ranks exited; all ranks are killed, so a rank stuck in a collective never hangs the caller. A rank
whose function returned waits for the others before it exits: rank 0's process serves the group's
TCPStore, which ranks still creating groups (or running their function) may need.

The ranks are forked from a zygote (``tools.serving.zygote``) that has imported SGLang's
distributed and server-args modules once for this environment, so a group does not pay an
SGLang import per rank.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_frspec.demo.cpu import cpu_env
from sglang_frspec.demo.server import free_port, kill_tree
from tools.serving.zygote import fork_module

PORT_RETRIES = 3
PORT_TAKEN = "EADDRINUSE"  # torch's TCPStore: "... name: EADDRINUSE, message: address already in use"
# What every rank imports before its function runs (the cases' own imports are light after these).
RANK_PRELOAD = (
    "sglang.srt.distributed",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.vocab_parallel_embedding",
    "sglang.srt.runtime_context",
    "sglang.srt.server_args",
    "sglang_frspec.demo.fixtures",
)


class TPGroupError(RuntimeError):
    """A rank failed or the group timed out; ``rank_errors`` maps rank -> traceback text."""

    def __init__(self, message: str, rank_errors: dict[int, str]):
        super().__init__(message)
        self.rank_errors = rank_errors


def run_tp_group(
    function: Callable[[Any], Any],
    tp_size: int,
    payload=None,
    *,
    timeout: float = 300.0,
    server_args: dict | None = None,
    env: dict | None = None,
) -> list:
    """Run ``function`` on ``tp_size`` ranks; returns results in rank order.

    ``server_args`` adds ServerArgs fields (e.g. dp attention settings) for every rank; ``env``
    adds variables to this process's environment. A group whose rendezvous port was taken by
    another process between picking and binding it (the error names EADDRINUSE) runs again on
    a fresh port, as ``SGLangServer`` does.
    """
    if "." in function.__qualname__ or function.__module__ == "__main__":
        raise ValueError(
            f"{function.__qualname__}: ranks import it by name, so it must be a module-level function"
        )
    target = f"{function.__module__}:{function.__qualname__}"
    run_env = cpu_env(tp_size, base=os.environ | (env or {}))
    retries = PORT_RETRIES
    while True:
        try:
            return _run_once(target, tp_size, payload, timeout, server_args or {}, run_env)
        except TPGroupError as e:
            if not retries or not any(PORT_TAKEN in err for err in e.rank_errors.values()):
                raise
            retries -= 1


def _run_once(target: str, tp_size: int, payload, timeout: float, server_args: dict, run_env: dict) -> list:
    with tempfile.TemporaryDirectory(prefix="frspec-tp-") as tmp:
        spec = Path(tmp, "spec.pkl")
        spec.write_bytes(
            pickle.dumps(
                {
                    "target": target,
                    "payload": payload,
                    "tp_size": tp_size,
                    "port": free_port(),
                    "server_args": server_args,
                }
            )
        )
        logs = [Path(tmp, f"rank{r}.log") for r in range(tp_size)]
        procs = []
        try:
            for rank in range(tp_size):
                procs.append(fork_module(run_env, RANK_PRELOAD, __name__, [str(spec), str(rank)], logs[rank]))
            start = time.monotonic()
            exited: dict[int, float] = {}  # rank -> seconds after start when it was seen exited
            while len(exited) < tp_size and time.monotonic() < start + timeout:
                exited |= {r: time.monotonic() - start for r, p in enumerate(procs)
                           if r not in exited and p.poll() is not None}  # fmt: skip
                if any(procs[r].returncode != 0 for r in exited):
                    time.sleep(3.0)  # let the other ranks report their own error first
                    break
                time.sleep(0.2)
        finally:
            timed_out = any(p.poll() is None for p in procs)
            for p in procs:  # each rank's whole group, also of ranks that already exited
                kill_tree(p.pid, grace=2.0)
        results, errors = [], {}
        for rank in range(tp_size):
            out = Path(tmp, f"result{rank}.pkl")
            if out.exists():
                ok, value = pickle.loads(out.read_bytes())
                if ok:
                    results.append(value)
                    continue
                errors[rank] = value
            else:
                state = "timed out" if timed_out else f"exit status {procs[rank].returncode}"
                errors[rank] = f"no result ({state}); log:\n" + logs[rank].read_text()[-4000:]
        if errors:
            # Who left first matters: a rank that lost rank 0's TCPStore fails with
            # "Connection reset by peer" or "Broken pipe" in whatever it was doing then.
            order = ", ".join(f"rank {r} (status {procs[r].returncode}) at {t:.1f} s"
                              for r, t in sorted(exited.items(), key=lambda item: item[1]))  # fmt: skip
            detail = f"exited: {order or 'none'}\n" + "\n".join(
                f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())
            )
            raise TPGroupError(f"{len(errors)} of {tp_size} rank(s) failed in {target}:\n{detail}", errors)
        return results


_rank_setup: dict = {}  # this rank's number, TP size and ServerArgs fields, for ``republish``


def _server_args(tp_size: int, extra_args: dict):
    from sglang.srt.server_args import ServerArgs

    from sglang_frspec.demo.fixtures import perm_fixture

    return ServerArgs(
        model_path=perm_fixture().target,
        device="cpu",
        tp_size=tp_size,
        attention_backend="torch_native",
        **extra_args,
    )


def _publish(args, rank: int) -> bool:
    """Publish ``args`` for this rank; whether this release publishes ranks (0.5.20 does not)."""
    from sglang.srt import runtime_context

    # SGLang 0.5.20 publishes no ranks, and its groups take their sizes as arguments (the group
    # cases that older releases run, the every_release tests, are plain TP groups).
    spawn_ranks = getattr(runtime_context, "SpawnRanks", None)
    if spawn_ranks is not None:
        runtime_context.publish(args, role="scheduler", ranks=spawn_ranks(world_rank=rank, gpu_id=rank))
    else:
        runtime_context.publish(args, role="scheduler")
    return spawn_ranks is not None


def republish(**fields) -> None:
    """Publish this rank's ServerArgs again with ``fields`` changed (SGLang's publish is
    last-publish-wins), so cases that differ in a setting read at start-up share one group."""
    _publish(_server_args(_rank_setup["tp_size"], _rank_setup["server_args"] | fields), _rank_setup["rank"])


def _init_rank(rank: int, tp_size: int, port: int, extra_args: dict) -> None:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    _rank_setup.update(rank=rank, tp_size=tp_size, server_args=extra_args)
    publishes_ranks = _publish(_server_args(tp_size, extra_args), rank)
    init_distributed_environment(
        backend="gloo",
        world_size=tp_size,
        rank=rank,
        local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    if publishes_ranks:
        initialize_model_parallel()
    else:
        initialize_model_parallel(tensor_model_parallel_size=tp_size)


def _child(spec_path: str, rank: int) -> None:
    import importlib

    import torch.distributed

    spec = pickle.loads(Path(spec_path).read_bytes())
    out = Path(spec_path).with_name(f"result{rank}.pkl")
    try:
        _init_rank(rank, spec["tp_size"], spec["port"], spec["server_args"])
        module, func = spec["target"].split(":")
        value = getattr(importlib.import_module(module), func)(spec["payload"])
        # Rank 0's process serves the TCPStore: leaving before the others are done would cut them
        # off mid-rendezvous (SGLang's groups are created without a store barrier, so a rank can
        # finish a collective-free function while others still create theirs).
        torch.distributed.barrier()
        out.write_bytes(pickle.dumps((True, value)))
    except BaseException:
        out.write_bytes(pickle.dumps((False, traceback.format_exc())))
        raise


if __name__ == "__main__":
    # Run as imported, so that the cases' ``republish`` sees this rank's setup.
    from tests.harness.tp_group import _child as child

    child(sys.argv[1], int(sys.argv[2]))
