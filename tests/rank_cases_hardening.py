"""Rank functions (see run_tp_group) for the GPU-path hardening tests: start-up memory of the hot
head, logits against SGLang's own LogitsProcessor, weight-update refreshes, the head guard."""

from __future__ import annotations

import torch

from tests.rank_cases import _draft_head, _target_head


def _config(vocab: int, hidden: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16, **extra)


def head_build_memory(payload: dict) -> dict:
    """Peak extra host memory of building and of refreshing this rank's hot head, per layout,
    and whether the head holds exactly the reference rows ``full[hot slice]``."""
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from sglang_frspec.testing.memory import PeakTensorMemory

    vocab, hidden = payload["vocab"], payload["hidden"]
    target, full = _target_head(vocab, hidden, torch.float32, seed=0)
    shard = describe_head_shard(target)
    hot = torch.tensor(sorted(set(payload["map"])))  # independent of canonical_hot_ids
    out = {"rank": shard.rank}
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot, shard.shard_ranges, layout)

        def build(head=None, plan=plan):
            return build_local_head(
                target.weight,
                plan,
                shard.rank,
                shard.all_gather,
                out=head,
                chunk_bytes=payload["chunk_bytes"],
            )

        with PeakTensorMemory():  # warm-up: first-call allocations of torch, gloo and the mode
            build()
        with PeakTensorMemory() as building:
            head = build()
        with PeakTensorMemory() as refreshing:
            build(head)
        first, count = plan.offsets[shard.rank], plan.counts[shard.rank]
        expected = torch.zeros_like(head)
        expected[:count] = full[hot[first : first + count]]
        out[layout] = {
            "build": building.peak,
            "refresh": refreshing.peak,
            "head_bytes": head.numel() * head.element_size(),
            "exact": torch.equal(head, expected),
            "owned": plan.owned_counts[shard.rank],
        }
    return out


def logits_vs_stock(payload: dict) -> dict:
    """The plugin's draft logits and SGLang's own LogitsProcessor over the full target head (the
    hot columns of it), on the same inputs, for each config variant (fp32 head, fp32 output,
    logit_scale, softcapping)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, plan_from_ranges

    vocab, hidden, dtype = payload["vocab"], payload["hidden"], getattr(torch, payload["dtype"])
    target, _ = _target_head(vocab, hidden, dtype, seed=0)
    shard = describe_head_shard(target)
    hot_list = sorted(set(payload["map"]))
    hot = torch.tensor(hot_list)
    gen = torch.Generator().manual_seed(1)
    hidden_states = (torch.randn(payload["rows"], hidden, generator=gen) * payload["scale"]).to(dtype)
    out = {}
    for name, variant in payload["variants"].items():
        config = _config(vocab, hidden, **variant.get("config", {}))
        logit_scale = variant.get("logit_scale")
        stock = LogitsProcessor(config, logit_scale=logit_scale)
        stock_logits = stock._get_logits(hidden_states, target, None, use_logits_buffer=False)
        out[name] = {"stock": stock_logits[:, hot_list]}
        for layout in ("local", "balanced"):
            plan = plan_from_ranges(hot, shard.shard_ranges, layout)
            draft = _draft_head(
                vocab, hidden, dtype, build_local_head(target.weight, plan, shard.rank, shard.all_gather)
            )
            for exchange in ("full", "topk"):
                processor = FrSpecLogitsProcessor(
                    config, plan, shard, exchange, payload["topk"], "cpu", logit_scale=logit_scale
                )
                assert processor.exchange == exchange
                out[name][layout, exchange] = processor._get_logits(
                    hidden_states, draft, None, use_logits_buffer=False
                )
    return out


def head_guard(payload: dict) -> str:
    """The processor refuses a head that is not this rank's hot head (a draft that kept its own)."""
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import UnsupportedSetupError, plan_from_ranges

    vocab, hidden = payload["vocab"], payload["hidden"]
    target, _ = _target_head(vocab, hidden, torch.float32, seed=0)
    shard = describe_head_shard(target)
    plan = plan_from_ranges(torch.tensor(sorted(set(payload["map"]))), shard.shard_ranges, "balanced")
    processor = FrSpecLogitsProcessor(_config(vocab, hidden), plan, shard, "full", 2, "cpu")
    own_head = _draft_head(vocab, hidden, torch.float32, target.weight)  # the draft's full shard
    try:
        processor._get_logits(torch.randn(3, hidden), own_head, None, use_logits_buffer=False)
    except UnsupportedSetupError as e:
        return str(e)
    return "accepted"


class _Runner:
    """A model runner's weight updater: each update writes new rows into the target head."""

    def __init__(self, weight: torch.Tensor, full_by_version: dict):
        self.weight, self.full_by_version = weight, full_by_version
        self.weight_updater = self

    def _load(self, version: int, rows: slice = slice(None)):
        """Write rows of this rank's shard of checkpoint ``version`` (padding rows stay zero)."""
        new = torch.zeros_like(self.weight)
        real = self.full_by_version[version][self.weight_start : self.weight_start + self.weight.shape[0]]
        new[: real.shape[0]] = real
        self.weight[rows] = new[rows]

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        self._load(int(model_path))
        return True, "loaded"

    def update_weights_from_ipc(self, recv_req):
        self._load(int(recv_req.zmq_handles["version"]))
        return True, "loaded"

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        version, rows = named_tensors
        self._load(version, rows)
        return True, "loaded"

    def receive_weights_from_distributed(self, **kwargs):
        return kwargs["names"]

    def load_weights_from_distributed(self, weights):
        version, rows = weights
        self._load(version, rows)
        return True, "loaded"

    def begin_weight_update(self):
        pass

    def end_weight_update(self, run_post_load):
        pass


