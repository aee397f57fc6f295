"""The CPU stand-in's sampling-verify ops (``cpu_site/sgl_kernel/_sampling.py``) against the originals.

- ``chain_speculative_sampling_triton`` and ``row_argmax``: SGLang's own Triton kernels, run by
  Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: the variable is read when
  triton compiles the decorator, so setting it here would leak into every other test of this
  process) on the same inputs and fixed uniforms; every output must be identical.
- ``tree_speculative_sampling_target_only`` (a CUDA kernel): against an independent reference of
  its documented semantics, written over a parent list in numpy float32.

The stand-in file is loaded by path: importing the ``sgl_kernel`` stand-in package would install
its import hook into this process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_frspec.demo.cpu import CPU_SITE
from tests.harness.releases import cpu_verify_samples
from tests.harness.triton_child import run_interpreted

pytest.importorskip("triton")

SAMPLING = CPU_SITE / "sgl_kernel" / "_sampling.py"
_spec = importlib.util.spec_from_file_location("frspec_cpu_site_sampling", SAMPLING)
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

TRITON_CHILD = """
import importlib.util, inspect, os, sys, torch
root = importlib.util.find_spec("sglang").submodule_search_locations[0]  # no SGLang import: only triton
def load(name):
    path = f"{root}/kernels/ops/{name}.py"
    if not os.path.exists(path):  # a kernel this release lacks (its callers too: SGLang 0.5.20)
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod
chain, argmax = load("speculative/reject_sampling"), load("speculative/row_argmax")
renorm = load("sampling/renorm_triton")
renorm._prepare_probs = lambda probs: probs.float().contiguous()  # its CUDA-only device check
data = torch.load(sys.argv[1])
blocks = "block_verification" in inspect.signature(chain.chain_speculative_sampling_triton).parameters
for case in data["chain"]:
    if case["block"] and not blocks:  # a release without block verification (SGLang 0.5.20)
        case["args"] = None
    else:
        block = {"block_verification": case["block"]} if blocks else {}
        chain.chain_speculative_sampling_triton(*case["args"], **block)
data["argmax"] = None if argmax is None else argmax.row_argmax(data["argmax"])
probs, top_k, top_p = data["renorm"]
data["renorm"] = (renorm.top_k_renorm_probs_triton(probs, top_k),
                  renorm.top_p_renorm_probs_triton(probs, top_p))
torch.save(data, sys.argv[2])
"""


def _outputs(batch: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """predicts, accept_index, accept_token_num, filled with sentinels the kernels overwrite."""
    return (
        torch.full((batch * slots,), -7, dtype=torch.int32),
        torch.full((batch, slots), -1, dtype=torch.int32),
        torch.full((batch,), -3, dtype=torch.int32),
    )


def _chain_cases() -> list[dict]:
    """Chains where the draft is the target, is far from it, and is zero off a hot set (a map)."""
    g = torch.Generator().manual_seed(36)
    batch, slots, vocab = 24, 4, 40
    cases = []
    for kind in ("equal", "random", "hot"):
        for block in (False, True):
            target = torch.softmax(2 * torch.randn(batch, slots, vocab, generator=g), -1)
            if kind == "equal":
                draft = target[:, :-1].clone()
            else:
                draft = torch.softmax(2 * torch.randn(batch, slots - 1, vocab, generator=g), -1)
            if kind == "hot":  # q is zero outside 12 hot ids; some targets are zero off another set
                draft[..., 12:] = 0
                draft /= draft.sum(-1, keepdim=True)
                target[: batch // 2, :, 30:] = 0
                target /= target.sum(-1, keepdim=True)
            tokens = torch.multinomial(torch.cat([draft, target[:, -1:]], 1).view(-1, vocab), 1, generator=g)
            candidates = tokens.view(batch, slots)
            if kind == "hot":  # some proposals outside the hot set: q == 0 there
                candidates[::5, 2] = 35
            retrive = torch.arange(batch * slots).view(batch, slots)
            coins = torch.rand(batch, slots, generator=g)
            final = torch.rand(batch, generator=g)
            args = (
                *_outputs(batch, slots),
                candidates,
                retrive,
                retrive.clone(),
                retrive.clone(),
                coins,
                final,
                target,
                draft,
                1.0,
                1.0,
                True,
            )
            cases.append({"args": args, "block": block, "name": f"{kind}, block={block}"})
    return cases


def _argmax_rows() -> torch.Tensor:
    """Float32 rows wider than one Triton block, with ties (the lowest index must win)."""
    x = torch.rand(6, 2500, generator=torch.Generator().manual_seed(5))
    x[1, [7, 2300]] = 2.0  # a tie across blocks
    x[2, [2049, 2050]] = 3.0  # a tie inside a block
    return x


def _renorm_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Probability rows over more than one Triton block, some with ties at the k-th value or the
    top-p pivot, and per-row top-k (1, inside, at and past the vocab) and top-p (tiny to 1)."""
    g = torch.Generator().manual_seed(9)
    probs = torch.softmax(3 * torch.randn(8, 1500, generator=g), -1)
    probs[::2] = (probs[::2] * 4000).round() / 4000  # coarse values: many ties
    probs /= probs.sum(-1, keepdim=True)
    top_k = torch.tensor([1, 2, 5, 40, 1499, 1500, 3000, 7])
    top_p = torch.tensor([1e-4, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0, 0.7])
    return probs, top_k, top_p


