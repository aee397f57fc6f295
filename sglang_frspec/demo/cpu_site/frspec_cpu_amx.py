"""CPU-test-only SGLang plugin: keep `--attention-backend intel_amx` and take the sampling verify.

SGLang downgrades intel_amx to torch_native on CPUs without AMX, and torch_native has no EAGLE
support; reporting AMX keeps it. The layers still run torch-native code; the attention ops come
from the sgl_kernel stand-in beside this file.

SGLang's EAGLE verify commits argmax on CPU whatever the temperature (``_verify_uses_greedy`` lists
``is_cpu``: there are no CPU sampling kernels). The stand-in has torch versions of both
(``sgl_kernel/_sampling.py``), so this plugin routes the CPU to the sampling path and gives the
verify those two ops: temperature > 0 requests then take SGLang's own sampling verify here.

Two linear-attention (Qwen3.5 / Qwen3-Next) paths that have no CPU branch without AMX get one:
the gated RMSNorm of the GDN output (``layernorm_gated.py:35`` decides ``_use_cpu`` from the real
CPU, so it launches Triton at ``layernorm_gated.py:529``) takes SGLang's AMX branch, which calls the
stand-in's ``fused_rmsnorm_gated_cpu``; the post-verify state commit, whose Triton kernels refuse
CPU tensors (``mamba_state_scatter_triton.py:343,507``), is the stand-in's torch version.
Qwen3-Next adds three: fla's ``FusedRMSNormGated`` takes its AMX branch (the same op), the MoE
shared-expert gate's Triton launch is the stand-in's, and ``torch.get_device_module()`` answers the
CPU module when there is no CUDA.
"""

import functools
import importlib
import importlib.util
from collections.abc import Callable

VERIFY = "sglang.srt.speculative.eagle_utils."
THREADS_ENV = "sglang.srt.distributed.bootstrap._init_cpu_threads_env"


def _sampling_verify_on_cpu(original: Callable[..., bool], *, is_cpu: bool, **flags: bool) -> bool:
    """``_verify_uses_greedy`` as on a device with sampling kernels: only all-greedy batches go greedy."""
    return original(is_cpu=False, **flags)


def parse_cpu_list(spec: str) -> list[int]:
    """The cores of a ``SGLANG_CPU_OMP_THREADS_BIND`` entry such as ``0``, ``0-3`` or ``0-3,8``."""
    cores = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def _bind_rank_threads(original: Callable[..., None], *, local_omp_cpuid, **kwargs) -> None:
    """SGLang's CPU thread binding, also where its AMX kernels are missing.

    SGLang binds each rank's OpenMP threads to its ``SGLANG_CPU_OMP_THREADS_BIND`` cores only
    through sgl-kernel's AMX op (``distributed/bootstrap.py:281-285``) and otherwise logs that
    binding is disabled: every rank then runs torch's default thread count (all cores), so TP=2 on
    two cores runs four busy threads on two cores (the target's head GEMM 3-4x slower than alone).
    Here each rank keeps its own cores and that many threads; the log line reads them back.
    """
    import logging
    import os

    import torch

    original(local_omp_cpuid=local_omp_cpuid, **kwargs)
    if local_omp_cpuid is None:
        return
    cores = parse_cpu_list(str(local_omp_cpuid))
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    logging.getLogger(__name__).info(
        "frspec-cpu: rank threads %d on cores %s", torch.get_num_threads(), sorted(os.sched_getaffinity(0))
    )


def _logged(op: str, family: str = "sampling") -> Callable:
    """The stand-in's op, noted in ``SGL_SHIM_LOG`` at each call (tests check the path taken)."""
    from sgl_kernel import _log

    run = getattr(importlib.import_module(f"sgl_kernel._{family}"), op)

    def call(*args, **kwargs):
        _log(f"CALLED {family}.{op}")
        return run(*args, **kwargs)

    return call


