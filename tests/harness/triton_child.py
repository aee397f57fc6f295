"""Run code in a child Python under Triton's interpreter (``TRITON_INTERPRET=1`` is read when
triton compiles a kernel, so it must be set before the child imports anything)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_interpreted(child_code: str, inputs: object, folder: Path, timeout: float) -> dict:
    """Save ``inputs`` to ``folder/in.pt``, run ``child_code`` with the in and out paths as its
    arguments (CPU only, interpreted Triton), and return what it saved to ``folder/out.pt``."""
    torch.save(inputs, folder / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.run(
        [sys.executable, "-c", child_code, str(folder / "in.pt"), str(folder / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(folder / "out.pt")
