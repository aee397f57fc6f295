"""The CPU stand-in's linear-attention ops (``cpu_site/sgl_kernel/_linear_attention.py``) against
independent references: SGLang's own Triton kernels run by Triton's interpreter
(``TRITON_INTERPRET=1``, in one child process: the variable is read when triton compiles the
decorator, so setting it here would leak into every other test of this process), and
Transformers' torch gated-delta-rule functions (``models/qwen3_next/modeling_qwen3_next.py``).

Fixtures have two key heads and four value heads, key head size 8 and value head size 4, so a
transposed state or a wrong key-head sharing cannot pass. The stand-in file is loaded by path for
the numeric tests; ``test_exported_where_sglang_looks`` imports the package as SGLang does.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from sglang_frspec.demo.cpu import CPU_SITE, cpu_env
from tests.harness.forked_python import run_python
from tests.harness.triton_child import run_interpreted

pytest.importorskip("triton")
hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

_spec = importlib.util.spec_from_file_location(
    "frspec_cpu_site_linear_attention", CPU_SITE / "sgl_kernel" / "_linear_attention.py"
)
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

H, HV, K, V = 2, 4, 8, 4  # key heads, value heads, key head size, value head size
DIM, WIDTH = 6, 4  # conv channels, conv kernel width (Qwen3-Next's)
SLOTS = 5
# An EAGLE tree of 5 draft slots: 0 -> {1, 2}, 1 -> 3, 2 -> 4 (first-child / next-sibling links).
NEXT_TOKEN = [1, 3, 4, -1, -1]
NEXT_SIBLING = [-1, 2, -1, -1, -1]
TREE_PARENTS = [0, 0, 0, 1, 2]

TRITON_CHILD = """
import inspect, sys, torch
from types import SimpleNamespace
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn, causal_conv1d_update
from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
    fused_sigmoid_gating_delta_rule_update,
)
from sglang.kernels.ops.attention.triton_gdn_fused_proj import (
    fused_qkvzba_split_reshape_cat_contiguous,
)
from sglang.kernels.ops.attention.fla import fused_norm_gate, layernorm_gated
from sglang.kernels.ops.elementwise import elementwise
from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
# Launch geometry only: the SM count and the PDL check ask CUDA.
layernorm_gated._get_sm_count = lambda device: 1
layernorm_gated.is_arch_support_pdl = lambda: False
fused_norm_gate.is_arch_support_pdl = lambda: False
elementwise.is_arch_support_pdl = lambda: False
# The two scatter wrappers refuse non-CUDA tensors before launching; the interpreter runs on CPU
# tensors, so re-define each without that one check (everything else as SGLang has it).
for name in ("fused_mamba_state_scatter_with_mask", "fused_conv_window_scatter_with_mask"):
    source = inspect.getsource(getattr(scatter, name))
    assert "not (dst.is_cuda or dst.is_xpu)" in source, name
    exec(source.replace("not (dst.is_cuda or dst.is_xpu)", "False"), scatter.__dict__)

def scatter_after_verify(temporal, intermediate_ssm, conv, windows, *indices):
    caches = SimpleNamespace(temporal=temporal, intermediate_ssm=intermediate_ssm, conv=conv,
                             intermediate_conv_window=windows)
    return scatter.scatter_mamba_states_after_mtp_verify(caches, *indices)

kernels = {"conv_fn": causal_conv1d_fn, "conv_update": causal_conv1d_update,
           "gating": fused_gdn_gating, "recurrent": fused_sigmoid_gating_delta_rule_update,
           "split": fused_qkvzba_split_reshape_cat_contiguous,
           "gated_norm": layernorm_gated.rms_norm_gated, "scatter": scatter_after_verify,
           # fla's kernel writes its result over x (fused_norm_gate.py:223, y = x); the CPU branch
           # returns a new tensor (fused_norm_gate.py:451-455), and Qwen3-Next uses only the
           # return (qwen3_next.py:500): compare the results, x left out.
           "fused_norm_gate": lambda x, g, weight, eps: fused_norm_gate.rms_norm_gated(
               x.clone(), g, weight, None, "silu", eps=eps),
           "shared_gate": elementwise._launch_fused_gate_sigmoid_mul}
cases = torch.load(sys.argv[1])
for case in cases.values():
    case["out"] = kernels[case["kernel"]](*case["args"], **case["kwargs"])