@pytest.mark.every_release
def test_sampling_ops_match_triton_kernels(tmp_path: Path):
    """The chain verify, row_argmax and the top-k / top-p renormalisations (SGLang's ROCm kernels,
    FlashInfer's semantics) against SGLang's Triton kernels on the same inputs."""
    cases, rows, renorm = _chain_cases(), _argmax_rows(), _renorm_rows()
    inputs = {"chain": cases, "argmax": rows, "renorm": renorm}
    kernel = run_interpreted(TRITON_CHILD, inputs, tmp_path, timeout=600)
    if kernel["argmax"] is not None:  # the release has the kernel (SGLang 0.5.21 on)
        assert torch.equal(ops.row_argmax(rows), kernel["argmax"]), (ops.row_argmax(rows), kernel["argmax"])
    assert ops.row_argmax(rows)[1:3].tolist() == [7, 2049]
    probs, top_k, top_p = renorm
    for name, mine, theirs in (
        ("top_k", ops.top_k_renorm_prob(probs, top_k), kernel["renorm"][0]),
        ("top_p", ops.top_p_renorm_prob(probs, top_p), kernel["renorm"][1]),
    ):
        assert torch.equal(mine > 0, theirs > 0), name  # the same tokens kept, ties included
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0, msg=name)
    if not cpu_verify_samples():  # its verify never calls the op on a CPU (and its kernel accepts
        return  # a draft whose q is not a probability, fixed in SGLang 0.5.21)
    accepted = set()
    ran_cases = [(case, ran) for case, ran in zip(cases, kernel["chain"]) if ran["args"] is not None]
    assert sum(not case["block"] for case, _ in ran_cases) == sum(not case["block"] for case in cases)
    for case, ran in ran_cases:
        ops.chain_speculative_sampling_triton(*case["args"], block_verification=case["block"])
        for name, mine, theirs in zip(
            ("predicts", "accept_index", "accept_token_num"), case["args"], ran["args"]
        ):
            assert torch.equal(mine, theirs), (case["name"], name, mine, theirs)
        accepted |= set(case["args"][2].tolist())
    assert accepted == {0, 1, 2, 3}, accepted  # every accept length is exercised


def _tree(parents: list[int], batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """retrive_index / next_token / next_sibling of a tree given by parent list (siblings in id order)."""
    n = len(parents)
    next_token = torch.full((batch, n), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, n), -1, dtype=torch.int64)
    for child in range(n - 1, 0, -1):  # prepend, so the first child is the lowest id
        next_sibling[:, child] = next_token[:, parents[child]]
        next_token[:, parents[child]] = child
    depth = [0] * n
    for child in range(1, n):
        depth[child] = depth[parents[child]] + 1
    return torch.arange(batch * n).view(batch, n), next_token, next_sibling, max(depth) + 1


def _reference_tree(parents, tokens, target, coins, final, t_single, t_acc, num_spec):
    """Documented semantics: from the root, try each node's children in order; a child is accepted if
    its target prob is positive and (the coin is below the target mass of the children tried so far
    / t_acc, or its prob >= t_single); a rejected child's prob is recorded as draft mass. The bonus
    token is drawn by inverse CDF (first running sum > u) from relu(target - recorded mass) at the
    last accepted node, or from the target after a path of full depth."""
    target = target.numpy()
    draft = np.zeros_like(target)
    children = {i: [c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))}
    path, node, mass, coin = [0], 0, np.float32(0), np.float32(coins[0])
    t_acc = np.float32(max(t_acc, 1e-9))
    while children[node] and len(path) < num_spec:
        chosen = None
        for child in children[node]:
            p = target[node, tokens[child]]
            mass = np.float32(mass + p)
            if p > 0 and (coin < np.float32(mass / t_acc) or p >= np.float32(t_single)):
                chosen = child
                break
            draft[node, tokens[child]] = p
        if chosen is None:
            break
        path.append(chosen)
        node, mass, coin = chosen, np.float32(0), np.float32(coins[chosen])
    residual = target[node] if len(path) == num_spec else np.maximum(target[node] - draft[node], 0)
    u = np.float32(final) * residual.sum(dtype=np.float32)
    above = np.nonzero(np.cumsum(residual, dtype=np.float32) > u)[0]
    positive = np.nonzero(residual > 0)[0]
    bonus = above[0] if above.size else (positive[-1] if positive.size else len(residual) - 1)
    return path, [tokens[c] for c in path[1:]] + [int(bonus)], draft


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.3, 0.6)])
def test_tree_target_only_matches_documented_semantics(thresholds):
    g = torch.Generator().manual_seed(7)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4]
    batch, vocab = 64, 12
    n = len(parents)
    retrive, next_token, next_sibling, num_spec = _tree(parents, batch)
    target = torch.softmax(3 * torch.randn(batch, n, vocab, generator=g), -1)
    target[::3, :, 9:] = 0  # some candidates have no target mass
    target /= target.sum(-1, keepdim=True)
    candidates = torch.randint(0, vocab, (batch, n), generator=g)
    coins, final = torch.rand(batch, n, generator=g), torch.rand(batch, generator=g)
    predicts, accept_index, accept_num = _outputs(batch, n)
    accept_index = accept_index[:, :num_spec].contiguous()
    draft = torch.zeros_like(target)
    ops.tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_num,
        candidates,
        retrive,
        next_token,
        next_sibling,
        coins,
        final,
        target,
        draft,
        *thresholds,
    )
    lengths = set()
    for b in range(batch):
        path, committed, ref_draft = _reference_tree(
            parents,
            candidates[b].tolist(),
            target[b],
            coins[b].tolist(),
            float(final[b]),
            *thresholds,
            num_spec,
        )
        assert accept_num[b] == len(path) - 1, b
        assert accept_index[b].tolist() == [b * n + c for c in path] + [-1] * (num_spec - len(path)), b
        assert [int(predicts[b * n + c]) for c in path] == committed, b
        assert np.array_equal(draft[b].numpy(), ref_draft), b
        lengths.add(len(path) - 1)
    assert lengths == set(range(num_spec)), lengths  # every accept length is exercised