def register() -> None:
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()
    eagle_utils = importlib.import_module(VERIFY.rstrip("."))
    # SGLang 0.5.20 has no such switch: its verify commits argmax on a CPU for every batch
    # (``if sampling_info.is_all_greedy or _is_cpu ...``), as stock SGLang does there.
    if hasattr(eagle_utils, "_verify_uses_greedy"):
        HookRegistry.register(VERIFY + "_verify_uses_greedy", _sampling_verify_on_cpu, HookType.AROUND)
    HookRegistry.register(THREADS_ENV, _bind_rank_threads, HookType.AROUND)
    # The Triton ops of rejection sampling (the verify, and the draft proposal's Gumbel-max pick,
    # from SGLang 0.5.21 on): the registry also rebinds every module's ``from ... import`` of them.
    for module, op in (
        ("sglang.kernels.ops.speculative.reject_sampling", "chain_speculative_sampling_triton"),
        ("sglang.kernels.ops.speculative.row_argmax", "row_argmax"),
    ):
        if importlib.util.find_spec(module) is not None:
            HookRegistry.register(f"{module}.{op}", _logged(op), HookType.REPLACE)
    op = "scatter_mamba_states_after_mtp_verify"
    HookRegistry.register(
        f"sglang.kernels.ops.mamba.mamba_state_scatter_triton.{op}",
        _logged(op, "linear_attention"),
        HookType.REPLACE,
    )
    # Qwen3-Next's MoE shared-expert gate launches Triton on CPU (models/qwen2_moe.py:877).
    op = "_launch_fused_gate_sigmoid_mul"
    HookRegistry.register(
        f"sglang.kernels.ops.elementwise.elementwise.{op}",
        _logged("fused_gate_sigmoid_mul", "linear_attention"),
        HookType.REPLACE,
    )
    # The gated norm's AMX branch (layernorm_gated.py:517-527): norm before a swish gate, no
    # groups (SGLang asserts that there), on the stand-in's op.
    importlib.import_module("sglang.kernels.ops.attention.fla.layernorm_gated")._use_cpu = True
    # Qwen3-Next's GDN output norm is fla's FusedRMSNormGated (models/qwen3_next.py:244), whose CPU
    # branch (fused_norm_gate.py:20,451) is the same op: silu gate after an RMS norm.
    importlib.import_module("sglang.kernels.ops.attention.fla.fused_norm_gate")._use_cpu = True
    # Ops that are None on CPU: set, not a REPLACE hook, which would rebind every module global
    # that is the original object (every None in the process) to the replacement.
    # Releases before 0.5.23 import them from sgl_kernel inside the verify: the stand-in's too.
    sgl_kernel = importlib.import_module("sgl_kernel")
    for op in ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob"):
        setattr(eagle_utils, op, _logged(op))
        setattr(sgl_kernel, op, _logged(op))
    if not torch.cuda.is_available():
        # DeepSeek's set_embed_and_head (sglang/srt/models/deepseek_v2.py:3448, run when a NextN
        # draft takes the target's head) synchronizes CUDA unconditionally: nothing to wait for here.
        torch.cuda.synchronize = lambda device=None: None
        # A CUDA build reports CUDA as the accelerator without a driver, so get_device_module()
        # is torch.cuda, and Qwen3-Next's GDN norm asks it for the device
        # (models/qwen3_next.py:235,252): with no device given, the CPU module answers.
        torch.get_device_module = _cpu_by_default(torch.get_device_module)


def _cpu_by_default(get_device_module: Callable) -> Callable:
    """``torch.get_device_module`` answering the CPU module when no device is given.

    Cached as torch's own is (``functools.cache``): Dynamo registers a handler for
    ``torch.get_device_module.__wrapped__`` when it first traces a torch function
    (``torch/_dynamo/variables/torch.py:2507``), so a plain function there fails every
    ``torch.compile``d function at its first call (Gemma 3's rotary embedding,
    ``rotary_embedding/utils.py:96``; the EAGLE draft's ``_select_top_k_tokens_later``,
    ``speculative/spec_utils.py:437``); under the cache that handler also takes this function's
    calls inside compiled code.
    """

    @functools.cache
    def cpu_by_default(device=None):
        return get_device_module(device if device is not None else "cpu")

    return cpu_by_default
