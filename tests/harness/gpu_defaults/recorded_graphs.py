"""Recorded graphs: a CPU stand-in for a captured CUDA graph that replays the captured ops, not the Python.

``record(fn)`` runs ``fn`` once under a ``TorchDispatchMode`` and keeps every aten op it dispatched,
with its arguments. ``RecordedGraph.replay()`` re-executes those ops in order on the same memory:
tensors created inside the capture are kept (the graph's private pool) and each op's result is
copied into the tensor it produced at capture, ops that write in place (``add_``, ``out=``,
collectives) write in place again, and views are re-derived from their (fixed) bases. So a replay
computes what a CUDA graph's replay computes: Python branches, Python scalars and shapes are
frozen at capture; only the contents of the buffers the graph reads can change.

What a GPU refuses or breaks on, this refuses too:

- inside a capture, a host read of a tensor's value (``.item()``, ``bool(t)``, ``int(t)``,
  ``torch.equal``: ops tagged ``data_dependent_output``; ``.tolist()``, ``.numpy()`` and ``.cpu()``,
  which read memory without dispatching an op and are patched for the capture), a host transfer
  (see Host memory below), an op whose output shape depends on values (tagged
  ``dynamic_output_shape``: ``nonzero``, ``masked_select``, ``unique``, indexing with a bool mask,
  ``repeat_interleave`` without ``output_size``) and a write through a bool mask (``index_put_``,
  ``x[mask] = t``: the mask becomes indices; ``x[mask] = scalar`` runs as ``masked_fill_``)
  raise ``GraphCaptureError``;
- at replay, a buffer the graph reads from outside (memory it did not allocate) must still be
  alive with the storage it had at capture (``GraphReplayError``); a graph holds addresses, not
  tensors, so the recording holds only weak references to those storages, as torch's
  ``torch/utils/_cuda_debug.py`` input-liveness checker does. ``RecordedGraphBackend`` also
  checks that every attribute reachable from the runner and the worker (modules' parameters and
  buffers, tensor attributes, dict and list entries, nested objects) that held a storage the
  graph reads still holds it: a tensor replaced after capture is never read by a graph, even
  while the old one stays alive.

Host memory. Every tensor here is on the CPU, and the stand-in runners' device is "cpu": a tensor
is device memory unless it is host memory, which is what GPU code puts on the host explicitly.
Inside a capture, data turned into a tensor (``torch.tensor(data)``, ``torch.from_numpy``: both
dispatch ``aten.lift_fresh``) is host memory, and so is a buffer marked with ``host_memory(t)`` (a
GPU program's pinned or ``*_cpu`` buffer, which on the CPU looks like any other tensor). Then, as
on a GPU: an op on host memory only runs once, at capture, and is not replayed (the CPU ran it, the
graph holds no host op); a device op may read a 0-dim host tensor (a kernel takes it as a scalar)
but no other host tensor; a blocking copy between host and device (``copy_``, ``.to("cpu")``,
``torch.tensor(data, device=...)``) is refused, as it syncs. GPU code names the host "cpu" and a
new tensor's ``device`` the device, and so does this: a ``.to(self.device)`` or
``torch.tensor(data, device=self.device)`` inside a capture is refused here although the
stand-in's device is "cpu" (SGLang's captured code does neither).

A custom op whose kernel is a Python function (``torch.library.custom_op``, ``Library.impl``, as
SGLang's ``direct_register_custom_op``) is traced into: its Python runs once, at capture, and the
ops it dispatches are recorded, as a GPU captures its kernels and not its Python. There, and under
inference mode, dispatch runs below autograd, so a composite op (``bool(t)``: ``is_nonzero``)
reaches the recorder whole: it is decomposed, as with autograd on, so its host read is seen.

Collectives (``c10d._allgather_base_``, ``c10d.allreduce_``, SGLang's ``sglang.*`` ops, torch's
functional ``_c10d_functional.*``, ...) are recorded like any op; a replay re-issues them in the
recorded order and waits on each returned work object or functional output before the next op
reads it, as a stream orders them. At capture, a collective (its work object, or the
``wait_tensor`` on a functional collective's output) must complete within ``collective_timeout``:
a rank that skips a collective the others issue would leave them waiting for the group's timeout
(minutes), where a GPU's capture would hang.
``RecordedGraphBackend`` compares each capture's sequence of collectives across the ranks of its
group at capture.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import threading
import traceback
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 (registers _c10d_functional's Python ops)
from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# Writes through indices: untagged, yet a bool mask among them is turned into indices (nonzero).
_INDEX_PUTS = {"aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "sglang", "sgl_kernel"}
_COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
                     "all_to_all", "alltoall", "shm_")  # fmt: skip
# Tensor methods that read a tensor's memory on the host without dispatching an op (on a CPU tensor).
_HOST_READS = ("tolist", "numpy", "cpu")
# Host data becoming a tensor: torch.tensor(data), torch.as_tensor(data), torch.from_numpy(array).
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
# funcol's wrapper of a collective's output in an AsyncCollectiveTensor (a Python op, no storage).
_WRAP_ASYNC = torch.ops._c10d_functional._wrap_tensor_autograd.default
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
# Where a custom op's own kernel is registered, below the dispatch key of this mode.
_PYTHON_KERNEL_KEYS = ("CPU", "CompositeExplicitAutograd")
_CPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)  # far above a capture's skew between ranks
# Storages of host memory (see the module's docstring), weakly: a freed buffer's address is reused.
_host_storages: dict[int, StorageWeakRef] = {}


class GraphCaptureError(RuntimeError):
    """An operation a CUDA graph cannot capture (a host sync or a data-dependent shape)."""


class GraphReplayError(RuntimeError):
    """A replay would read memory that is no longer the captured buffer."""


@dataclass
class _ExternalInput:
    """A tensor the graph reads from outside: a weak reference to its storage and its geometry."""

    storage: StorageWeakRef
    address: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    first_reader: str

    def tensor(self) -> torch.Tensor:
        """The tensor the graph reads now: the same view of the same storage, if it is alive."""
        storage = (
            None if self.storage.expired() else torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        )
        if storage is None:
            raise GraphReplayError(
                f"the graph reads a buffer that was freed after capture ({self.dtype} {list(self.size)} at "
                f"{self.address:#x}, first read by {self.first_reader}): a CUDA graph would read freed memory"
            )
        if storage.data_ptr() != self.address:  # resized in place: the graph reads the old address
            raise GraphReplayError(
                f"the graph reads a buffer whose storage moved after capture ({self.dtype} "
                f"{list(self.size)}, {self.address:#x} -> {storage.data_ptr():#x}, "
                f"first read by {self.first_reader})"
            )
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass
class _Slot:
    """A tensor of the recording: an external input, memory the graph owns, or a view re-derived at replay."""

    kind: str  # "external" | "owned" | "derived"
    external: _ExternalInput | None = None
    owned: torch.Tensor | None = None


@dataclass
class _RecordedOp:
    func: torch._ops.OpOverload
    args_spec: Any
    args: list[Any]  # flat leaves; a tensor is ("slot", index)
    outputs: list[int | None]  # per flat output leaf: the slot it writes, None for a non-tensor


def _is_slot(leaf: Any) -> bool:
    return isinstance(leaf, tuple) and len(leaf) == 2 and leaf[0] == "slot"


@dataclass
class RecordedGraph:
    """The ops of one capture, replayable on the captured memory."""

    ops: list[_RecordedOp]
    slots: list[_Slot]
    output_spec: Any
    output_leaves: list[Any]
    collectives: list[str] = field(default_factory=list)

    def external_storages(self) -> dict[int, _ExternalInput]:
        """The storages the graph reads from outside, by address."""
        return {s.external.address: s.external for s in self.slots if s.kind == "external"}

    def replay(self) -> Any:
        """Run the recorded ops on the captured memory; return the capture's outputs (now refilled)."""
        env: list[torch.Tensor | None] = [
            slot.external.tensor() if slot.kind == "external" else slot.owned for slot in self.slots
        ]

        def value(leaf: Any) -> Any:
            return env[leaf[1]] if _is_slot(leaf) else leaf

        for op in self.ops:
            args, kwargs = tree_unflatten([value(leaf) for leaf in op.args], op.args_spec)
            results, _ = tree_flatten(op.func(*args, **kwargs))
            for result, slot_index in zip(results, op.outputs, strict=True):
                if _is_work(result):
                    result.wait()  # a collective's work: later ops read its output
                elif op.func.namespace == "_c10d_functional" and isinstance(result, torch.Tensor):
                    # A functional collective fills a new tensor asynchronously: wait before it is
                    # copied into the captured output (the recorded wait_tensor names that one).
                    torch.ops._c10d_functional.wait_tensor(result)
                if slot_index is None:
                    continue
                slot = self.slots[slot_index]
                if slot.kind == "derived":
                    env[slot_index] = result
                elif slot.kind == "owned" and result is not slot.owned:
                    if result.shape != slot.owned.shape:
                        shapes = f"{list(result.shape)} at replay, {list(slot.owned.shape)} at capture"
                        raise GraphReplayError(f"{op.func} returned {shapes}")
                    slot.owned.copy_(result)
        return tree_unflatten([value(leaf) for leaf in self.output_leaves], self.output_spec)