torch.save(cases, sys.argv[2])
"""


def _clone(value):
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_fn_case() -> dict:
    g = _gen(1)
    lens = [5, 3, 4]
    x = torch.randn(DIM, sum(lens), generator=g)
    return {
        "kernel": "conv_fn",
        "args": (x, torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g)),
        "kwargs": {
            "conv_states": torch.randn(SLOTS, DIM, WIDTH - 1, generator=g),
            "query_start_loc": torch.tensor([0, 5, 8, 12], dtype=torch.int32),
            "seq_lens_cpu": lens,
            "cache_indices": torch.tensor([3, 0, 2], dtype=torch.int32),
            "has_initial_state": torch.tensor([True, False, True]),
            "activation": "silu",
        },
    }


def _conv_update_case(seqlen: int, tree: bool) -> dict:
    g = _gen(2 + seqlen + tree)
    batch = 2
    kwargs = {"conv_state_indices": torch.tensor([4, 1], dtype=torch.int32)}
    if seqlen > 1:
        kwargs["intermediate_conv_window"] = torch.zeros(3, seqlen, DIM, WIDTH - 1)
        kwargs["intermediate_state_indices"] = torch.tensor([2, 0], dtype=torch.int32)
    if tree:
        kwargs["retrieve_next_token"] = torch.tensor([NEXT_TOKEN] * batch, dtype=torch.int32)
        kwargs["retrieve_next_sibling"] = torch.tensor([NEXT_SIBLING] * batch, dtype=torch.int32)
        kwargs["retrieve_parent_token"] = torch.full((batch, seqlen), -9, dtype=torch.int32)
    x = torch.randn(batch, DIM, seqlen, generator=g)
    return {
        "kernel": "conv_update",
        "args": (
            x if seqlen > 1 else x[..., 0],
            torch.randn(SLOTS, DIM, WIDTH - 1, generator=g),
            torch.randn(DIM, WIDTH, generator=g),
            torch.randn(DIM, generator=g),
            "silu",
        ),
        "kwargs": kwargs,
    }


def _gating_case() -> dict:
    g = _gen(7)
    tokens = 6
    return {
        "kernel": "gating",
        "args": (
            torch.randn(HV, generator=g),
            torch.randn(tokens, HV, generator=g) * 4,  # reaches both softplus branches
            torch.randn(tokens, HV, generator=g),
            torch.randn(HV, generator=g),
        ),
        "kwargs": {},
    }


def _recurrent_case(batch: int, steps: int, verify: bool, tree: bool) -> dict:
    g = _gen(11 + steps + tree)
    tokens = batch * steps
    kwargs = {
        "A_log": torch.randn(HV, generator=g) * 0.5,
        "a": torch.randn(tokens, HV, generator=g),
        "dt_bias": torch.randn(HV, generator=g),
        "softplus_beta": 1.0,
        "softplus_threshold": 20.0,
        "q": torch.randn(1, tokens, H, K, generator=g),
        "k": torch.randn(1, tokens, H, K, generator=g),
        "v": torch.randn(1, tokens, HV, V, generator=g),
        "b": torch.randn(tokens, HV, generator=g),
        "initial_state_source": torch.randn(SLOTS, HV, V, K, generator=g) * 0.3,
        "initial_state_indices": torch.tensor([3, 1, 4][:batch], dtype=torch.int32),
        "cu_seqlens": torch.arange(0, tokens + 1, steps, dtype=torch.int32),
        "use_qk_l2norm_in_kernel": True,
    }
    if verify:
        kwargs["disable_state_update"] = True
        kwargs["intermediate_states_buffer"] = torch.zeros(SLOTS, steps, HV, V, K)
        kwargs["intermediate_state_indices"] = torch.tensor([0, 2, 3][:batch], dtype=torch.int32)
        kwargs["cache_steps"] = steps
    if tree:
        kwargs["retrieve_parent_token"] = torch.tensor([TREE_PARENTS] * batch, dtype=torch.int32)
    return {"kernel": "recurrent", "args": (), "kwargs": kwargs}


def _split_case() -> dict:
    """Qwen3.5's contiguous projections of 3 tokens: [q | k | v | z] and [b | a]."""
    g = _gen(17)
    tokens = 3
    return {
        "kernel": "split",
        "args": (
            torch.randn(tokens, 2 * H * K + 2 * HV * V, generator=g),
            torch.randn(tokens, 2 * HV, generator=g),
            H,
            HV,
            K,
            V,
        ),
        "kwargs": {},
    }