class _Worker:
    def __init__(self, runners):
        self.runners = runners
        self.model_runner = runners[0][1] if runners else None

    def weight_update_runners(self):
        return self.runners

    def deserialize_own_rank(self, serialized):
        return serialized


def weight_update_refresh(payload: dict) -> dict:
    """SGLang's real SchedulerWeightUpdaterManager with the plugin's hooks applied; the model
    runners are stand-ins that write new target rows. For each case, how often the hot head was
    refreshed and whether it equals the hot rows of the final target weights."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightFromDiskReqInput,
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromIPCReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    from sglang_frspec import plugin
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.state import FrSpecState
    from sglang_frspec.adapters.worker import FrSpecDraftHead
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from sglang_frspec.core.options import FrSpecOptions

    plugin.register()
    HookRegistry.apply_hooks()
    vocab, hidden = payload["vocab"], payload["hidden"]
    target, full = _target_head(vocab, hidden, torch.float32, seed=0)
    shard = describe_head_shard(target)
    rank = get_parallel().tp_rank
    versions = {
        v: torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(10 + v)) for v in range(1, 9)
    }
    runner = _Runner(target.weight, versions)
    runner.weight_start = shard.shard_ranges[shard.rank][0]
    hot = torch.tensor(sorted(set(payload["map"])))
    plan = plan_from_ranges(hot, shard.shard_ranges, "balanced")
    state = FrSpecDraftHead(
        plan, shard, FrSpecOptions(), build_local_head(target.weight, plan, shard.rank, shard.all_gather)
    )
    refreshes = []
    refresh = state.refresh
    state.refresh = lambda: (refreshes.append(1), refresh())[1]  # count, then the real refresh
    flush_ok = {"value": True}
    manager = SchedulerWeightUpdaterManager(
        tp_worker=_Worker([("target", runner)]),
        draft_worker=SimpleNamespace(
            _draft_worker=SimpleNamespace(frspec=FrSpecState("map.pt", None, None, head=state)),
            weight_update_runners=lambda: [],
        ),
        memory_saver_adapter=None,
        flush_cache=lambda empty_cache=False: flush_ok["value"],
        is_fully_idle=lambda **kwargs: True,
        scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: None),
    )

    def expected_head(version: int) -> torch.Tensor:
        head = torch.zeros_like(state.local_head)
        first, count = plan.offsets[shard.rank], plan.counts[shard.rank]
        head[:count] = versions[version][hot[first : first + count]]
        return head

    out = {}

    def record(case: str, version: int, result=None):
        """Refreshes since the last record, and whether the head holds the rows of ``version``."""
        out[case] = {
            "refreshes": len(refreshes),
            "fresh": torch.equal(state.local_head, expected_head(version)),
            "success": getattr(result, "success", None),
        }
        refreshes.clear()

    # Disk update whose cache flush is refused (on rank 0 only: the ranks' results differ).
    flush_ok["value"] = rank != 0
    result = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="1", flush_cache=True))
    record("disk_flush_refused_on_rank0", 1, result)
    flush_ok["value"] = True
    # P2P/RDMA: weights written directly between begin and end.
    manager.begin_weight_update(BeginWeightUpdateReqInput())
    runner._load(2)
    record("p2p_before_end", 1)  # still the previous weights
    result = manager.end_weight_update(EndWeightUpdateReqInput())
    record("p2p_end", 2, result)
    # Chunked tensor update: three chunks of rows, one session.
    manager.begin_weight_update(BeginWeightUpdateReqInput())
    thirds = [slice(i * target.weight.shape[0] // 3, (i + 1) * target.weight.shape[0] // 3) for i in range(3)]
    thirds[-1] = slice(thirds[-1].start, None)
    for rows in thirds:
        manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=(3, rows), flush_cache=False)
        )
    record("tensor_chunks_before_end", 2)  # still the previous weights
    result = manager.end_weight_update(EndWeightUpdateReqInput())
    record("tensor_chunks_end", 3, result)
    # Distributed update in two chunks.
    manager.begin_weight_update(BeginWeightUpdateReqInput())
    half = target.weight.shape[0] // 2
    for rows in (slice(None, half), slice(half, None)):
        manager.update_weights_from_distributed(
            UpdateWeightsFromDistributedReqInput(
                names=(4, rows), dtypes=[], shapes=[], group_name="g", flush_cache=False
            )
        )
    record("distributed_chunks_before_end", 3)
    result = manager.end_weight_update(EndWeightUpdateReqInput())
    record("distributed_chunks_end", 4, result)
    # IPC (checkpoint engine): one call is one update.
    result = manager.update_weights_from_ipc(UpdateWeightsFromIPCReqInput(zmq_handles={"version": "5"}))
    record("ipc", 5, result)
    # An end without a session: refused on every rank, nothing to refresh.
    result = manager.end_weight_update(EndWeightUpdateReqInput())
    record("end_without_session", 5, result)
    return out