def _has_python_body(func: torch._ops.OpOverload) -> bool:
    """An op whose CPU kernel is a Python function (``torch.library.custom_op``, ``Library.impl``)."""
    name = func._schema.name.split("::")[1]
    return any(
        f"{func.namespace}/{op}/{key}" in torch.library._impls
        for op in (name, f"{name}.{func._overloadname}")
        for key in _PYTHON_KERNEL_KEYS
    )


def _is_work(x: Any) -> bool:
    return isinstance(x, torch.ScriptObject) and x._has_method("wait")


def _storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def host_memory(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as host memory (a pinned or pageable buffer of a GPU program); return ``t``."""
    for address in [a for a, ref in _host_storages.items() if ref.expired()]:
        del _host_storages[address]
    if t.untyped_storage().nbytes():  # an empty storage has no address of its own
        _host_storages[_storage_address(t)] = StorageWeakRef(t.untyped_storage())
    return t


def is_host_memory(t: torch.Tensor) -> bool:
    ref = _host_storages.get(_storage_address(t))
    return ref is not None and not ref.expired() and t.untyped_storage().nbytes() > 0


class _Recorder(TorchDispatchMode):
    """Records every op dispatched inside it; refuses what a CUDA graph capture cannot hold."""

    def __init__(self, collective_timeout: datetime.timedelta):
        super().__init__()
        self.collective_timeout = collective_timeout
        self.ops: list[_RecordedOp] = []
        self.slots: list[_Slot] = []
        self.collectives: list[str] = []
        self._slot_of: dict[int, int] = {}  # id(tensor) -> slot, for tensors seen in this capture
        self._seen: list[torch.Tensor] = []  # keeps the ids above unique until the capture ends
        self._owned_storages: set[int] = set()
        self._functional_outputs: dict[int, str] = {}  # a functional collective's output -> its op

    def slot_of(self, t: torch.Tensor, reader: str) -> int:
        """The slot of ``t``; a tensor first seen here is memory the graph did not create."""
        if id(t) in self._slot_of:
            return self._slot_of[id(t)]
        address = _storage_address(t)
        if address in self._owned_storages or t.untyped_storage().nbytes() == 0:
            slot = _Slot("owned", owned=t)  # another view of the graph's own memory, or nothing to read
        else:
            storage = StorageWeakRef(t.untyped_storage())
            geometry = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            slot = _Slot("external", external=_ExternalInput(storage, address, *geometry, reader))
        return self._add(t, slot)

    def _add(self, t: torch.Tensor, slot: _Slot) -> int:
        self.slots.append(slot)
        self._slot_of[id(t)] = len(self.slots) - 1
        self._seen.append(t)
        return len(self.slots) - 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _WRAP_ASYNC:  # wait at once, as funcol does when traced: a stream orders it so
            func = torch.ops._c10d_functional.wait_tensor.default
        elif _has_python_body(func):
            # On a GPU the body's Python runs once, at capture, and its kernels are the graph: record
            # the ops it dispatches (the Python stays at capture) rather than the op, whose replay
            # would run the Python again.
            with self:
                return func.redispatch(_CPU_KERNEL, *args, **kwargs)
        elif torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE):
            # Below autograd (inference mode, a custom op's body) a composite op reaches this mode
            # whole: record what it decomposes into, as with autograd on (bool(t): is_nonzero, item).
            with self:
                return func.decompose(*args, **kwargs)
        if func in _LIFTS:
            host_memory(args[0])
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        host = [x for x in tensors if is_host_memory(x)]
        if host and len(host) == len(tensors):
            return self._host_op(func, args, kwargs)
        _refuse_host_transfer(func, args, host)
        _refuse_unless_capturable(func, args, kwargs)
        name = str(func)
        if func.namespace in _COLLECTIVE_NAMESPACES and any(w in name for w in _COLLECTIVE_WORDS):
            self.collectives.append(_describe_collective(name, leaves))
        input_storages = {_storage_address(x) for x in leaves if isinstance(x, torch.Tensor)}
        recorded_args = [
            ("slot", self.slot_of(x, name)) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        out = self._wait_tensor_for_every_rank(args[0]) if func is _WAIT_TENSOR else func(*args, **kwargs)
        results, _ = tree_flatten(out)
        outputs: list[int | None] = []
        for result in results:
            if _is_work(result):
                self._wait_for_every_rank(result, name)
            elif func.namespace == "_c10d_functional" and isinstance(result, torch.Tensor):
                self._functional_outputs[_storage_address(result)] = name
            if not isinstance(result, torch.Tensor):
                outputs.append(None)
            elif id(result) in self._slot_of:
                outputs.append(None)  # the op returned an input (in place, out=): written in place again
            elif _storage_address(result) in input_storages and result.untyped_storage().nbytes():
                outputs.append(self._add(result, _Slot("derived")))  # a view: re-derived from its base
            else:
                self._owned_storages.add(_storage_address(result))
                outputs.append(self._add(result, _Slot("owned", owned=result)))
        self.ops.append(_RecordedOp(func, spec, recorded_args, outputs))
        return out

    def _wait_for_every_rank(self, work: torch.ScriptObject, name: str) -> None:
        try:
            torch._C._distributed_c10d.Work.unbox(work).wait(self.collective_timeout)
        except RuntimeError as e:
            raise self._not_completed(name, str(e)) from e

    def _wait_tensor_for_every_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """``wait_tensor`` on a functional collective's output, within ``collective_timeout``: it
        takes no timeout (it waits for the group's), so it waits in a thread that a skipped
        collective leaves blocked until the group's timeout frees it."""
        done, result = threading.Event(), {}
        inference = torch.is_inference_mode_enabled()

        def wait() -> None:
            try:
                with torch.inference_mode(inference):
                    result["tensor"] = _WAIT_TENSOR(tensor)
            except BaseException as e:  # handed to the capturing thread
                result["error"] = e
            finally:
                done.set()

        threading.Thread(target=wait, name="recorded-graph-wait_tensor", daemon=True).start()
        name = self._functional_outputs.get(_storage_address(tensor), str(_WAIT_TENSOR))
        if not done.wait(self.collective_timeout.total_seconds()):
            raise self._not_completed(name, "its wait_tensor is still waiting")
        if "error" in result:
            raise self._not_completed(name, str(result["error"])) from result["error"]
        return result["tensor"]

    def _not_completed(self, name: str, detail: str) -> GraphCaptureError:
        seconds = self.collective_timeout.total_seconds()
        return GraphCaptureError(
            f"{name} did not complete within {seconds:g} s of a graph capture: a rank that skips a "
            f"collective inside a capture leaves the others waiting (on a GPU, a hung capture); "
            f"at {_caller()}: {detail}"
        )

    def _host_op(self, func, args, kwargs) -> Any:
        """An op on host memory only: on a GPU the CPU runs it once, at capture, and the graph holds
        no host op; its results are host memory the graph keeps (a device op may read one as a scalar)."""
        out = func(*args, **kwargs)
        for result in tree_flatten(out)[0]:
            if isinstance(result, torch.Tensor):
                self._owned_storages.add(_storage_address(host_memory(result)))
        return out


def _caller() -> str:
    """Where the capture's Python asked for the op: the innermost frame outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "unknown"


def _refuse_host_transfer(func, args, host: list[torch.Tensor]) -> None:
    """Refuse a device op on host memory: a blocking copy syncs; a kernel reads only a 0-dim host tensor."""
    if not host:
        return
    if func is torch.ops.aten.copy_.default:
        if not (len(args) > 2 and args[2]):  # non_blocking: an async copy with a pinned buffer is captured
            raise GraphCaptureError(
                f"{func} between host and device memory inside a graph capture: a blocking copy syncs "
                f"with the host, which a CUDA graph cannot capture; at {_caller()}"
            )
    elif any(x.dim() for x in host):
        shapes = ", ".join(f"{x.dtype} {list(x.shape)}" for x in host)
        raise GraphCaptureError(
            f"{func} reads host memory ({shapes}) inside a graph capture: a CUDA kernel reads no host "
            f"tensor but a 0-dim one, and moving it to the device is a blocking copy; at {_caller()}"
        )


def _refuse_unless_capturable(func, args, kwargs) -> None:
    if torch.Tag.data_dependent_output in func.tags:
        raise GraphCaptureError(
            f"{func} inside a graph capture: it reads a tensor's value on the host (.item(), bool(t), "
            f"int(t), a Python branch on a tensor), a host sync that a CUDA graph cannot capture; "
            f"at {_caller()}"
        )
    name = func._schema.name
    if name in _INDEX_PUTS and _has_mask(args[1]) and not _is_masked_fill(args, kwargs):
        raise GraphCaptureError(
            f"{func} with a bool mask inside a graph capture: the mask is turned into indices (nonzero), "
            f"a host sync that a CUDA graph cannot capture (only x[mask] = a Python scalar is captured, "
            f"as masked_fill_); at {_caller()}"
        )
    if torch.Tag.dynamic_output_shape in func.tags and not _fixed_shape(name, args, kwargs):
        raise GraphCaptureError(
            f"{func} inside a graph capture: its output shape depends on tensor values, which a CUDA "
            f"graph cannot capture (it syncs with the host to size the output); at {_caller()}"
        )


def _has_mask(indices: Sequence[torch.Tensor | None]) -> bool:
    return any(x is not None and x.dtype in (torch.bool, torch.uint8) for x in indices)


def _is_masked_fill(args, kwargs) -> bool:
    """Whether an index_put runs as masked_fill_ (ATen's ``canDispatchToMaskedFill``): no
    accumulation, one index (the mask) and a one-element value on the host, read there at launch."""
    indices, value = args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    masks = [x for x in indices if x is not None]
    return not accumulate and len(masks) == 1 and value.numel() == 1 and is_host_memory(value)


def _fixed_shape(name: str, args, kwargs) -> bool:
    """A ``dynamic_output_shape`` op whose shape is fixed here: integer indexing, and a
    ``repeat_interleave`` given its ``output_size`` (no host read of the repeats' sum)."""
    if name == "aten::index":
        return not _has_mask(args[1])
    return name == "aten::repeat_interleave" and kwargs.get("output_size") is not None


def _describe_collective(name: str, leaves: list[Any]) -> str:
    shapes = [f"{x.dtype}{list(x.shape)}" for x in leaves if isinstance(x, torch.Tensor)]
    groups = [x for x in leaves if isinstance(x, str)]  # SGLang's ops name their group
    return f"{name}({', '.join(shapes + groups)})"


def _transfer_refused(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"{what} inside a graph capture: a blocking copy between host and device syncs, which a CUDA "
        f"graph cannot capture; at {_caller()}"
    )


@contextlib.contextmanager
def _host_transfers_refused() -> Iterator[None]:
    """Patch, for the capture, the host transfers that dispatch nothing on a CPU tensor.

    ``.tolist()``, ``.numpy()``, ``.cpu()`` and ``.to("cpu")`` of device memory raise (on a GPU
    each copies to the host and syncs; ``.to("cpu", non_blocking=True)`` copies into new host
    memory, as a captured async copy into a pinned buffer does); ``torch.tensor(data, device=...)`` and
    ``torch.as_tensor(data, device=...)`` of host data raise (a blocking copy to the device).
    """
    tensor_to, new_tensor, as_tensor = torch.Tensor.to, torch.tensor, torch.as_tensor
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def refuse(name: str) -> Callable[..., Any]:
        def refused(self, *args, **kwargs):
            if is_host_memory(self):  # already on the host: no transfer
                return originals[name](self, *args, **kwargs)
            raise _transfer_refused(f"Tensor.{name}()")

        return refused

    def to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # Only a device named in the call: .to(dtype) and .to(other) (other's device) stay on the device.
        device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if device is None or torch.device(device).type != "cpu" or is_host_memory(self):
            return tensor_to(self, *args, **kwargs)
        if not kwargs.get("non_blocking", len(args) > 2 and args[2]):  # .to(device, dtype, non_blocking)
            raise _transfer_refused(f"Tensor.to({device!r})")
        return host_memory(tensor_to(self, *args[:3], **kwargs | {"copy": True}))

    def from_data(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def refused_with_device(data, *args, **kwargs) -> torch.Tensor:
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                raise _transfer_refused(f"torch.{factory.__name__}(data, device={kwargs['device']!r})")
            return factory(data, *args, **kwargs)

        return refused_with_device

    for name in _HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    torch.Tensor.to, torch.tensor, torch.as_tensor = to, from_data(new_tensor), from_data(as_tensor)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.Tensor.to, torch.tensor, torch.as_tensor = tensor_to, new_tensor, as_tensor


_recording = [False]  # whether record() is running: what a capture stream reports on a GPU


def record(
    fn: Callable[[], Any], collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT
) -> tuple[RecordedGraph, Any]:
    """Run ``fn`` once under the recorder: the graph of its ops and ``fn``'s output."""
    recorder = _Recorder(collective_timeout)
    _recording[0] = True
    try:
        with _host_transfers_refused(), recorder:
            out = fn()
    finally:
        _recording[0] = False
    leaves, spec = tree_flatten(out)
    output_leaves = [("slot", recorder.slot_of(x, "the output")) if isinstance(x, torch.Tensor) else x
                     for x in leaves]  # fmt: skip
    graph = RecordedGraph(recorder.ops, recorder.slots, spec, output_leaves, recorder.collectives)
    return graph, out


_WALK_DEPTH = 16  # attribute hops from a root: well past a runner's path to a layer's weight
_MISSING = object()
# Objects with a __dict__ that holds no state a graph reads: code, enum members, weak references.
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.MethodType, weakref.ref, enum.Enum)


@dataclass(frozen=True)
class _Watch:
    """A tensor attribute the graph reads, reached from a root by ``steps`` (("attr" | "item", key))."""

    root: weakref.ref
    steps: tuple[tuple[str, Any], ...]
    address: int
    path: str


def _children(obj: Any) -> Iterator[tuple[tuple[str, Any], Any]]:
    """The (step, value) pairs below ``obj``: a module's parameters, buffers, submodules and other
    attributes; a dict's, list's or tuple's items; a plain object's attributes."""
    if isinstance(obj, torch.nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            for name, value in vars(obj)[table].items():
                yield ("attr", name), value
        for name, value in vars(obj).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                yield ("attr", name), value
    elif isinstance(obj, dict):
        for key, value in list(obj.items()):
            yield ("item", key), value
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield ("item", index), value
    else:
        for name, value in list(vars(obj).items()):
            yield ("attr", name), value


def _holds_state(value: Any) -> bool:
    """Whether the walk descends into ``value``: a module, a container, or a plain object (not
    code, not torch's own objects, not a recording: a graph's own memory is no input of it)."""
    if isinstance(value, (torch.nn.Module, dict, list, tuple)):
        return True
    if isinstance(value, (_NOT_STATE, RecordedGraph, RecordedGraphBackend)):
        return False
    plain = isinstance(getattr(value, "__dict__", None), dict)
    return plain and not type(value).__module__.startswith("torch")


def _path(root: object, steps: tuple[tuple[str, Any], ...]) -> str:
    return type(root).__name__ + "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in steps)


def _resolve(root: object, steps: tuple[tuple[str, Any], ...]) -> Any:
    """What ``steps`` from ``root`` lead to now (``_MISSING`` where a step no longer exists)."""
    obj = root
    for kind, key in steps:
        try:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
        except (AttributeError, KeyError, IndexError, TypeError):
            return _MISSING
    return obj


def _watches(roots: Sequence[object], read: set[int]) -> list[_Watch]:
    """Every tensor attribute reachable from ``roots`` whose storage is in ``read``, each by its
    shortest path (breadth first, each object walked once)."""
    watches: list[_Watch] = []
    visited: set[int] = set()
    level = [(root, root, ()) for root in roots]
    for _ in range(_WALK_DEPTH + 1):
        below = []
        for root, obj, steps in level:
            if id(obj) in visited:
                continue
            visited.add(id(obj))
            for step, value in _children(obj):
                if isinstance(value, torch.Tensor):
                    address, path = _storage_address(value), steps + (step,)
                    if address in read:
                        watches.append(_Watch(weakref.ref(root), path, address, _path(root, path)))
                elif _holds_state(value):
                    below.append((root, value, steps + (step,)))
        level = below
    return watches


class RecordedGraphBackend(BaseCudaGraphBackend):
    """An SGLang graph backend that captures by recording ops and replays the recording.

    ``roots``: objects (the runner, its ``buffers``, the worker) from which every tensor the graph
    reads is watched: their attributes, items and those of the modules and plain objects they
    hold, down to ``_WALK_DEPTH`` hops. At replay each path that led to a storage the graph reads
    must still lead to it: a tensor replaced after capture is never read by a graph, even while
    the old one stays alive. ``group``: a process group (SGLang's ``tp_group.cpu_group``) over
    which each capture's sequence of collectives must be identical.
    """

    def __init__(self, roots: Sequence[object] = (), group: dist.ProcessGroup | None = None,
                 warmups: int = 2):  # fmt: skip
        self.graphs: dict[Any, RecordedGraph] = {}
        self.watched: dict[Any, list[_Watch]] = {}
        self.roots = list(roots)
        self.group = group
        self.warmups = warmups  # SGLang's full backend runs the function twice before capturing

    @contextlib.contextmanager
    def capture_session(self, stream) -> Iterator[None]:
        # torch.cpu has no capture stream to ask; SGLang's runner asks whether one is capturing
        # (decode_cuda_graph_runner.py:658): True while the recorder records, not in warm-ups.
        had = hasattr(torch.cpu, "is_current_stream_capturing")
        if not had:
            torch.cpu.is_current_stream_capturing = lambda: _recording[0]
        try:
            yield
        finally:
            if not had:
                del torch.cpu.is_current_stream_capturing

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None) -> None:
        for _ in range(self.warmups):
            forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        graph, _ = record(forward_fn)
        self._check_collectives_agree(shape_key, graph)
        self.graphs[shape_key] = graph
        self.watched[shape_key] = _watches(self.roots, set(graph.external_storages()))

    def _check_collectives_agree(self, shape_key, graph: RecordedGraph) -> None:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        digest = hashlib.sha256("\n".join(graph.collectives).encode()).hexdigest()
        digests: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, (digest, graph.collectives), group=self.group)
        if len({d for d, _ in digests}) > 1:
            listing = "\n".join(f"rank {r}: {c}" for r, (_, c) in enumerate(digests))
            raise GraphCaptureError(f"the ranks captured different collectives for {shape_key}:\n{listing}")

    def can_run(self, forward_batch, shape_key) -> bool:
        return shape_key in self.graphs

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, shape_key, static_forward_batch, **kwargs) -> Any:
        for watch in self.watched[shape_key]:
            root = watch.root()
            now = _MISSING if root is None else _resolve(root, watch.steps)
            if not isinstance(now, torch.Tensor) or _storage_address(now) != watch.address:
                current = f"{_storage_address(now):#x}" if isinstance(now, torch.Tensor) else "nothing"
                raise GraphReplayError(
                    f"{watch.path} was replaced after capture: the graph reads the storage at "
                    f"{watch.address:#x}, it now holds {current}"
                )
        return self.graphs[shape_key].replay()

    def cleanup(self) -> None:
        self.graphs.clear()
        self.watched.clear()
