"""Environment that lets real SGLang 0.5.23 run on a CPU-only machine (tests, demo, benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path

CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
PLUGIN = "frspec"  # this project's entry point
CPU_AMX_PLUGIN = "frspec_cpu_amx"  # the CPU-test plugin in cpu_site/


def cpu_env(tp_size: int, *, with_plugin: bool = True, base: dict | None = None) -> dict:
    """Environment for SGLang processes on CPU with ``tp_size`` ranks.

    ``with_plugin=False`` excludes this project's plugin (stock SGLang behaviour) through
    ``SGLANG_PLUGINS``; the CPU-test plugin is always selected.
    """
    import torch

    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # else is_cpu() is False and CUDA-only imports run
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_SITE), env.get("PYTHONPATH")]))
    env["SGLANG_PLUGINS"] = f"{PLUGIN},{CPU_AMX_PLUGIN}" if with_plugin else CPU_AMX_PLUGIN
    if torch.version.cuda is not None:
        # A CUDA build of torch on a CPU box: keep PyNccl from loading libnccl.
        env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    if tp_size > 1:
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp_size))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")  # torch.compile warm-up costs ~20 s per server on 2 cores
    return env


def pythonpath_with(env: dict, entry: Path | str) -> str:
    """``env``'s ``PYTHONPATH`` with ``entry`` first, unless it is on it already (then unchanged, so
    an environment keyed on, as the test zygotes are, stays the same)."""
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    return os.pathsep.join(entries if str(entry) in entries else [str(entry), *entries])


# Server arguments every CPU run needs (EAGLE on CPU runs only on the intel_amx backend).
CPU_SERVER_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "intel_amx",
    "--max-total-tokens",
    "8192",
    "--disable-cuda-graph",
    "--skip-server-warmup",
]


def eagle_args(
    draft: str,
    token_map: str | None = None,
    *,
    algorithm: str = "EAGLE",
    steps: int = 2,
    topk: int = 2,
    draft_tokens: int = 4,
) -> list[str]:
    """Speculative-decoding arguments (EAGLE by default; optionally a token map)."""
    args = [
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]
    if token_map is not None:
        args += ["--speculative-token-map", token_map]
    return args
