"""CPU-test-only stand-in for ``sgl_kernel`` (see ../README.md).

Every ``sgl_kernel[.sub].name`` imports. Names implemented in ``_impl`` (attention, KV cache and
tree ops), ``_sampling`` (the sampling-verify ops), ``_linear_attention`` (the gated-delta-net
conv, gating, delta-rule, projection-split, gated-norm and state-commit ops) or
``_gated_attention`` (Qwen3.5's q/k Gemma norms and sigmoid output gate) work; any other name is
a placeholder that raises ``NotImplementedError`` when called, so a code path that needs a
missing kernel fails loudly. ``SGL_SHIM_LOG=FILE`` appends each resolved name to FILE.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

import torch

from sgl_kernel import _gated_attention, _impl, _linear_attention, _sampling

_FAMILIES = (_impl, _sampling, _linear_attention, _gated_attention)  # one module per op family
_OWN_MODULES = {m.__name__ for m in _FAMILIES}

__version__ = "0.0.0+frspec-cpu-standin"


def _log(line: str) -> None:
    path = os.environ.get("SGL_SHIM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class _Missing:
    """Placeholder for a kernel the stand-in does not implement."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        _log("CALLED-MISSING " + self._name)
        raise NotImplementedError(f"sgl_kernel CPU stand-in: {self._name} is not implemented")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in: missing {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        for family in _FAMILIES:
            if hasattr(family, attr):
                _log(f"IMPL {module_name}.{attr}")
                return getattr(family, attr)
        _log(f"IMPORT-MISSING {module_name}.{attr}")
        return _Missing(f"{module_name}.{attr}")

    return __getattr__


__getattr__ = _module_getattr("sgl_kernel")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.<sub>`` importable as a namespace of placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname not in _OWN_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())

# Some SGLang code (the intel_amx attention backend, the GDN backend, Qwen3.5's layers at import)
# calls torch.ops.sgl_kernel.<op> directly.
for _family in (_impl, _linear_attention, _gated_attention):
    for _name in _family.TORCH_OPS:
        setattr(torch.ops.sgl_kernel, _name, getattr(_family, _name))
