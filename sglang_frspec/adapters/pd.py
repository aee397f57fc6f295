"""Seam 6: prefill/decode disaggregation, with the hot indices on the wire in stock's order.

A PD prefill node ships each request's first draft top-k as hot *indices*
(``req.output_topk_index``, copied into the metadata buffer by ``MetadataBuffers.set_buf``); the
decode node stacks them in ``build_eagle_disagg_draft_input`` and its first draft step maps them
through its own ``hot_token_id``. Stock SGLang's hot order is the map file's (duplicates kept, so
an index can be >= the plugin's H), the plugin's the sorted unique ids. So that either node may
run stock SGLang, the wire carries stock's order: a plugin prefill node translates just before
the metadata buffer is filled, a plugin decode node just after the draft input is built. Both
nodes load the same map file (SGLang requires it of stock nodes too).

Each scheduler process serves one draft worker, which installs its wire order here when it
starts on a PD node; processes without one (no map, not PD) translate nothing.
"""

from __future__ import annotations

import torch
from sglang.srt.runtime_context import get_disagg

from sglang_frspec.core import HotIds, HotWireOrder

PD_MODES = ("prefill", "decode")

_wire_order: HotWireOrder | None = None


def install_wire_order(file_ids: torch.Tensor, hot: HotIds, device: torch.device | str) -> None:
    """Called by the draft worker at start-up: on a PD node, translate between the map file's
    order (``file_ids``, as read) and the canonical ``hot`` order; elsewhere, nothing."""
    global _wire_order
    is_pd_node = get_disagg().disaggregation_mode in PD_MODES
    _wire_order = HotWireOrder.of(file_ids, hot).to(device) if is_pd_node else None


def to_wire_before_set_buf(buffers, req, *args, **kwargs) -> None:
    """BEFORE hook on ``MetadataBuffers.set_buf``: a prefill request's hot indices in file order
    (``output_topk_index`` is read nowhere else on a prefill node)."""
    if _wire_order is not None and getattr(req, "output_topk_index", None) is not None:
        req.output_topk_index = _wire_order.to_wire(req.output_topk_index)


def from_wire_after_draft_input(spec_info, *args, **kwargs):
    """AFTER hook on ``build_eagle_disagg_draft_input``: the received file positions as canonical
    hot indices, before the first draft step maps them through ``hot_token_id``."""
    if _wire_order is not None and spec_info is not None:
        spec_info.topk_index = _wire_order.from_wire(spec_info.topk_index)
    return spec_info
