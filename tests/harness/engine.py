"""Run an offline ``sglang.Engine`` in a child process and return its outputs.

A crashing scheduler makes SGLang SIGKILL the process that owns the Engine, so the Engine always
lives in a child: ``run_engine(engine_kwargs, steps, env, folder)`` forks
``python -m tests.harness.engine`` from a zygote that has imported SGLang
(``tools/serving/zygote.py``; the Engine's schedulers fork from it, as a forked server's do),
which builds the Engine, runs each step in order and prints one JSON line of results to its log.
A step is ``{"generate": {input_ids, sampling_params}}`` or ``{"update_lm_head": path}`` (load a
tensor saved with torch.save and pass it to ``Engine.update_weights_from_tensor`` as
``lm_head.weight``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sglang_frspec.demo.server import ServerError, kill_tree
from tools.serving.zygote import LAUNCHER_PRELOAD, fork_module

_RESULT = "FRSPEC_ENGINE_RESULT "


def run_engine(
    engine_kwargs: dict,
    steps: list[dict],
    env: dict,
    folder: Path,
    timeout: float = 600.0,
    import_paths: tuple[str, ...] = (),
) -> list:
    """Results of ``steps`` (generate outputs, update replies) from a fresh Engine; its request
    and log are written to ``folder``. ``import_paths`` go first on the child's ``sys.path``, as
    ``PYTHONPATH`` entries would (a ``PYTHONPATH`` of the test's own would start a zygote for it)."""
    request, log = folder / "engine-request.json", folder / "engine.log"
    request.write_text(json.dumps({"engine": engine_kwargs, "steps": steps, "import_paths": import_paths}))
    child = fork_module(env, LAUNCHER_PRELOAD, __name__, [str(request)], log, fork_children=True)
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired as e:
        raise ServerError(
            f"engine child timed out after {timeout:.0f}s; its log:\n{log.read_text()[-6000:]}"
        ) from e
    finally:
        kill_tree(child.pid, grace=5.0)  # the Engine's leftovers (or all of it, after a timeout)
    output = log.read_text(errors="replace")
    for line in output.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise ServerError(
        f"engine child exited with status {child.returncode} and no result; its log:\n{output[-6000:]}"
    )


def _child(request_path: str) -> None:
    import sglang
    import torch

    request = json.loads(Path(request_path).read_text())
    sys.path[:0] = request["import_paths"]  # the Engine's schedulers fork from here and keep it
    engine = sglang.Engine(**request["engine"])
    results = []
    try:
        for step in request["steps"]:
            if "generate" in step:
                results.append(engine.generate(**step["generate"]))
            else:
                weight = torch.load(step["update_lm_head"])
                engine.begin_weight_update()
                reply = engine.update_weights_from_tensor([("lm_head.weight", weight)])
                engine.end_weight_update()
                results.append(list(reply) if isinstance(reply, tuple) else reply)
    finally:
        engine.shutdown()
    print(_RESULT + json.dumps(results), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
