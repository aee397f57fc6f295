"""GPU-server-check stand-in for ``sgl_kernel``: the CPU stand-in plus two names the CUDA path calls.

The device has no ``sgl_kernel`` (its wheel links a libtorch other than the device's). On the
CUDA path with this check's flags SGLang 0.5.23 imports many of its names but calls only
``utils.is_arch_support_pdl`` (the Triton attention backend) and ``weak_ref_tensor`` (breakable
CUDA graphs); every other name imports as the CPU stand-in's placeholder, which raises
``NotImplementedError`` when called, so an unexpected kernel fails loudly.
"""

import sys
from pathlib import Path

import torch

# The CPU stand-in (sglang_frspec/demo/cpu_site/sgl_kernel), found from this repository.
_CPU_STANDIN = Path(__file__).resolve().parents[4] / "sglang_frspec" / "demo" / "cpu_site" / "sgl_kernel"
if not (_CPU_STANDIN / "__init__.py").is_file():
    raise ImportError(f"sgl_kernel GPU-check stand-in: the CPU stand-in is not at {_CPU_STANDIN}")
# Run the CPU stand-in as this module: its submodule finder and placeholders, and its `_impl`
# (found on this package's path) for the names it implements.
__path__.append(str(_CPU_STANDIN))
_source = _CPU_STANDIN / "__init__.py"
exec(compile(_source.read_text(), str(_source), "exec"))


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself: a strong reference is correct, it only keeps graph outputs alive longer."""
    return tensor


def _is_arch_support_pdl() -> bool:
    """No programmatic dependent launch: the Triton attention backend then launches plainly."""
    return False


# `from sgl_kernel.utils import is_arch_support_pdl` must find a real function, not a placeholder.
__import__("sgl_kernel.utils")
sys.modules["sgl_kernel.utils"].is_arch_support_pdl = _is_arch_support_pdl
