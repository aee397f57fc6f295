"""Seam 6: prefill/decode disaggregation, with the hot indices on the wire in stock's order.

A PD prefill node ships each request's first draft top-k as hot *indices*
(``req.output_topk_index``, copied into the metadata buffer by ``MetadataBuffers.set_buf``); the
decode node stacks them in ``build_eagle_disagg_draft_input`` and its first draft step maps them
through its own ``hot_token_id``. Stock SGLang's hot order is the map file's (duplicates kept, so
an index can be >= the plugin's H), the plugin's the sorted unique ids. So that either node may
run stock SGLang, the wire carries stock's order: a plugin prefill node translates just before
the metadata buffer is filled, a plugin decode node just after the draft input is built (and,
under the overlap scheduler, before SGLang stashes it for the next forward). Both
nodes must load the same map file (SGLang requires it of stock nodes too): a plugin prefill node
writes its map's tag (``HotWireOrder.tag``) into the row's spare last slot, and a plugin decode
node refuses rows tagged with another map's tag (stock nodes write and read no tag). A position
outside the decode node's map (an untagged sender with a longer map), or one repeating an id its
row already holds, drafts the first id of the map file that the row does not hold instead
(``HotWireOrder.from_wire``: a row's drafts are siblings, and the target-only tree verify would
commit a token drafted twice with twice its probability); outside positions are warned about once.

Under rejection sampling the decode node's first verify reads a proposal distribution q that stock
builds one-hot at the received index over the *target* vocab (``pd_first_draft_proposal``, where a
release has it: the prefill node ships the drafts, not q; older releases build no q there). With a
map that index is a hot index, and the draft's later steps give q over the H hot columns: the
plugin builds it one-hot over the hot columns at the canonical index instead, so the draft's
``[bs, steps, H]`` stack is laid over the vocab with the rest (``worker.after_draft``) and q is one
at the drafted token.

Each scheduler process serves one draft worker, which installs its wire order here when it
starts on a PD node; processes without one (no map, not PD) translate nothing.
"""

from __future__ import annotations

import copy
import logging

import torch
from sglang.srt.runtime_context import get_disagg

from sglang_frspec.core import HotIds, HotWireOrder
from sglang_frspec.core.hot_probs import one_hot_probs

logger = logging.getLogger(__name__)

PD_MODES = ("prefill", "decode")

_wire_order: HotWireOrder | None = None
_warned_outside = False  # the out-of-range warning is logged once per process


def wire_order_of(file_ids: torch.Tensor, hot: HotIds) -> HotWireOrder | None:
    """On a PD node, the translation between the map file's order (``file_ids``, as read) and the
    canonical ``hot`` order; elsewhere None (nothing goes on a wire)."""
    return HotWireOrder.of(file_ids, hot) if get_disagg().disaggregation_mode in PD_MODES else None


def install_wire_order(wire: HotWireOrder | None, device: torch.device | str) -> None:
    """Called by the draft worker at start-up, once its TP ranks agreed on ``wire``."""
    global _wire_order
    _wire_order = None if wire is None else wire.to(device)


def to_wire_before_set_buf(buffers, req, *args, **kwargs) -> None:
    """BEFORE hook on ``MetadataBuffers.set_buf``: a prefill request's hot indices in file order
    (``output_topk_index`` is read nowhere else on a prefill node), and the map's tag in the
    row's last slot when the top-k leaves it spare (set_buf fills the first ones)."""
    if _wire_order is None or getattr(req, "output_topk_index", None) is None:
        return
    req.output_topk_index = _wire_order.to_wire(req.output_topk_index)
    row = buffers.output_topk_index[req.metadata_buffer_index]
    if req.output_topk_index.numel() < row.numel():
        row[-1] = _wire_order.tag


def from_wire_around_draft_input(original, batch, last_tokens_tensor, future_map):
    """AROUND hook on ``build_eagle_disagg_draft_input``: the received file positions as canonical
    hot indices, before the first draft step maps them through ``hot_token_id``.

    Under the overlap scheduler (the GPU's default) SGLang stashes the draft input in the future
    map *inside* the builder, and the next forward reads the stash, not the returned input; the
    first stash also sizes the relay's q buffer. So the builder gets a future map whose ``stash``
    waits (``_StashAfterTranslation``) and the held payload is stashed once translated."""
    if _wire_order is None:
        return original(batch, last_tokens_tensor, future_map)
    held = None if future_map is None else _StashAfterTranslation(future_map)
    spec_info = original(batch, last_tokens_tensor, held)
    if spec_info is not None:
        _translate(spec_info, batch)
    if held is not None:
        held.release(spec_info)
    return spec_info


class _StashAfterTranslation:
    """A future map that passes every call through but holds ``stash`` until ``release``."""

    def __init__(self, future_map):
        self._future_map = future_map
        self._held: list = []  # (future indices, RelayPayload) in stash order

    def __getattr__(self, name: str):
        return getattr(self._future_map, name)

    def stash(self, future_indices: torch.Tensor, payload) -> None:
        self._held.append((future_indices, payload))

    def release(self, spec_info) -> None:
        """Stash each held payload with the fields the plugin translated taken from ``spec_info``."""
        for future_indices, payload in self._held:
            translated = copy.copy(payload)
            translated.topk_index, translated.draft_probs = spec_info.topk_index, spec_info.draft_probs
            self._future_map.stash(future_indices, translated)


def _translate(spec_info, batch) -> None:
    """The first draft input's ``topk_index`` (and, under rejection sampling, its q) in place.

    The rows are checked where SGLang's decode node received them (``req.output_topk_index``:
    the whole metadata row, a host tensor), so no device value is read; a row from a node with
    another map raises, stopping this node before it drafts from it."""
    global _warned_outside
    num_states = spec_info.topk_index.shape[1]
    received = torch.stack([torch.as_tensor(req.output_topk_index) for req in batch.reqs])
    outside = _wire_order.count_outside(received, num_states)
    if outside and not _warned_outside:
        _warned_outside = True
        logger.warning(
            "[sglang-frspec] prefill/decode: received %d hot index(es) beyond this node's token "
            "map of %d entries: the prefill node loaded a longer map and sent no map tag (stock "
            "SGLang, or a top-k that fills the metadata row). Those first drafts are replaced by "
            "this map's first ids that their request does not already draft, so each request's "
            "drafts stay distinct and the target verifies them as any others: greedy outputs stay "
            "the target's greedy tokens and sampled ones keep the target's distribution, accept "
            "lengths drop. Load the same --speculative-token-map file on every node. (Logged once.)",
            outside,
            _wire_order.file_to_canonical.numel(),
        )
    # A replaced slot keeps its received score in topk_p: scores only rank the draft tree's nodes.
    spec_info.topk_index = _wire_order.from_wire(spec_info.topk_index)
    if spec_info.draft_probs is not None:  # rejection sampling: q over the hot columns, one-hot
        # at the tokens drafted (replacements included), so the first verify stays exact
        proposal = one_hot_probs(spec_info.topk_index, _wire_order.canonical_to_file.numel())
        spec_info.draft_probs = proposal if spec_info.draft_probs.dim() == 3 else proposal[:, 0]
