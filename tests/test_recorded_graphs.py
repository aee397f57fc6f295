"""The recorded-graph backend on its own (``tests/harness/gpu_defaults/recorded_graphs.py``): a replay
equals the function run eagerly on the same buffers, runs the captured ops and not the Python, and
what a CUDA graph cannot hold is refused at capture or at replay."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tests.harness.gpu_defaults.recorded_graphs import (
    GraphCaptureError,
    GraphReplayError,
    RecordedGraphBackend,
    host_memory,
    record,
)

# Custom ops with a Python body, as SGLang registers its own (direct_register_custom_op: Library.impl
# for the device's key) and as torch.library.custom_op does: the body's Python is what runs at capture.
_body_calls: list[int] = []
_LIB = torch.library.Library("frspec_recorded_graphs_test", "DEF")
_LIB.define("thrice_if_finite(Tensor x) -> Tensor")
_LIB.impl("thrice_if_finite", lambda x: x * 3 if torch.isfinite(x).all() else x, "CPU")  # a host sync


@torch.library.custom_op("frspec_recorded_graphs_test::twice_plus_calls", mutates_args=())
def _twice_plus_calls(x: torch.Tensor) -> torch.Tensor:
    _body_calls.append(1)  # Python state the body reads: frozen at capture on a GPU
    return x * 2 + len(_body_calls)


class Buffers:
    """Static inputs and an out= buffer, as a graph runner holds them."""

    def __init__(self):
        self.x = torch.zeros(4, 6)
        self.bias = torch.zeros(6)
        self.out = torch.empty(4, 6)
        self.scale = {"value": 2.0}  # a Python scalar read at capture

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x.copy_(torch.randn(4, 6, generator=g))
        self.bias.copy_(torch.randn(6, generator=g))

    def forward(self) -> tuple[torch.Tensor, ...]:
        h = self.x * self.scale["value"]  # a new tensor (the graph's memory)
        h.add_(self.bias)  # in place
        tail = h[:, 2:]  # a view ...
        tail.mul_(0.5)  # ... written through
        torch.mul(self.x, self.bias, out=self.out)  # out=
        top = torch.topk(torch.cat([h, self.out], 1), 3, dim=1).values.t()  # a view of an op's output
        offset = torch.tensor(1.5)  # host data inside the capture: a kernel's scalar, a constant
        return top + offset, tail, self.out[1:]


def test_replay_equals_eager_on_new_values_and_freezes_the_python():
    buffers = Buffers()
    buffers.fill(0)
    graph, captured = record(buffers.forward)
    addresses = [t.data_ptr() for t in captured]
    for seed in (1, 2):
        buffers.fill(seed)
        replayed = [t.clone() for t in graph.replay()]
        eager = buffers.forward()
        for r, e in zip(replayed, eager, strict=True):
            torch.testing.assert_close(r, e, rtol=0, atol=0)
        assert not torch.equal(replayed[0], captured[0].new_zeros(captured[0].shape))
    assert [t.data_ptr() for t in graph.replay()] == addresses  # the outputs stay where they were captured
    buffers.fill(3)
    buffers.scale["value"] = 3.0  # Python state: the graph keeps what it saw at capture
    frozen = graph.replay()[0].clone()
    buffers.scale["value"] = 2.0
    torch.testing.assert_close(frozen, buffers.forward()[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("host_read", "message"),
    [
        (lambda t: t.sum().item(), "aten._local_scalar_dense.default inside a graph capture: it reads"),
        (lambda t: bool((t > 0).any()), "aten._local_scalar_dense.default inside a graph capture: it reads"),
        (lambda t: torch.equal(t, t), "aten.equal.default inside a graph capture: it reads"),
        (lambda t: t.tolist(), "Tensor.tolist() inside a graph capture"),
        (lambda t: t.numpy(), "Tensor.numpy() inside a graph capture"),
        (lambda t: t.cpu(), "Tensor.cpu() inside a graph capture"),
        (lambda t: torch.nonzero(t), "aten.nonzero.default inside a graph capture: its output shape"),
        (lambda t: t[t > 0], "aten.index.Tensor inside a graph capture: its output shape"),
        (lambda t: torch.unique(t), "inside a graph capture: its output shape"),
        (lambda t: torch.repeat_interleave(t.long()), "aten.repeat_interleave.Tensor inside a graph capture"),
        (lambda t: t.__setitem__(t > 0, t[0]), "aten.index_put_.default with a bool mask inside a graph"),
        (lambda t: torch.index_put(t, (t > 0,), t.sum()), "aten.index_put.default with a bool mask inside"),
        (
            lambda t: t.index_put_((t > 0,), torch.tensor(1.0), accumulate=True),
            "index_put_.default with a bool",
        ),
        (
            lambda t: torch.ops.frspec_recorded_graphs_test.thrice_if_finite(t),
            "aten._local_scalar_dense.default inside a graph capture: it reads",
        ),
    ],
)
@pytest.mark.parametrize("inference_mode", [False, True], ids=["grad-mode", "inference-mode"])
def test_capture_refuses_host_syncs_and_data_dependent_shapes(host_read, message, inference_mode):
    """Also under inference mode (SGLANG_ENABLE_TORCH_INFERENCE_MODE) and inside a custom op's body,
    where composite ops (``bool(t)``: ``is_nonzero``) reach the recorder undecomposed."""
    t = torch.randn(5)
    pattern = message.replace("(", r"\(").replace(")", r"\)")
    with torch.inference_mode(inference_mode), pytest.raises(GraphCaptureError, match=pattern):
        record(lambda: host_read(t * 2))
    assert t.tolist() and t.cpu() is t  # restored after the capture


def test_integer_indexing_is_captured():
    table, rows = torch.arange(10.0) * 3, torch.tensor([4, 1])
    graph, _ = record(lambda: table[rows])
    rows.copy_(torch.tensor([0, 9]))
    assert graph.replay().tolist() == [0.0, 27.0]


def test_a_masked_scalar_write_and_repeat_interleave_with_output_size_are_captured():
    """``x[mask] = scalar`` becomes ``masked_fill_`` on a GPU (no sync), and ``repeat_interleave``
    given its ``output_size`` needs no host read: both replay on the new values."""
    x, counts = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([2, 0, 1])

    def forward() -> torch.Tensor:
        y = x.clone()
        y[y < 0] = 0.0
        return torch.repeat_interleave(y, counts, output_size=3)

    graph, captured = record(forward)
    assert captured.tolist() == [1.0, 1.0, 3.0]
    x.copy_(torch.tensor([-1.0, 4.0, 5.0]))
    counts.copy_(torch.tensor([1, 1, 1]))
    assert graph.replay().tolist() == [0.0, 4.0, 5.0]


def test_a_custom_ops_python_body_runs_at_capture_and_its_ops_replay():
    """A custom op's Python body runs once, at capture, as on a GPU (its kernels are captured, not
    its Python): the replay runs the ops it dispatched, on the new values, and not the body."""
    x = torch.ones(3)
    _body_calls.clear()
    graph, captured = record(lambda: torch.ops.frspec_recorded_graphs_test.twice_plus_calls(x))
    assert captured.tolist() == [3.0] * 3
    x.fill_(5.0)
    assert graph.replay().tolist() == [11.0] * 3 and len(_body_calls) == 1


def test_replay_refuses_a_freed_input():
    holder = {"buffer": torch.ones(3)}
    graph, _ = record(lambda: holder["buffer"] * 2)
    holder["buffer"] = torch.full((3,), 5.0)  # the old buffer's last reference goes
    with pytest.raises(
        GraphReplayError, match=r"the graph reads a buffer that was freed after capture \(torch.float32 \[3\]"
    ):
        graph.replay()


def test_replay_refuses_an_input_whose_storage_moved():
    buffer = torch.ones(3)
    graph, _ = record(lambda: buffer * 2)
    buffer.untyped_storage().resize_(4096)  # the same tensor, its memory reallocated
    with pytest.raises(GraphReplayError, match="the graph reads a buffer whose storage moved after capture"):
        graph.replay()


class _Head(torch.nn.Module):
    """Reads a submodule's parameter and a tensor in a nested dict."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4, bias=False)
        self.tables = {"scale": {"per_column": torch.full((4,), 2.0)}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.tables["scale"]["per_column"]


class _Runner:
    """A graph runner's state: an input buffer, a module, and a plain object holding a list."""

    def __init__(self):
        self.x = torch.zeros(2, 6)
        self.head = _Head()
        self.state = SimpleNamespace(offsets=[torch.ones(4)])

    def forward(self) -> torch.Tensor:
        return self.head(self.x) + self.state.offsets[0]


def _replace_weight(runner: _Runner) -> torch.Tensor:
    old = runner.head.proj.weight
    runner.head.proj.weight = torch.nn.Parameter(old.detach() * 3, requires_grad=False)
    return old


def _replace_table_entry(runner: _Runner) -> torch.Tensor:
    old = runner.head.tables["scale"]["per_column"]
    runner.head.tables["scale"]["per_column"] = old * 3
    return old


def _replace_list_entry(runner: _Runner) -> torch.Tensor:
    old = runner.state.offsets[0]
    runner.state.offsets[0] = old * 3
    return old


def _replace_holder(runner: _Runner) -> torch.Tensor:
    old = runner.state.offsets[0]
    runner.state = SimpleNamespace(offsets=[old * 3])  # an object on the path replaced
    return old


@pytest.mark.parametrize(
    ("replace", "path"),
    [
        (_replace_weight, "_Runner.head.proj.weight"),
        (_replace_table_entry, "_Runner.head.tables['scale']['per_column']"),
        (_replace_list_entry, "_Runner.state.offsets[0]"),
        (_replace_holder, "_Runner.state.offsets[0]"),
    ],
)
def test_the_backend_refuses_a_replay_after_a_tensor_it_reads_was_replaced(replace, path):
    """The backend watches every tensor the graph reads that is reachable from its roots (a module's
    parameters, dict and list entries, nested objects), not just the roots' own attributes: one
    replaced after capture, the old one still alive, fails the replay naming its path."""
    runner = _Runner()
    backend = RecordedGraphBackend([runner], warmups=1)
    backend.capture_one(1, runner.forward)
    runner.x.copy_(torch.randn(2, 6, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(backend.replay(1, None), runner.forward(), rtol=0, atol=0)  # the control
    old = replace(runner)
    with pytest.raises(GraphReplayError, match=re.escape(f"{path} was replaced after capture: the graph")):
        backend.replay(1, None)
    del old  # alive until here: the replay would have read it, stale, rather than freed memory


@pytest.mark.parametrize(
    ("transfer", "message"),
    [
        (lambda t, h: t.to("cpu"), "Tensor.to('cpu') inside a graph capture: a blocking copy"),
        (lambda t, h: t.to(device=torch.device("cpu"), dtype=torch.half), "Tensor.to(device(type='cpu'))"),
        (lambda t, h: h.copy_(t), "aten.copy_.default between host and device memory inside a graph"),
        (lambda t, h: t.copy_(h), "aten.copy_.default between host and device memory inside a graph"),
        (lambda t, h: torch.tensor([1.0], device="cpu"), "torch.tensor(data, device='cpu') inside a"),
        (lambda t, h: torch.as_tensor([1], device=t.device), "torch.as_tensor(data, device=device(type="),
        (lambda t, h: t + torch.tensor([1.0] * 5), "aten.add.Tensor reads host memory (torch.float32 [5])"),
        (lambda t, h: t[torch.tensor([0, 2])], "aten.index.Tensor reads host memory (torch.int64 [2])"),
        (lambda t, h: t * h, "aten.mul.Tensor reads host memory (torch.float32 [5]) inside a graph"),
    ],
)
def test_capture_refuses_host_transfers(transfer, message):
    """Host memory (marked, or host data turned into a tensor) meets device memory only through a
    blocking copy, or a kernel that cannot read it: both refused, the call named."""
    t, host = torch.randn(5), host_memory(torch.zeros(5))
    with pytest.raises(GraphCaptureError, match=re.escape(message)):
        record(lambda: transfer(t * 2, host))
    assert t.to("cpu") is t and torch.tensor([1.0], device="cpu").tolist() == [1.0]  # restored


def test_host_ops_run_once_at_capture_and_async_copies_replay():
    """As on a GPU: an op on host memory runs at capture and not at replay, a device op reads a 0-dim
    host tensor as a scalar, and an async copy into a pinned buffer (``non_blocking``) is captured."""
    x, steps, mirror = torch.ones(3), host_memory(torch.zeros(())), host_memory(torch.zeros(3))

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        steps.add_(1)  # host bookkeeping: the CPU runs it while capturing
        assert steps.tolist() == steps.cpu().item() == steps.to("cpu").item() == 1.0  # no transfer
        y = x * torch.tensor(2.0) + steps
        mirror.copy_(y, non_blocking=True)
        return y, y.to("cpu", non_blocking=True)

    graph, _ = record(forward)
    x.fill_(5.0)
    y, on_host = graph.replay()
    assert steps.item() == 1.0 and y.tolist() == mirror.tolist() == on_host.tolist() == [11.0] * 3