def _gated_norm_case(dtype: torch.dtype) -> dict:
    """The GDN output norm over 7 rows of value heads (12 wide: the kernel masks its block)."""
    g = _gen(19)
    rows, width = 7, 12
    return {
        "kernel": "gated_norm",
        "args": (),
        "kwargs": {
            "x": torch.randn(rows, width, generator=g).to(dtype),
            "weight": torch.randn(width, generator=g).to(dtype),
            "bias": None,
            "z": (torch.randn(rows, width, generator=g) * 3).to(dtype),
            "eps": 1e-6,
            "group_size": None,
            "norm_before_gate": True,
            "is_rms_norm": True,
        },
    }


def _fused_norm_gate_case() -> dict:
    """Qwen3-Next's GDN output norm, fla's FusedRMSNormGated (silu gate after an RMS norm), which
    the CPU-test plugin sends to the same stand-in op: 7 rows of 12 (the kernel masks its block)."""
    g = _gen(29)
    rows, width = 7, 12
    x, gate = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g) * 3
    return {
        "kernel": "fused_norm_gate",
        "args": (x, gate, torch.randn(width, generator=g), 1e-6),
        "kwargs": {},
    }


def _shared_gate_case(do_add: bool) -> dict:
    """Qwen3-Next's MoE shared-expert gate over 5 tokens of width 12: sigmoid(h . w) * shared
    (+ the routed experts' output already in ``output``), written into ``output``."""
    g = _gen(31 + do_add)
    tokens, width = 5, 12
    args = tuple(torch.randn(*shape, generator=g) for shape in ((tokens, width), (width,), (tokens, width)))
    return {
        "kernel": "shared_gate",
        "args": (*args, torch.randn(tokens, width, generator=g)),
        "kwargs": {"do_add": do_add},
    }


def _scatter_case(with_src_rows: bool) -> dict:
    """The post-verify commit over 2 layers: ssm states (HV, V, K) and two conv types whose per-step
    windows overlap in one shared buffer (SGLang's deduplicated layout); 3 requests, one rejected
    outright (step -1), and a track set with one crossing."""
    g = _gen(23 + with_src_rows)
    layers, rows, steps = 2, 4, 4
    windows, conv = [], []
    for dim in (DIM, 3):
        shared = torch.randn(layers, rows, dim, steps + WIDTH - 2, generator=g)
        s = shared.stride()
        windows.append(shared.as_strided((layers, rows, steps, dim, WIDTH - 1), (s[0], s[1], 1, s[2], 1)))
        conv.append(torch.randn(layers, SLOTS, dim, WIDTH - 1, generator=g))
    return {
        "kernel": "scatter",
        "args": (
            torch.randn(layers, SLOTS, HV, V, K, generator=g),
            torch.randn(layers, rows, steps, HV, V, K, generator=g),
            conv,
            windows,
            torch.tensor([3, 0, 4], dtype=torch.int32),  # each request's cache slot
            torch.tensor([2, -1, 0], dtype=torch.int64),  # its last accepted step
            torch.tensor([1, 2, 1], dtype=torch.int32),  # its track slot
            torch.tensor([-1, -1, 3], dtype=torch.int64),  # the step to track (-1: none)
            torch.tensor([3, 1, 0], dtype=torch.int32) if with_src_rows else None,
        ),
        "kwargs": {},
    }


CASES = {
    "split": _split_case(),
    "gated_norm_f32": _gated_norm_case(torch.float32),
    "gated_norm_bf16": _gated_norm_case(torch.bfloat16),
    "fused_norm_gate": _fused_norm_gate_case(),
    "shared_gate": _shared_gate_case(do_add=False),
    "shared_gate_add": _shared_gate_case(do_add=True),
    "scatter": _scatter_case(with_src_rows=False),
    "scatter_src_rows": _scatter_case(with_src_rows=True),
    "conv_fn": _conv_fn_case(),
    "conv_decode": _conv_update_case(1, tree=False),
    "conv_chain": _conv_update_case(4, tree=False),
    "conv_tree": _conv_update_case(5, tree=True),
    "gating": _gating_case(),
    "decode": _recurrent_case(3, 1, verify=False, tree=False),
    "verify_chain": _recurrent_case(2, 4, verify=True, tree=False),
    "verify_tree": _recurrent_case(2, 5, verify=True, tree=True),
}


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory) -> dict:
    """Every case run once by SGLang's Triton kernels in the interpreter (one child process)."""
    return run_interpreted(TRITON_CHILD, CASES, tmp_path_factory.mktemp("triton"), timeout=300)


