"""The overlap stand-in's relay gather (``tests/harness/gpu_defaults/overlap.py``) against SGLang's own
Triton kernel (``kernels/ops/speculative/gather_spec_extras.py``), run by Triton's interpreter in a
child process (``TRITON_INTERPRET=1`` is read when triton compiles the decorator): every output
identical, with and without hidden states, for strided and repeated indices and an empty batch."""

from __future__ import annotations

import pytest
import torch

from tests.harness.gpu_defaults.overlap import gather_spec_extras
from tests.harness.triton_child import run_interpreted

pytest.importorskip("triton")

TRITON_CHILD = """
import importlib.util, sys, torch
root = importlib.util.find_spec("sglang").submodule_search_locations[0]  # no SGLang import: only triton
spec = importlib.util.spec_from_file_location("g", f"{root}/kernels/ops/speculative/gather_spec_extras.py")
kernel = importlib.util.module_from_spec(spec); spec.loader.exec_module(kernel)
cases = torch.load(sys.argv[1])
torch.save([kernel.gather_spec_extras(*case) for case in cases], sys.argv[2])
"""


def _cases() -> list[tuple]:
    """Relay buffers of a 12-slot request pool (topk 4, hidden 40 in bfloat16) and the indices of
    a next batch: contiguous, repeated and strided (a filtered batch's), empty, and without the
    hidden-states buffer (a build that captures none)."""
    g = torch.Generator().manual_seed(52)
    pool, topk, hidden = 12, 4, 40
    topk_p = torch.rand(pool, topk, generator=g)
    topk_index = torch.randint(0, 30000, (pool, topk), generator=g)
    tokens = torch.randint(0, 30000, (pool,), generator=g)
    states = torch.randn(pool, hidden, generator=g).bfloat16()
    strided = torch.tensor([3, 0, 7, 0, 11, 0, 1, 0])[::2]
    empty = torch.tensor([], dtype=torch.int64)
    indices = [torch.tensor([5, 1, 9]), torch.tensor([2, 2, 0, 11]), strided, empty]
    cases = [(i, topk_p, topk_index, tokens, states) for i in indices]
    return [*cases, (torch.tensor([4, 8]), topk_p, topk_index, tokens, None)]


def test_relay_gather_equals_sglangs_triton_kernel(tmp_path):
    cases = _cases()
    expected = run_interpreted(TRITON_CHILD, cases, tmp_path, timeout=300)
    for case, want in zip(cases, expected, strict=True):
        got = gather_spec_extras(*case)
        for name, g, w in zip(("topk_p", "topk_index", "bonus_tokens", "hidden_states"), got, want):
            if w is None:
                assert g is None, name
                continue
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), name
