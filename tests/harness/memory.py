"""Peak bytes of tensors that a block of torch work allocates and keeps alive (CPU tests).

A dispatch mode sees every op's outputs: a storage not seen before is a new allocation, held
until its last reference goes (a weak reference expires). The peak of the live total is what the
block itself allocated at any one time, free of other threads' allocations. A buffer that a
backend allocates inside one op and is not an output (e.g. gloo's staging copies) is not counted.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as m: ...``; then ``m.peak`` is the most bytes held at once."""

    def __enter__(self) -> PeakTensorMemory:
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self._known = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Storages that exist before the op (inputs) are not new, even if this block never saw them.
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._known.add(t.untyped_storage()._cdata)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._known and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out