def _run_standin(name: str) -> dict:
    """The case through the stand-in op, on fresh copies of the inputs (outputs land in them)."""
    case = CASES[name]
    args = tuple(_clone(a) for a in case["args"])
    kwargs = {key: _clone(value) for key, value in case["kwargs"].items()}
    op = {
        "conv_fn": ops.causal_conv1d_fn_cpu,
        "conv_update": ops.causal_conv1d_update_cpu,
        "gating": ops.fused_gdn_gating_cpu,
        "recurrent": ops.fused_sigmoid_gating_delta_rule_update_cpu,
        "split": ops.fused_qkvzba_split_reshape_cat_contiguous_cpu,
        "gated_norm": _gated_norm,
        "fused_norm_gate": lambda x, g, weight, eps: ops.fused_rmsnorm_gated_cpu(x, weight, g, eps),
        "shared_gate": ops.fused_gate_sigmoid_mul,
        "scatter": _scatter_after_verify,
    }[case["kernel"]]
    return {"args": args, "kwargs": kwargs, "out": op(*args, **kwargs)}


def _gated_norm(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm):
    """rms_norm_gated's arguments, for the case SGLang's CPU branch sends to the op
    (layernorm_gated.py:517-527): RMS, norm before a swish gate, no groups, no bias."""
    assert bias is None and group_size is None and norm_before_gate and is_rms_norm
    return ops.fused_rmsnorm_gated_cpu(x, weight, z, eps)


def _scatter_after_verify(temporal, intermediate_ssm, conv, windows, *indices):
    caches = SimpleNamespace(
        temporal=temporal, intermediate_ssm=intermediate_ssm, conv=conv, intermediate_conv_window=windows
    )
    return ops.scatter_mamba_states_after_mtp_verify(caches, *indices)


def _assert_same(ours, theirs, what: str) -> None:
    if isinstance(theirs, (tuple, list)):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_same(a, b, f"{what}[{i}]")
        return
    if isinstance(theirs, torch.Tensor):
        assert ours.shape == theirs.shape, what
        # bfloat16: float32 math on both sides may round the other way at one ulp (2**-7 relative).
        tol = 8e-3 if theirs.dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(ours.to(theirs.dtype), theirs, atol=tol, rtol=tol, msg=what)


@pytest.mark.parametrize("name", list(CASES))
def test_against_triton_interpreter(triton_run, name: str):
    """Output and every in-place buffer (conv states, windows, parents, ssm states) equal Triton's."""
    ours, theirs = _run_standin(name), triton_run[name]
    _assert_same(ours["out"], theirs["out"], f"{name}: output")
    _assert_same(ours["args"], theirs["args"], f"{name}: positional buffers")
    for key, value in theirs["kwargs"].items():
        _assert_same(ours["kwargs"][key], value, f"{name}: {key}")


def test_tree_conv_parents_and_windows_follow_paths():
    """Tree conv: written parents are the tree's, and a slot's output is a chain conv over its path."""
    run = _run_standin("conv_tree")
    kw = run["kwargs"]
    assert kw["retrieve_parent_token"].tolist() == [TREE_PARENTS] * 2
    x, state, weight, bias = (CASES["conv_tree"]["args"][i] for i in range(4))
    for i, slot in enumerate(kw["conv_state_indices"].tolist()):
        for node in range(x.shape[-1]):
            path = [node]
            while path[-1] != 0:
                path.append(TREE_PARENTS[path[-1]])
            chain = x[i : i + 1, :, path[::-1]]
            expected = hf.causal_conv1d_update(chain, state[slot : slot + 1].clone(), weight, bias, "silu")
            torch.testing.assert_close(run["out"][i, :, node], expected[0, :, -1], atol=1e-5, rtol=1e-5)


