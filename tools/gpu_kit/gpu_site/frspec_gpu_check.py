"""GPU-server-check SGLang plugin: the EAGLE tree build and greedy verify run SGLang's own Triton kernels.

On CUDA, SGLang 0.5.23 builds the EAGLE tree and verifies greedy drafts with JIT CUDA kernels
(``sglang.kernels.ops.speculative.tree``, compiled at first use through tvm-ffi and nvcc, with
no fallback). The same SGLang ships Triton versions of both in ``spec_tree.py`` (its XPU path);
this plugin replaces the two JIT functions with them through SGLang's hook registry, which also
rebinds the names ``spec_tree`` imported, so the check needs no JIT build of its own. Selected
with ``SGLANG_PLUGINS`` by ``tools/gpu_kit/gpu_server_check.sh`` only.
"""

from __future__ import annotations

import torch

JIT_TREE = "sglang.kernels.ops.speculative.tree"
BUILD_TREE_TARGET = f"{JIT_TREE}.build_tree_kernel_efficient"
VERIFY_GREEDY_TARGET = f"{JIT_TREE}.verify_tree_greedy"


def build_tree_triton(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """``tree.build_tree_kernel_efficient`` (same parameters) run by ``sgl_build_tree_kernel_triton``."""
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode, sgl_build_tree_kernel_triton

    sgl_build_tree_kernel_triton(
        parent_list=parent_list,
        selected_index=selected_index,
        verified_seq_len=verified_seq_len,
        tree_mask=tree_mask,
        positions=positions,
        retrieve_index=retrive_index,  # the JIT op spells it `retrive_*`, the Triton one `retrieve_*`
        retrieve_next_token=retrive_next_token,
        retrieve_next_sibling=retrive_next_sibling,
        topk=topk,
        depth=depth,
        draft_token_num=draft_token_num,
        tree_mask_mode=TreeMaskMode(tree_mask_mode),
    )


def verify_tree_greedy_triton(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """``tree.verify_tree_greedy`` (same parameters) run by ``spec_tree.verify_tree_greedy_triton``."""
    from sglang.kernels.ops.speculative import spec_tree

    spec_tree.verify_tree_greedy_triton(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrieve_index=retrive_index,
        retrieve_next_token=retrive_next_token,
        retrieve_next_sibling=retrive_next_sibling,
        target_predict=target_predict,
    )


def register() -> None:
    """Replace the two JIT tree functions (SGLang applies, and logs, the hooks after all plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BUILD_TREE_TARGET, build_tree_triton, HookType.REPLACE)
    HookRegistry.register(VERIFY_GREEDY_TARGET, verify_tree_greedy_triton, HookType.REPLACE)
