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
  which read memory without dispatching an op and are patched for the capture) and an op whose
  output shape depends on values (tagged ``dynamic_output_shape``: ``nonzero``, ``masked_select``,
  ``unique``, indexing with a bool mask) raise ``GraphCaptureError``;
- at replay, a buffer the graph reads from outside (memory it did not allocate) must still be
  alive with the storage it had at capture (``GraphReplayError``); a graph holds addresses, not
  tensors, so the recording holds only weak references to those storages, as torch's
  ``torch/utils/_cuda_debug.py`` input-liveness checker does. ``RecordedGraphBackend`` also
  checks that the runner's buffer attributes still hold the storages the graph reads: a buffer
  replaced after capture is never read by a graph, even while the old one stays alive.

Collectives (``c10d._allgather_base_``, ``c10d.allreduce_``, SGLang's ``sglang.*`` ops, ...) are
recorded like any op; a replay re-issues them in the recorded order and waits on each returned
work object, as a stream orders them. ``RecordedGraphBackend`` compares each capture's sequence
of collectives across the ranks of its group at capture.
"""

from __future__ import annotations

import contextlib
import hashlib
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# Ops whose dynamic_output_shape tag covers only bool-mask indices (integer indexing has a fixed shape).
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "sglang", "sgl_kernel"}
_COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast",
                     "all_to_all", "alltoall", "shm_")  # fmt: skip
# Tensor methods that read a tensor's memory on the host without dispatching an op (on a CPU tensor).
_HOST_READS = ("tolist", "numpy", "cpu")


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
                if isinstance(result, torch.ScriptObject) and result._has_method("wait"):
                    result.wait()  # a collective's work: later ops read its output
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


def _storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records every op dispatched inside it; refuses what a CUDA graph capture cannot hold."""

    def __init__(self):
        super().__init__()
        self.ops: list[_RecordedOp] = []
        self.slots: list[_Slot] = []
        self.collectives: list[str] = []
        self._slot_of: dict[int, int] = {}  # id(tensor) -> slot, for tensors seen in this capture
        self._seen: list[torch.Tensor] = []  # keeps the ids above unique until the capture ends
        self._owned_storages: set[int] = set()

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
        _refuse_unless_capturable(func, args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        name = str(func)
        if func.namespace in _COLLECTIVE_NAMESPACES and any(w in name for w in _COLLECTIVE_WORDS):
            self.collectives.append(_describe_collective(name, leaves))
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            # torch.tensor(host data) inside the capture: the data is a constant of the graph.
            self._owned_storages.add(_storage_address(args[0]))
        input_storages = {_storage_address(x) for x in leaves if isinstance(x, torch.Tensor)}
        recorded_args = [
            ("slot", self.slot_of(x, name)) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        out = func(*args, **kwargs)
        results, _ = tree_flatten(out)
        outputs: list[int | None] = []
        for result in results:
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


def _caller() -> str:
    """Where the capture's Python asked for the op: the innermost frame outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "unknown"


def _refuse_unless_capturable(func, args, kwargs) -> None:
    if torch.Tag.data_dependent_output in func.tags:
        raise GraphCaptureError(
            f"{func} inside a graph capture: it reads a tensor's value on the host (.item(), bool(t), "
            f"int(t), a Python branch on a tensor), a host sync that a CUDA graph cannot capture; "
            f"at {_caller()}"
        )
    if torch.Tag.dynamic_output_shape in func.tags:
        indices, _ = tree_flatten(args[1] if len(args) > 1 else kwargs.get("indices"))
        bool_index = any(
            isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8) for x in indices
        )
        if func._schema.name not in _INDEX_OPS or bool_index:
            raise GraphCaptureError(
                f"{func} inside a graph capture: its output shape depends on tensor values, which a CUDA "
                f"graph cannot capture (it syncs with the host to size the output); at {_caller()}"
            )


def _describe_collective(name: str, leaves: list[Any]) -> str:
    shapes = [f"{x.dtype}{list(x.shape)}" for x in leaves if isinstance(x, torch.Tensor)]
    groups = [x for x in leaves if isinstance(x, str)]  # SGLang's ops name their group
    return f"{name}({', '.join(shapes + groups)})"


@contextlib.contextmanager
def _host_reads_refused() -> Iterator[None]:
    """Make ``.tolist()``, ``.numpy()`` and ``.cpu()`` raise: on a GPU each copies to the host and syncs."""
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def refuse(name: str) -> Callable[..., Any]:
        def refused(self, *args, **kwargs):
            raise GraphCaptureError(
                f"Tensor.{name}() inside a graph capture: it copies a tensor to the host and syncs, "
                f"which a CUDA graph cannot capture; at {_caller()}"
            )

        return refused

    for name in _HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


_recording = [False]  # whether record() is running: what a capture stream reports on a GPU


def record(fn: Callable[[], Any]) -> tuple[RecordedGraph, Any]:
    """Run ``fn`` once under the recorder: the graph of its ops and ``fn``'s output."""
    recorder = _Recorder()
    _recording[0] = True
    try:
        with _host_reads_refused(), recorder:
            out = fn()
    finally:
        _recording[0] = False
    leaves, spec = tree_flatten(out)
    output_leaves = [("slot", recorder.slot_of(x, "the output")) if isinstance(x, torch.Tensor) else x
                     for x in leaves]  # fmt: skip
    graph = RecordedGraph(recorder.ops, recorder.slots, spec, output_leaves, recorder.collectives)
    return graph, out


class RecordedGraphBackend(BaseCudaGraphBackend):
    """An SGLang graph backend that captures by recording ops and replays the recording.

    ``buffer_owners``: objects (the runner, its ``buffers``) whose tensor attributes the runner
    copies each batch into; at replay each attribute whose storage the graph reads must still
    hold it. ``group``: a process group (SGLang's ``tp_group.cpu_group``) over which each
    capture's sequence of collectives must be identical.
    """

    def __init__(self, buffer_owners: Sequence[object] = (), group: dist.ProcessGroup | None = None,
                 warmups: int = 2):  # fmt: skip
        self.graphs: dict[Any, RecordedGraph] = {}
        self.watched: dict[Any, list[tuple[weakref.ref, str, int]]] = {}
        self.buffer_owners = list(buffer_owners)
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
        read = graph.external_storages()
        self.watched[shape_key] = [
            (weakref.ref(owner), name, _storage_address(value))
            for owner in self.buffer_owners
            for name, value in vars(owner).items()
            if isinstance(value, torch.Tensor) and _storage_address(value) in read
        ]

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
        for owner_ref, name, address in self.watched[shape_key]:
            owner = owner_ref()
            now = getattr(owner, name, None) if owner is not None else None
            if not isinstance(now, torch.Tensor) or _storage_address(now) != address:
                current = f"{_storage_address(now):#x}" if isinstance(now, torch.Tensor) else repr(now)
                raise GraphReplayError(
                    f"{type(owner).__name__}.{name} was replaced after capture: the graph reads the "
                    f"storage at {address:#x}, it now holds {current}"
                )
        return self.graphs[shape_key].replay()

    def cleanup(self) -> None:
        self.graphs.clear()
        self.watched.clear()