def _hf_recurrent(kwargs: dict, tokens: slice, state: torch.Tensor):
    """Transformers' recurrent rule on one sequence; q/k heads repeated as its Qwen3-Next layer does."""
    g, beta = ops._gates(kwargs["A_log"], kwargs["a"][tokens], kwargs["b"][tokens], kwargs["dt_bias"])
    q, k = (kwargs[n][:, tokens].repeat_interleave(HV // H, dim=2) for n in ("q", "k"))
    out, final = hf.torch_recurrent_gated_delta_rule(
        q,
        k,
        kwargs["v"][:, tokens],
        g[None],
        beta[None],
        initial_state=state.transpose(-1, -2)[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0].transpose(-1, -2)  # back to SGLang's (HV, V, K)


def test_decode_and_tree_verify_against_transformers():
    """Decode output and written state, and each tree slot's verify output and cached state, equal
    Transformers' recurrent rule run over that slot's root path."""
    decode = _run_standin("decode")
    kw = CASES["decode"]["kwargs"]
    for i, slot in enumerate(kw["initial_state_indices"].tolist()):
        out, final = _hf_recurrent(kw, slice(i, i + 1), kw["initial_state_source"][slot])
        torch.testing.assert_close(decode["out"][0, i], out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            decode["kwargs"]["initial_state_source"][slot], final, atol=1e-5, rtol=1e-5
        )

    tree = _run_standin("verify_tree")
    kw = CASES["verify_tree"]["kwargs"]
    torch.testing.assert_close(
        tree["kwargs"]["initial_state_source"], kw["initial_state_source"]
    )  # untouched
    steps = len(TREE_PARENTS)
    for i, (slot, row) in enumerate(
        zip(kw["initial_state_indices"].tolist(), kw["intermediate_state_indices"].tolist())
    ):
        for node in range(steps):
            path = [node]
            while path[-1] != 0:
                path.append(TREE_PARENTS[path[-1]])
            tokens = torch.tensor([i * steps + p for p in path[::-1]])
            sub = dict(
                kw,
                q=kw["q"][:, tokens],
                k=kw["k"][:, tokens],
                v=kw["v"][:, tokens],
                a=kw["a"][tokens],
                b=kw["b"][tokens],
            )
            out, final = _hf_recurrent(sub, slice(None), kw["initial_state_source"][slot])
            torch.testing.assert_close(tree["out"][0, i * steps + node], out[-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                tree["kwargs"]["intermediate_states_buffer"][row, node], final, atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_against_transformers(dtype):
    """chunk_gated_delta_rule_cpu over three varlen sequences (one longer than a 4-token chunk)
    equals Transformers' chunked rule per sequence, outputs and the states written back."""
    g = _gen(5)
    lens, slots = [9, 1, 6], [2, 0, 4]
    tokens = sum(lens)
    q, k = (torch.randn(1, tokens, H, K, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, tokens, HV, V, generator=g).to(dtype)
    gate, beta = ops.fused_gdn_gating_cpu(
        torch.randn(HV, generator=g),
        torch.randn(tokens, HV, generator=g),
        torch.randn(tokens, HV, generator=g),
        torch.randn(HV, generator=g),
    )
    pool = torch.randn(SLOTS, HV, V, K, generator=g) * 0.3
    before = pool.clone()
    cu = torch.tensor([0, 9, 10, 16], dtype=torch.int32)
    out, finals, _ = ops.chunk_gated_delta_rule_cpu(
        q=q,
        k=k,
        v=v,
        g=gate,
        beta=beta,
        initial_state=pool,
        cu_seqlens=cu,
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=torch.tensor(slots, dtype=torch.int32),
    )
    assert out.shape == v.shape and out.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for i, slot in enumerate(slots):
        span = slice(int(cu[i]), int(cu[i + 1]))
        expected, final = hf.torch_chunk_gated_delta_rule(
            q[:, span].repeat_interleave(HV // H, dim=2),
            k[:, span].repeat_interleave(HV // H, dim=2),
            v[:, span],
            gate[:, span],
            beta[:, span].float(),
            chunk_size=4,
            initial_state=before[slot].transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, span].float(), expected.float(), **tol)
        torch.testing.assert_close(pool[slot], final[0].transpose(-1, -2), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(finals[i], final[0].transpose(-1, -2), atol=1e-4, rtol=1e-4)
    untouched = [s for s in range(SLOTS) if s not in slots]
    torch.testing.assert_close(pool[untouched], before[untouched])


def test_exported_where_sglang_looks():
    """The names SGLang binds on CPU (gdn_backend.py:184-188, gdn_triton.py:28-33,
    qwen3_5.py:296-297, layernorm_gated.py:525) resolve to the stand-in's ops, not to missing-op
    placeholders."""
    import sgl_kernel
    from sgl_kernel import _linear_attention
    from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu

    assert sgl_kernel.__version__.endswith("frspec-cpu-standin")
    assert causal_conv1d_fn_cpu is _linear_attention.causal_conv1d_fn_cpu
    assert causal_conv1d_update_cpu is _linear_attention.causal_conv1d_update_cpu
    assert chunk_gated_delta_rule_cpu is _linear_attention.chunk_gated_delta_rule_cpu
    for name in (
        "fused_gdn_gating_cpu",
        "fused_sigmoid_gating_delta_rule_update_cpu",
        "fused_qkvzba_split_reshape_cat_contiguous_cpu",
        "fused_rmsnorm_gated_cpu",
    ):
        assert getattr(torch.ops.sgl_kernel, name) is getattr(_linear_attention, name)


@pytest.mark.parametrize("name", ["scatter", "scatter_src_rows"])
def test_scatter_commits_the_accepted_steps(name):
    """Spelled out: each accepted request's cache slot gets its scratch row's state at its last
    accepted step (every layer, ssm and both conv types), the tracked one its track step too, and
    the rejected request's slot and the unused slot keep theirs."""
    run = _run_standin(name)
    temporal, inter, conv, windows, slots, last, track_slots, track_steps, src_rows = CASES[name]["args"]
    rows = [0, 1, 2] if src_rows is None else src_rows.tolist()
    pairs = [(temporal, inter, run["args"][0])]
    pairs += [(c, w, out) for c, w, out in zip(conv, windows, run["args"][2], strict=True)]
    for before, source, after in pairs:
        expected = before.clone()
        expected[:, 3] = source[:, rows[0], 2]  # request 0: slot 3, step 2
        expected[:, 4] = source[:, rows[2], 0]  # request 2: slot 4, step 0
        expected[:, 1] = source[:, rows[2], 3]  # request 2 tracked: slot 1, step 3
        torch.testing.assert_close(after, expected, atol=0, rtol=0)
        assert not torch.equal(after, before)


PLUGIN_CHILD = """
import frspec_cpu_amx, torch
from sglang.srt.plugins.hook_registry import HookRegistry

frspec_cpu_amx.register()
HookRegistry.apply_hooks()  # as SGLang's load_plugins does after the plugins ran
from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated
from sglang.kernels.ops.elementwise.elementwise import fused_gate_sigmoid_mul_add
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

g = torch.Generator().manual_seed(0)
# As Qwen3-Next's GDN layer builds it (models/qwen3_next.py:244-254).
device = torch.get_device_module().current_device()
norm = FusedRMSNormGated(12, eps=1e-6, activation="silu", device=device, dtype=torch.float32)
hf = Qwen3NextRMSNormGated(12, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(torch.randn(12, generator=g))
    hf.weight.copy_(norm.weight)
x, z = torch.randn(7, 12, generator=g), torch.randn(7, 12, generator=g) * 3
torch.testing.assert_close(norm(x.clone(), z), hf(x, z), atol=1e-5, rtol=1e-5)
h, w, s, out = (torch.randn(*shape, generator=g) for shape in ((5, 12), (12,), (5, 12), (5, 12)))
expected = torch.sigmoid(h @ w)[:, None] * s + out
fused_gate_sigmoid_mul_add(h, w, s, out)  # as Qwen2MoeSparseMoeBlock calls it (qwen2_moe.py:877)
torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
print("device", device)
"""


def test_cpu_plugin_runs_qwen3_next_paths_on_cpu(tmp_path):
    """With the CPU-test plugin registered (in a child: its hooks are process-wide), Qwen3-Next's
    paths that launch Triton on a CPU without AMX run on CPU: fla's FusedRMSNormGated, built as
    Qwen3-Next builds it, equals Transformers' Qwen3NextRMSNormGated, and SGLang's shared-expert
    gate equals sigmoid(h . w) * shared + out."""
    status, output = run_python(PLUGIN_CHILD, [], cpu_env(1), tmp_path / "child.log", timeout=300)
    assert status == 0, output[-3000:]
    assert "device cpu" in output
