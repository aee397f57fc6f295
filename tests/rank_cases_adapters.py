"""Rank-side functions (run on every rank by run_tp_group) of the adapter tests: the hot head's
build, memory and guard, the draft logits against SGLang's own LogitsProcessor and in its
draft-extend buffer, weight-update refreshes."""

from __future__ import annotations

import dataclasses

import torch

from tests.harness.releases import refused_flush_fails_the_update
from tests.rank_cases import _draft_head, _target_head

HIDDEN_SEED = 1


def hidden_rows(rows: int, hidden: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """The draft hidden states of one step (same on every rank, as under plain TP)."""
    gen = torch.Generator().manual_seed(HIDDEN_SEED * 1000 + step)
    return torch.randn(rows, hidden, generator=gen).to(dtype)


def draft_extend_buffer_logits(payload: dict) -> dict:
    """Draft-extend graph steps that hand the processor SGLang's shared logits buffer.

    The buffer is built as EagleDraftExtendCudaGraphRunner builds it when the draft config has
    no draft_vocab_size/hot_vocab_size: ``GraphSharedOutput.get_logits_buffer(len(hot_token_id),
    rows=max_bs)``, then ``buffer[:bs]`` per batch in the ForwardBatch/LogitsMetadata. Returns,
    per (layout, exchange, bs, path), the returned logits, whether they are the buffer's storage,
    and the buffer contents after the call.
    """
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
    from transformers import LlamaConfig

    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import build_local_head, canonical_hot_ids, plan_from_ranges

    vocab, hidden, max_bs = payload["vocab"], payload["hidden"], payload["max_bs"]
    dtype = getattr(torch, payload["dtype"])
    target, _ = _target_head(vocab, hidden, dtype, seed=0)
    shard = describe_head_shard(target)
    hot_token_id = canonical_hot_ids(torch.tensor(payload["map"]), vocab).ids
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
    shared = GraphSharedOutput(device=torch.device("cpu"), max_rows=max_bs)
    buffer = shared.get_logits_buffer(len(hot_token_id), rows=max_bs)
    out = {"rank": shard.rank, "buffer_shape": tuple(buffer.shape)}
    step = 0
    for layout in ("local", "balanced"):
        plan = plan_from_ranges(hot_token_id, shard.shard_ranges, layout)
        local_head = build_local_head(target.weight, plan, shard.rank, shard.all_gather)
        draft = _draft_head(vocab, hidden, dtype, local_head)
        for exchange in ("full", "topk"):
            processor = FrSpecLogitsProcessor(config, plan, shard, exchange, payload["topk"], "cpu")
            for bs in payload["batch_sizes"]:
                step += 1
                buffer.fill_(float("nan"))  # stale contents must not survive a step
                batch_buffer = buffer[:bs]
                # _get_logits as the draft-extend graph calls it (use_logits_buffer defaults to True).
                h = hidden_rows(bs, hidden, dtype, step)
                metadata = LogitsMetadata(
                    forward_mode=ForwardMode.DRAFT_EXTEND_V2, next_token_logits_buffer=batch_buffer
                )
                logits = processor._get_logits(h, draft, metadata, use_logits_buffer=True)
                out[(layout, exchange, bs, "get_logits")] = {
                    "step": step,
                    "logits": logits.clone(),
                    "in_buffer": logits.data_ptr() == batch_buffer.data_ptr(),
                    "buffer": batch_buffer.clone(),
                }
                # The whole forward, as the graph path runs it: the tree's rows go in and
                # draft_extend_select_index picks one row per request before the head.
                step += 1
                buffer.fill_(float("nan"))
                tree = hidden_rows(bs * payload["tree_width"], hidden, dtype, step)
                select = torch.arange(bs) * payload["tree_width"] + (torch.arange(bs) % payload["tree_width"])
                metadata = LogitsMetadata(
                    forward_mode=ForwardMode.DRAFT_EXTEND_V2,
                    next_token_logits_buffer=batch_buffer,
                    draft_extend_select_index=select,
                )
                result = processor(torch.zeros(tree.shape[0], dtype=torch.int64), tree, draft, metadata)
                logits = result.next_token_logits
                out[(layout, exchange, bs, "forward")] = {
                    "step": step,
                    "select": select,
                    "logits": logits.clone(),
                    "in_buffer": logits.data_ptr() == batch_buffer.data_ptr(),
                    "buffer": batch_buffer.clone(),
                }
    return out


def head_shard_cases(payload: dict) -> dict:
    """describe_head_shard / check_head_supported on real ParallelLMHeads of this rank.

    Run with DP attention and --enable-dp-lm-head so both the tp and attn_tp groups exist.
    Returns, per case, ("ok", group, rank, ranges, has_all_gather) or ("error", message).
    """
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    from sglang_frspec.adapters.head import check_head_supported, describe_head_shard
    from sglang_frspec.core import UnsupportedSetupError

    vocab, hidden, parallel = payload["vocab"], payload["hidden"], get_parallel()

    def outcome(head) -> tuple:
        try:
            shard = describe_head_shard(head)
            check_head_supported(head)
        except UnsupportedSetupError as e:
            return ("error", str(e))
        return ("ok", shard.group_name, shard.rank, shard.shard_ranges, shard.all_gather is not None)

    out = {"tp_rank": parallel.tp_rank, "attn_tp_rank": parallel.attn_tp_rank}
    out["tp"] = outcome(ParallelLMHead(vocab, hidden))
    out["attn_tp"] = outcome(ParallelLMHead(vocab, hidden, use_attn_tp_group=True))
    out["replicated"] = outcome(ParallelLMHead(vocab, hidden, enable_tp=False))

    def built_as(tp_rank: int, **kwargs):
        """A head built while the parallel context named another (consistent) rank, as a draft
        built under a patched group would be: its rows are not those its group position implies."""
        attn_tp_size = parallel.attn_tp_size
        with parallel.override(tp_rank=tp_rank, attn_tp_rank=tp_rank % attn_tp_size,
                               attn_dp_rank=tp_rank // attn_tp_size):  # fmt: skip
            return ParallelLMHead(vocab, hidden, **kwargs)

    next_tp_rank = (parallel.tp_rank + 1) % parallel.tp_size
    out["tp_other_rank"] = outcome(built_as(next_tp_rank))
    # The next rank of the same attention-TP group (same attention-DP rank).
    next_attn_rank = (parallel.attn_tp_rank + 1) % parallel.attn_tp_size
    other_attn = built_as(
        parallel.attn_dp_rank * parallel.attn_tp_size + next_attn_rank, use_attn_tp_group=True
    )
    out["attn_tp_other_rank"] = outcome(other_attn)
    return out


def skewed_ids(vocab: int, num_hot: int, seed: int = 0) -> list[int]:
    """BPE-like skew: frequent tokens concentrate at low ids (most hot ids on rank 0)."""
    weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 50.0)
    return torch.multinomial(
        weights, num_hot, replacement=False, generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _config(vocab: int, hidden: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16, **extra)


def head_build_memory(payload: dict) -> dict:
    """Peak extra host memory of building and of refreshing this rank's hot head, per layout,
    and whether the head holds exactly the reference rows ``full[hot slice]``."""
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from tests.harness.memory import PeakTensorMemory

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


class _OneCallWorker:
    """A TP worker as releases without update sessions call it: each update is one call."""

    def __init__(self, runner: _Runner):
        self.model_runner = runner

    def update_weights_from_disk(self, recv_req):
        return self.model_runner.update_weights_from_disk(recv_req.model_path, recv_req.load_format)

    def update_weights_from_tensor(self, recv_req):
        return self.model_runner.update_weights_from_tensor(recv_req.serialized_named_tensors)

    def update_weights_from_distributed(self, recv_req):
        return self.model_runner.load_weights_from_distributed(recv_req.names)

    def update_weights_from_ipc(self, recv_req):
        return self.model_runner.update_weights_from_ipc(recv_req)


def weight_update_refresh(payload: dict) -> dict:
    """SGLang's real SchedulerWeightUpdaterManager with the plugin's hooks applied; the model
    runners are stand-ins that write new target rows. For each case, how often the hot head was
    refreshed and whether it equals the hot rows of the final target weights. The cases follow
    the running SGLang's form of weight updates (``adapters/hooks.py`` VARIANTS)."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import (
        UpdateWeightFromDiskReqInput,
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromIPCReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    from sglang_frspec import plugin
    from sglang_frspec.adapters.contract import running_form
    from sglang_frspec.adapters.head import describe_head_shard
    from sglang_frspec.adapters.state import FrSpecState
    from sglang_frspec.adapters.worker import FrSpecDraftHead
    from sglang_frspec.core import build_local_head, plan_from_ranges
    from sglang_frspec.core.options import FrSpecOptions

    plugin.register()
    HookRegistry.apply_hooks()
    sessions = running_form("weight_updates") == "sessions"
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
    draft_worker = SimpleNamespace(
        _draft_worker=SimpleNamespace(frspec=FrSpecState("map.pt", None, None, head=state)),
        weight_update_runners=lambda: [],
        update_weights_from_disk=lambda recv_req: (True, "draft kept"),  # one-call releases ask it too
        update_weights_from_ipc=lambda recv_req: (True, "draft kept"),
    )
    # SGLang 0.5.20-0.5.21 give the manager the TP CPU group (for its barriers); later ones derive it.
    fields = {field.name for field in dataclasses.fields(SchedulerWeightUpdaterManager) if field.init}
    group = {"tp_cpu_group": get_parallel().tp_group.cpu_group} if "tp_cpu_group" in fields else {}
    manager = SchedulerWeightUpdaterManager(
        tp_worker=_Worker([("target", runner)]) if sessions else _OneCallWorker(runner),
        draft_worker=draft_worker,
        memory_saver_adapter=None,
        flush_cache=lambda empty_cache=False: flush_ok["value"],
        is_fully_idle=lambda **kwargs: True,
        scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: None),
        **group,
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

    if not sessions:
        _one_call_updates(manager, runner, record)
        return out
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

    if refused_flush_fails_the_update():
        # Disk update whose cache flush is refused (on rank 0 only: the ranks' results differ).
        flush_ok["value"] = rank != 0
        result = manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path="1", flush_cache=True)
        )
        record("disk_flush_refused_on_rank0", 1, result)
        flush_ok["value"] = True
    else:
        result = manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path="1", flush_cache=False)
        )
        record("disk", 1, result)
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


def _one_call_updates(manager, runner: _Runner, record) -> None:
    """Each kind of update as one call, in an SGLang without update sessions (SGLang 0.5.20)."""
    from sglang.srt.managers.io_struct import (
        UpdateWeightFromDiskReqInput,
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromIPCReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    result = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="1", flush_cache=False))
    record("disk", 1, result)
    rows = slice(None)
    result = manager.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=(2, rows), flush_cache=False, disable_draft_model=True
        )
    )
    record("tensor", 2, result)
    result = manager.update_weights_from_distributed(
        UpdateWeightsFromDistributedReqInput(
            names=(3, rows), dtypes=[], shapes=[], group_name="g", flush_cache=False
        )
    )
    record("distributed", 3, result)
    result = manager.update_weights_from_ipc(UpdateWeightsFromIPCReqInput(zmq_handles={"version": "4"}))
    record("ipc", 4, result)


def _swaps_into(plan, hot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, ids): each rank's first hot position and an id outside the map, from the rank's
    own vocab range under the local layout, from the next rank's under the balanced one."""
    outside = torch.ones(plan.shard_ranges[-1][1], dtype=torch.bool)
    outside[hot] = False
    positions, ids = [], []
    for rank, (offset, count) in enumerate(zip(plan.offsets, plan.counts)):
        source = rank if plan.layout == "local" else (rank + 1) % plan.tp_size
        start, end = plan.shard_ranges[source]
        if count:
            positions.append(offset)
            ids.append(start + int(outside[start:end].nonzero()[0]))
    return torch.tensor(positions), torch.tensor(ids)


def replicated_table_head(payload: dict) -> dict:
    """Gemma 3's tied head at TP > 1, from SGLang's own ``Gemma3ForCausalLM``: its
    ``get_embed_and_head_for_draft`` hands the draft this rank's row slice of the embedding table
    that every rank holds whole, sliced over the group of the draft's embedding (a
    ``VocabParallelEmbedding``, as ``LlamaForCausalLMEagle`` builds it).

    Returns the shard the plugin finds, and per (map, layout, exchange) this rank's draft logits,
    the exchange that ran, the hot head before and after a weight refresh (with the rows it must
    hold) and the collectives that building and refreshing it ran; the single-rank references
    ``h @ table[sorted(set(ids))].T``; the shard found for a whole-table head; and the error for a
    slice no even split gives.
    """
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM
    from sglang.srt.runtime_context import get_parallel
    from transformers import Gemma3TextConfig

    from sglang_frspec.adapters.head import (
        build_hot_head,
        check_head_supported,
        find_head_shard,
        hot_row_reader,
    )
    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core import UnsupportedSetupError, canonical_hot_ids, plan_from_ranges
    from sglang_frspec.core.gather import place_hot_rows

    vocab, hidden = payload["vocab"], payload["hidden"]
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=1, head_dim=16,
                              tie_word_embeddings=True)  # fmt: skip
    model = Gemma3ForCausalLM(config)
    tables = [torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    model.model.embed_tokens.weight.data.copy_(tables[0])  # the same checkpoint on every rank
    _, head = model.get_embed_and_head_for_draft(VocabParallelEmbedding(vocab, hidden))
    shard = find_head_shard(model, head)
    check_head_supported(shard.module)
    group = get_parallel().tp_group
    collectives = []
    gather = group.all_gather_into_tensor
    group.all_gather_into_tensor = lambda *args: (collectives.append("all_gather"), gather(*args))[1]
    hidden_states = torch.randn(payload["rows"], hidden, generator=torch.Generator().manual_seed(2))

    def where(found) -> tuple:
        return found.group_name, found.tp_size, found.shard_ranges, found.replicated

    out = {"rank": shard.rank, "shard": where(shard), "module": type(shard.module).__name__}
    for name, ids in payload["maps"].items():
        columns = sorted(set(ids))
        out[name] = [hidden_states @ table[columns].T for table in tables]
        hot = canonical_hot_ids(torch.tensor(ids), vocab).ids
        for layout in ("local", "balanced"):
            model.model.embed_tokens.weight.data.copy_(tables[0])
            plan = plan_from_ranges(hot, shard.shard_ranges, layout)
            collectives.clear()
            local_head = build_hot_head(shard, plan, torch.float32)
            first, count = plan.offsets[shard.rank], plan.counts[shard.rank]
            case = {"counts": plan.counts, "build_collectives": len(collectives)}
            case["rows_exact"] = torch.equal(local_head[:count], tables[0][hot[first : first + count]])
            case["padding_zero"] = not local_head[count:].any()
            draft = _draft_head(vocab, hidden, torch.float32, local_head)
            processors = {
                e: FrSpecLogitsProcessor(config, plan, shard, e, payload["topk"], "cpu")
                for e in ("full", "topk")
            }
            for exchange, processor in processors.items():
                logits = processor._get_logits(hidden_states, draft, None, use_logits_buffer=False)
                case[exchange] = (processor.exchange, logits)
            # An adaptive swap at each rank's first position, as the adapter applies it: an id of
            # the rank's own slice (local layout) or of the next rank's (balanced: rows cross).
            positions, ids_in = _swaps_into(plan, hot)
            place_hot_rows(hot_row_reader(shard), ids_in, plan, shard.rank, shard.all_gather, local_head,
                           positions=positions)  # fmt: skip
            mine = (positions >= first) & (positions < first + count)
            case["swapped_exact"] = torch.equal(local_head[positions[mine] - first], tables[0][ids_in[mine]])
            # A weight update writes the table in place; the refresh re-reads the map's rows.
            model.model.embed_tokens.weight.data.copy_(tables[1])
            collectives.clear()
            refreshed = build_hot_head(shard, plan, torch.float32, out=local_head)
            case["refresh_collectives"] = len(collectives)
            case["refresh_in_place"] = refreshed.data_ptr() == local_head.data_ptr()
            case["refreshed"] = processors["full"]._get_logits(
                hidden_states, draft, None, use_logits_buffer=False
            )
            out[name, layout] = case
    group.all_gather_into_tensor = gather
    # A draft embedding that is not vocab-parallel: Gemma 3 hands it the whole table.
    _, whole = model.get_embed_and_head_for_draft(VocabParallelEmbedding(vocab, hidden, enable_tp=False))
    out["whole"] = where(find_head_shard(model, whole))
    # Rows no even split over the group gives this rank (shifted by one row).
    start = shard.shard_ranges[shard.rank][0]
    try:
        find_head_shard(model, model.model.embed_tokens.weight[start + 1 : start + 1 + head.shape[0] - 1])
        out["shifted"] = "accepted"
    except UnsupportedSetupError as e:
        out["shifted"] = str(e)
    return out
