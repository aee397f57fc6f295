"""Run an offline ``sglang.Engine`` in a child process and return its outputs.

A crashing scheduler makes SGLang SIGKILL the process that owns the Engine, so the Engine always
lives in a child: ``run_engine(engine_kwargs, steps, env)`` starts
``python -m tests.harness.engine``, which builds the Engine, runs each step in order and
prints one JSON line of results. A step is ``{"generate": {input_ids, sampling_params}}`` or
``{"update_lm_head": path}`` (load a tensor saved with torch.save and pass it to
``Engine.update_weights_from_tensor`` as ``lm_head.weight``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from sglang_frspec.demo.server import ServerError, kill_tree

_RESULT = "FRSPEC_ENGINE_RESULT "


def run_engine(engine_kwargs: dict, steps: list[dict], env: dict, timeout: float = 600.0) -> list:
    """Results of ``steps`` (generate outputs, update replies) from a fresh Engine."""
    request = json.dumps({"engine": engine_kwargs, "steps": steps})
    # Its own session, so the Engine's schedulers and detokenizer can be killed with it.
    child = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        kill_tree(child.pid, grace=5.0)
        stdout, stderr = child.communicate()
        raise ServerError(
            f"engine child timed out after {timeout:.0f}s (its process tree was killed); output:\n"
            f"{stdout[-3000:]}\n{stderr[-6000:]}"
        ) from e
    finally:
        kill_tree(child.pid, grace=5.0)  # leftovers of a child that exited without shutting down
    for line in stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT) :])
    raise ServerError(
        f"engine child exited with status {child.returncode} and no result; output:\n"
        f"{stdout[-3000:]}\n{stderr[-6000:]}"
    )


def _child() -> None:
    import sglang
    import torch

    request = json.loads(sys.stdin.read())
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
    _child()
