"""One PD node's side of a hot-index transfer, run in a real SGLang process (see test_pd.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

HIDDEN = 8


def pd_node(payload: dict) -> list[dict]:
    """One process playing PD nodes of one kind: ``payload["steps"]`` lists
    ``("prefill", picked, file_ids)`` and ``("decode", wire, file_ids)`` steps, answered in order;
    each step is a node that loaded ``file_ids`` as its map (``wire``: rows, or the index of an
    earlier prefill answer whose rows to receive).

    Prefill: each request's first draft top-k (``picked``, hot indices in this node's own order)
    goes through SGLang's ``MetadataBuffers.set_buf``; the answer is the buffer rows (the wire)
    and the token ids picked. Decode: the wire rows are read back as ``DecodeTransferQueue`` does
    (``get_buf``), the first draft input is built by SGLang's ``build_eagle_disagg_draft_input``
    and its ``topk_index`` mapped through this node's ``hot_token_id`` as ``draft_forward`` does:
    the token ids the decode node drafts from, or the error that stopped it. Every answer holds
    the warnings the plugin logged during its step. ``("decode_rejection", wire, file_ids)``
    decodes under ``--speculative-use-rejection-sampling``: the answer also holds the first
    verify's proposal q as the plugin's draft lays it over the vocab (``lay_hot_probs_over_vocab``
    of the first draft row at ``hot_token_id``): each row's (token id, probability) pairs with q > 0.
    A decode role ending in ``_overlap`` runs under the overlap scheduler (the GPU's default): the
    builder gets SGLang's ``FutureMap`` and stashes the input there, and the answer is what the next
    forward reads back from it (``resolve_forward_inputs``), with ``q width`` under rejection sampling.

    ``plugin``: the nodes run sglang-frspec (hooks applied, wire order installed as its draft
    worker does at start-up, ``hot_token_id`` the canonical ids); otherwise they are stock
    (``hot_token_id`` the file's ids in file order, duplicates kept).
    """
    import logging

    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_frspec.core import TokenMapError, canonical_hot_ids
    from sglang_frspec.core.hot_probs import lay_hot_probs_over_vocab

    warnings: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("sglang_frspec").addHandler(Capture(logging.WARNING))
    from sglang.srt.plugins.hook_registry import HookRegistry

    from tests.harness.gpu_defaults import overlap

    overlap.register()  # the relay's gather, as overlap servers have it (no Triton on a CPU)
    if payload["plugin"]:
        from sglang_frspec.adapters import pd
        from sglang_frspec.plugin import register

        register()
    HookRegistry.apply_hooks()
    buffers = MetadataBuffers(size=4, hidden_size=HIDDEN, hidden_states_dtype=torch.float32,
                              max_sampling_mask_tokens=16)  # fmt: skip

    def request(i: int) -> Req:
        req = Req(f"r{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=4))
        req.metadata_buffer_index = i
        return req

    answers = []
    for role, rows, file_ids in payload["steps"]:
        warnings.clear()
        file_ids = torch.tensor(file_ids)
        hot_token_id = file_ids
        if payload["plugin"]:
            hot = canonical_hot_ids(file_ids, payload["vocab"])
            pd.install_wire_order(pd.wire_order_of(file_ids, hot), "cpu")
            hot_token_id = hot.ids
        rows = torch.tensor(answers[rows]["wire"] if isinstance(rows, int) else rows)
        if role == "prefill":
            for i, picked in enumerate(rows):
                req = request(i)
                req.output_ids = [7]
                req.output_topk_p = torch.full((picked.numel(),), 1.0 / picked.numel())
                req.output_topk_index = picked.clone()
                req.hidden_states_tensor = torch.zeros(HIDDEN)
                buffers.set_buf(req)
            answers.append({"wire": buffers.output_topk_index[: len(rows)].tolist(),
                            "tokens": hot_token_id[rows].tolist(), "warnings": list(warnings)})  # fmt: skip
            continue
        reqs = []
        for i, wire in enumerate(rows):
            buffers.output_topk_index[i] = wire
            *_, topk_p, topk_index, hidden_states, dsa_topk_indices, _ = buffers.get_buf(i)
            req = request(i)
            req.output_topk_p, req.output_topk_index = topk_p, topk_index
            req.hidden_states_tensor, req.output_dsa_topk_indices = hidden_states, dsa_topk_indices
            reqs.append(req)
        rejection, overlapped = role.startswith("decode_rejection"), role.endswith("_overlap")
        # The fields of a prebuilt decode batch that the draft-input builder reads.
        model_config = SimpleNamespace(hf_config=SimpleNamespace(), vocab_size=payload["vocab"])
        batch = SimpleNamespace(reqs=reqs, device="cpu", enable_overlap=overlapped, model_config=model_config,
                                req_pool_indices=torch.arange(1, len(reqs) + 1),
                                seq_lens=torch.full((len(reqs),), 4))  # fmt: skip
        future_map = None
        if overlapped:
            pool = SimpleNamespace(req_to_token=torch.zeros(8, 16, dtype=torch.int32))
            future_map = FutureMap(torch.device("cpu"), SpeculativeAlgorithm.EAGLE, pool)
        last_tokens = torch.tensor([7] * len(reqs))
        try:
            with get_spec().override(speculative_use_rejection_sampling=rejection):
                build = SpeculativeAlgorithm.EAGLE.build_disagg_draft_input
                spec_info = build(batch, last_tokens, future_map)
            answer = {}
            if overlapped:  # the next forward's draft input: what the future map relays
                spec_info = relayed_draft_input(future_map, batch.req_pool_indices, last_tokens)
                if rejection and spec_info.draft_probs is not None:
                    answer["q width"] = spec_info.draft_probs.shape[-1]
            answer["tokens"] = hot_token_id[spec_info.topk_index].tolist()
            if rejection and spec_info.draft_probs is None:  # a release whose builder makes no q
                answer["proposal"] = None
            elif rejection:  # the draft's first row of q ([bs, steps, H] there)
                q = lay_hot_probs_over_vocab(
                    spec_info.draft_probs.unsqueeze(1), hot_token_id, payload["vocab"]
                )
                answer["proposal"] = [[(t, float(row[t])) for t in row.nonzero().flatten().tolist()]
                                      for row in q[:, 0]]  # fmt: skip
        except (IndexError, ValueError, TokenMapError) as e:  # IndexError: a device assert on the GPU
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.append(answer | {"warnings": list(warnings)})
    return answers


def relayed_draft_input(future_map, req_pool_indices: torch.Tensor, input_ids: torch.Tensor):
    """The draft input the next forward of these requests reads under the overlap scheduler:
    SGLang's staged handle resolved from the future map, as ``resolve_forward_inputs`` does."""
    from sglang.srt.managers.overlap_utils import resolve_forward_inputs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    staged = getattr(future_map, "make_staged_spec_input", None)
    if staged is None:  # SGLang 0.5.20: the scheduler sets the indices on an EAGLE draft input
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        staged = lambda indices: EagleDraftInput(  # noqa: E731
            capture_hidden_mode=CaptureHiddenMode.LAST, future_indices=indices
        )
    batch = SimpleNamespace(prefill_input_ids_cpu=None, input_ids=input_ids, enable_overlap=True,
                            spec_algorithm=SpeculativeAlgorithm.EAGLE,
                            spec_info=staged(req_pool_indices))  # fmt: skip
    resolve_forward_inputs(batch, future_map)
    return batch.spec_info
