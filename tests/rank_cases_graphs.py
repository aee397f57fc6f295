"""Functions run on a real SGLang rank: SGLang's EAGLE draft-decode CUDA graph runner built, captured
and replayed on the CPU with recorded graphs (``tests/harness/gpu_defaults/recorded_graphs.py``),
with the plugin's hooks, its hot head and its logits exchange inside the graph (see
tests/test_graph_rejection_sampling.py and tests/test_recorded_eagle_graphs.py).

SGLang's own ``EAGLEDraftCudaGraphRunner`` runs: its ``__init__`` allocates the buffers,
``capture_one_shape`` captures ``EagleDraftWorker.draft_forward`` on them (through the backend:
two warm-ups, then the recorded capture) and ``execute`` pads and copies a batch into them and
replays, as SGLang's own runner test kit does (``sglang/test/kits/attention_unittest/runner_modes/
speculative_draft_runner.py``). Only what needs a GPU or a checkpoint is stood in for: the CUDA
graph itself (recorded graphs: the ops dispatched at capture, replayed on the captured memory),
the graph-capture stream, attention metadata, the draft model's layers and the model runner's
``forward`` around them. The draft's vocab-parallel embedding, LM head and logits processor are
SGLang's, replaced by the plugin's own ``init_lm_head`` hook.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest.mock import patch

import torch

from tests.harness.gpu_defaults.recorded_graphs import RecordedGraphBackend, host_memory
from tests.rank_cases import _target_head

GRAPH_CAPTURE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.graph_capture"
FREEZE_GC = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.freeze_gc"


def eagle_map_server_args(draft: str, token_map: str, steps: int) -> dict:
    """ServerArgs fields of a TP group whose ranks run the plugin's start-up (``plugin_worker``):
    EAGLE, top-k 1, ``steps`` steps, a map."""
    return {
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": draft,
        "speculative_eagle_topk": 1,
        "speculative_num_steps": steps,
        "speculative_num_draft_tokens": steps + 1,
        "speculative_token_map": token_map,
    }


def rejection_sampling_server_args(draft: str, token_map: str, steps: int, capture_sizes: list[int]) -> dict:
    """``eagle_map_server_args`` with rejection sampling, for ranks that build SGLang's draft-decode
    graph runner with these decode graph sizes."""
    return eagle_map_server_args(draft, token_map, steps) | {
        "speculative_use_rejection_sampling": True,
        "cuda_graph_bs_decode": capture_sizes,
    }


def hot_draft_head(hot: int, hidden: int) -> torch.Tensor:
    """The stand-in draft's ``[H, hidden]`` head (the test recomputes it from the same seed)."""
    return torch.randn(hot, hidden, generator=torch.Generator().manual_seed(5)) / hidden**0.5


def _recorded_backend(runner) -> RecordedGraphBackend:
    """What ``resolve_decode_backend`` returns here: recorded graphs that watch every tensor the
    graph reads reachable from the runner, the buffers it copies each batch into and, for a draft
    runner, the worker (``hot_token_id``, the models' weights), and compare each capture's
    collectives over the TP group. The runner's ``*_cpu`` buffers
    (``seq_lens_cpu``: SGLang allocates them with ``device="cpu"`` on a GPU) are host memory."""
    from sglang.srt.runtime_context import get_parallel

    owners = (runner, runner.buffers, *filter(None, [getattr(runner, "eagle_worker", None)]))
    for owner in owners:
        for name, value in vars(owner).items():
            if name.endswith("_cpu") and isinstance(value, torch.Tensor):
                host_memory(value)
    return RecordedGraphBackend(owners, group=get_parallel().tp_group.cpu_group)


@contextlib.contextmanager
def _recorded_capture(runner_class) -> Iterator[None]:
    """Build ``runner_class`` (an SGLang graph runner) on recorded graphs: its backend, no capture stream."""
    resolve = f"{runner_class.__module__}.resolve_decode_backend"
    # SGLang brackets capture with two full gc.collect() passes (freeze_gc), about 1 s each in a
    # rank holding SGLang's modules: half of this suite's capture time, and no part of a graph.
    no_gc_freeze = patch(FREEZE_GC, lambda enable_cudagraph_gc: contextlib.nullcontext())
    with patch(GRAPH_CAPTURE, _no_capture_stream), patch(resolve, _recorded_backend), no_gc_freeze:
        yield


@contextlib.contextmanager
def _no_capture_stream(stream=None):
    yield SimpleNamespace(stream=stream)


class _AttentionStandIn:
    """Attention metadata (a graph runner's attention backend), for models without attention."""

    dllm_attention = None

    def __init__(self, steps: int = 1):
        self.attn_backends = [self] * steps  # one per draft step

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_cuda_graph_state(self, *args, **kwargs) -> None:
        pass

    def init_forward_metadata_in_graph(self, *args, **kwargs) -> None:
        pass

    def init_forward_metadata_out_graph(self, *args, **kwargs) -> None:
        pass

    def shared_read_ends(self, forward_mode):
        from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds

        return SharedReadEnds.UNKNOWN  # no read-done event (CPU has none)


def _draft_worker(payload: dict, model, forward: Callable):
    """A real ``EagleDraftWorker`` (its ``draft_forward``) over a stand-in draft runner holding
    ``model`` whose ``forward(forward_batch)`` returns the logits output; ``__init__`` is skipped as
    in SGLang's kit (it loads a model)."""
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    steps = payload["steps"]
    config = SimpleNamespace(
        vocab_size=payload["vocab"],  # the draft model's vocab, as SGLang reads it for the buffer
        model_is_mrope=False,
        spec_hidden_size=payload["hidden"],
        dtype=torch.float32,
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLMEagle"]),
    )
    runner = SimpleNamespace(
        device="cpu",
        gpu_id=0,
        dtype=torch.float32,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        is_draft_worker=True,
        model_config=config,
        model=model,
        req_to_token_pool=SimpleNamespace(size=payload["max_running"]),
        server_args=get_server_args(),
        kv_index_translator=SimpleNamespace(bind_runner_slots=lambda forward_batch: None),
        device_timer=None,
        canary_manager=None,
        draft_attn_backend=_AttentionStandIn(steps),
        forward=lambda forward_batch: SimpleNamespace(logits_output=forward(forward_batch)),
        graph_shared_output=GraphSharedOutput(device=torch.device("cpu"), max_rows=payload["max_running"]),
        shared_read_done_event=None,
    )
    worker = EagleDraftWorker.__new__(EagleDraftWorker)
    worker.server_args, worker.device = get_server_args(), "cpu"
    worker.draft_runner, worker.draft_attn_backend = runner, runner.draft_attn_backend
    worker.draft_extend_attn_backend = runner.draft_attn_backend
    worker.topk, worker.speculative_num_steps, worker.speculative_num_draft_tokens = 1, steps, steps + 1
    worker.speculative_algorithm = SpeculativeAlgorithm.EAGLE
    worker.index_share_for_mtp_iteration = worker.seed_dsa_topk_from_draft_extend = False
    worker.dsa_seed_topk_width = None
    worker._rebuild_topk1_chain_buffers()
    return worker


def _hot_logits_worker(payload: dict):
    """A draft worker whose draft keeps its hidden states and returns logits over the H hot ids
    (``hot_draft_head``), with the plugin's state attached and ``hot_token_id`` set as its
    start-up hooks leave them."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    from sglang_frspec.adapters.state import FrSpecState, attach_state

    head = hot_draft_head(payload["hot"], payload["hidden"])

    def forward(forward_batch):
        states = forward_batch.spec_info.hidden_states
        return LogitsProcessorOutput(next_token_logits=states @ head.T, hidden_states=states)

    model = SimpleNamespace(shared_experts_config=SharedExpertsConfig(), forward=None)
    worker = _draft_worker(payload, model, forward)
    worker.hot_token_id = torch.tensor(payload["hot_ids"])
    attach_state(worker, FrSpecState(payload["map"], None, None))  # what init_token_map attaches
    return worker


class _TargetHeads(torch.nn.Module):
    """The target model's vocab-parallel embedding and LM head (SGLang's classes, this rank's shards)."""

    def __init__(self, vocab: int, hidden: int):
        from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

        super().__init__()
        self.lm_head, _ = _target_head(vocab, hidden, torch.float32, seed=0)
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
        full = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(2))
        self.embed_tokens.weight_loader(self.embed_tokens.weight, full)


class _OneLayerDraft(torch.nn.Module):
    """An EAGLE draft reduced to one layer, tanh(carried states @ W + embedding of the input token),
    over SGLang's vocab-parallel embedding, ``ParallelLMHead`` and ``LogitsProcessor``, which take
    the target's embedding and the plugin's hot head and processor at ``init_lm_head``."""

    def __init__(self, vocab: int, hidden: int):
        from sglang.srt.configs.shared_experts import SharedExpertsConfig
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from transformers import LlamaConfig

        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16)
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.float32)
        self.lm_head = ParallelLMHead(vocab, hidden, params_dtype=torch.float32)
        self.logits_processor = LogitsProcessor(self.config)
        self.shared_experts_config = SharedExpertsConfig()
        self.mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(3)) / hidden**0.5

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        del self.embed_tokens.weight, self.lm_head.weight
        self.embed_tokens.weight, self.lm_head.weight = embed, head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch):
        states = torch.tanh(forward_batch.spec_info.hidden_states @ self.mix + self.embed_tokens(input_ids))
        return self.logits_processor(input_ids, states, self.lm_head, forward_batch)


class _OneLayerTarget(_TargetHeads):
    """A target reduced to one layer, tanh(embedding of the token @ W + a position term), over the
    vocab-parallel embedding and LM head the plugin gathers the draft's hot head from, and
    SGLang's ``LogitsProcessor`` over the full vocab (an all-gather of equal shards)."""

    def __init__(self, vocab: int, hidden: int):
        from sglang.srt.configs.shared_experts import SharedExpertsConfig
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from transformers import LlamaConfig

        super().__init__(vocab, hidden)
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_attention_heads=hidden // 16,
                                  architectures=["LlamaForCausalLM"])  # fmt: skip
        self.logits_processor = LogitsProcessor(self.config)
        self.shared_experts_config = SharedExpertsConfig()
        self.mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(4)) / hidden**0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch):
        states = torch.tanh(self.embed_tokens(input_ids) @ self.mix + 0.01 * positions[:, None])
        return self.logits_processor(input_ids, states, self.lm_head, forward_batch)


def plugin_worker(payload: dict, target: _TargetHeads | None = None):
    """A draft worker set up by the plugin's own start-up hook (``init_lm_head``, applied by
    ``load_plugins``) with the layout and exchange of ``SGLANG_FRSPEC_*``: this rank's hot head
    (gathered from ``target``'s LM head shard), the hot-logits processor and the canonical
    ``hot_token_id``."""
    from sglang_frspec.adapters.state import FrSpecState, attach_state

    target = target or _TargetHeads(payload["vocab"], payload["hidden"])
    draft = _OneLayerDraft(payload["vocab"], payload["hidden"])
    worker = _draft_worker(payload, draft, lambda batch: draft(batch.input_ids, batch.positions, batch))
    worker.target_worker = SimpleNamespace(model_runner=SimpleNamespace(model=target),
                                           model_config=SimpleNamespace(hf_eos_token_id=None))  # fmt: skip
    # Stands in for reading the target checkpoint's shared tensors.
    worker._resolve_shared_embed_and_head = lambda: (target.embed_tokens.weight, target.lm_head.weight)
    ids = torch.tensor(payload["map_ids"])
    attach_state(worker, FrSpecState("map", ids, None))  # what init_token_map attaches
    worker.hot_token_id = ids
    worker.init_lm_head()
    return worker


def _forward_batch(spec_info, rows: int, steps: int, temperature: float):
    """A draft-decode batch of ``rows`` requests (topk 1) carrying ``spec_info``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seq_lens = torch.arange(rows, dtype=torch.int64) + 5
    sampling = SamplingBatchInfo(
        temperatures=torch.full((rows, 1), temperature),
        top_ps=torch.ones(rows),
        top_ks=torch.full((rows,), TOP_K_ALL, dtype=torch.int32),
        min_ps=torch.zeros(rows),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
        vocab_size=0,
    )
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE if rows else ForwardMode.IDLE,
        batch_size=rows,
        input_ids=None,
        req_pool_indices=torch.arange(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=torch.arange(rows * steps, dtype=torch.int64) + 100,
        seq_lens_sum=int(seq_lens.sum()),
        positions=seq_lens.clone(),
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=spec_info,
        sampling_info=sampling,
        capture_hidden_mode=CaptureHiddenMode.LAST,
    )


def _build_runner(worker, steps: int, runner_class=None):
    """SGLang's draft-decode runner (or ``runner_class``, built the same way) on recorded graphs."""
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    runner_class = runner_class or EAGLEDraftCudaGraphRunner
    with _recorded_capture(runner_class):
        return runner_class(worker, speculative_num_steps=steps)


def _error(function) -> str | None:
    try:
        function()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def graph_cases(payload: dict) -> dict:
    """Both cases on this rank, in this order: the drop-in worker's start-up (which ends by
    applying the plugin's hooks), then the draft-decode graph with the hooks applied."""
    out = {"drop-in": drop_in_worker_start_up()}
    return out | {"graph": draft_graph_with_hot_q(payload)}


def draft_graph_with_hot_q(payload: dict) -> dict:
    """With the plugin's hooks applied: SGLang's draft-decode graph runner built
    (capture), then replayed on a batch and on an idle batch. Also the control: the same capture
    with the plugin's hook on ``capture_one_shape`` bypassed."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    from sglang_frspec.adapters.worker import before_draft

    steps, rows, hidden, hot, vocab = (payload[k] for k in ("steps", "rows", "hidden", "hot", "vocab"))
    worker = _hot_logits_worker(payload)
    out = {}

    stock = EAGLEDraftCudaGraphRunner.capture_one_shape.__wrapped__  # under the plugin's AROUND hook
    with patch.object(EAGLEDraftCudaGraphRunner, "capture_one_shape", stock):
        out["stock capture"] = _error(lambda: _build_runner(worker, steps))

    runner = _build_runner(worker, steps)
    out["buffer"] = tuple(runner.buffers.draft_probs.shape)
    out["capture sizes"] = list(runner.capture_bs)

    g = torch.Generator().manual_seed(7)
    carried = torch.softmax(torch.randn(rows, hot, generator=g), -1)  # draft extend's hot q
    spec_info = EagleDraftInput(
        topk_p=carried.max(-1, keepdim=True).values,
        topk_index=carried.argmax(-1, keepdim=True),
        draft_probs=carried,
        hidden_states=torch.randn(rows, hidden, generator=g),
        capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )
    batch = _forward_batch(spec_info, rows, steps, payload["temperature"])
    _, _, tokens, q = runner.execute(batch)
    out |= {"q": q.clone(), "carried": carried, "hidden_states": spec_info.hidden_states, "tokens": tokens}

    idle = EagleDraftInput.create_idle_input(
        device="cpu",
        hidden_size=hidden,
        dtype=torch.float32,
        topk=1,
        capture_hidden_mode=CaptureHiddenMode.LAST,
        vocab_size=vocab,  # as EAGLEWorkerV2 builds it: the target's vocab
    )
    out["idle q from SGLang"] = tuple(idle.draft_probs.shape)
    out["idle replay, stock"] = _error(lambda: runner.execute(_forward_batch(idle, 0, steps, 1.0)))
    before_draft(worker, SimpleNamespace(forward_mode=ForwardMode.IDLE, spec_info=idle))
    out["idle q"] = tuple(idle.draft_probs.shape)
    idle_q = runner.execute(_forward_batch(idle, 0, steps, 1.0))[3]
    out["idle replay q"] = tuple(idle_q.shape)
    return out


def drop_in_worker_start_up() -> dict:
    """The drop-in worker's start-up (``around_alloc_memory_pool``) with rejection sampling and a
    map, before and after ``load_plugins()`` (as a scheduler runs it: this plugin's hooks, and the
    CPU-test plugin's torch ``row_argmax``), with decode CUDA graphs on and off.
    SGLang captures no draft-decode graph on a CPU engine, so "graphs on" here is a GPU host's
    configuration: ``SGLANG_USE_CPU_ENGINE=0`` (SGLang's ``is_cpu()`` then answers False) and the
    decode graph backend published as ``full``."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils.common import is_cpu

    from sglang_frspec.adapters.worker import around_alloc_memory_pool

    worker = EagleDraftWorker.__new__(EagleDraftWorker)
    worker.speculative_algorithm = SpeculativeAlgorithm.EAGLE

    def start_up(decode_backend: str) -> str:
        calls = []
        graphs = CudaGraphConfig(decode=PhaseConfig(backend=decode_backend, bs=[1], max_bs=1))
        engine, os.environ["SGLANG_USE_CPU_ENGINE"] = os.environ["SGLANG_USE_CPU_ENGINE"], "0"
        is_cpu.cache_clear()  # SGLang caches the answer; it reads the variable again
        try:
            with get_exec().graph.override(cuda_graph_config=graphs):
                around_alloc_memory_pool(lambda w, *a, **k: calls.append(w), worker)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            os.environ["SGLANG_USE_CPU_ENGINE"] = engine
            is_cpu.cache_clear()
        return "started" if calls == [worker] else f"not started: {calls}"

    out = {"graphs": start_up(Backend.FULL), "no graphs": start_up(Backend.DISABLED)}
    load_plugins()
    out["graphs, plugin loaded"] = start_up(Backend.FULL)
    return out


def _draft_input(rows: int, payload: dict, seed: int, rejection_sampling: bool):
    """The draft input a draft-extend step hands draft decode: each request's first hot token, its
    probability, the hidden states and, under rejection sampling, its hot q."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(rows, payload["hot"], generator=g) * 3, -1)
    return EagleDraftInput(
        topk_p=q.max(-1, keepdim=True).values,
        topk_index=q.argmax(-1, keepdim=True),
        draft_probs=q if rejection_sampling else None,
        hidden_states=torch.randn(rows, payload["hidden"], generator=g),
        capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )


def _replay_and_eager(runner, worker, payload: dict, rows: int, seed: int, rejection_sampling: bool,
                      greedy: bool) -> dict:  # fmt: skip
    """One batch of ``rows`` requests through the runner (padded, copied in, the graph replayed)
    and through ``draft_forward`` run eagerly on an identical batch, the RNG seeded alike."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    out = {}
    for path in ("replay", "eager"):
        batch = _forward_batch(_draft_input(rows, payload, seed, rejection_sampling), rows, payload["steps"],
                               payload["temperature"])  # fmt: skip
        batch.sampling_info.is_all_greedy = greedy
        batch.sampling_info.top_ks.fill_(1 if greedy else TOP_K_ALL)
        torch.manual_seed(seed)
        result = runner.execute(batch) if path == "replay" else worker.draft_forward(batch)
        out[path] = tuple(None if t is None else t.clone() for t in result)
    return out


def _draft_decode_graph(payload: dict, layout: str, exchange: str, rejection_sampling: bool) -> dict:
    """The plugin's draft set up with ``layout`` and ``exchange``, SGLang's draft-decode runner
    captured with recorded graphs, then batches of other values and sizes replayed and run eagerly."""
    from sglang.srt.runtime_context import get_spec

    from sglang_frspec.core.options import ADAPT_ENV, ADAPT_INTERVAL_ENV, EXCHANGE_ENV, LAYOUT_ENV

    os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV] = layout, exchange
    # Under rejection sampling the adaptive map is on too (swapped after the replays).
    os.environ |= {ADAPT_ENV: str(int(rejection_sampling)), ADAPT_INTERVAL_ENV: "1"}
    with get_spec().override(speculative_use_rejection_sampling=rejection_sampling):
        worker = plugin_worker(payload)
        processor = worker.draft_runner.model.logits_processor
        runner = _build_runner(worker, payload["steps"])
        graphs = runner.backend.graphs
        out = {"exchange": processor.exchange, "keys": sorted((k.size, str(k.variant_label)) for k in graphs),
               "collectives": {str(k): g.collectives for k, g in graphs.items()}}  # fmt: skip
        for rows, seed, greedy in payload["replays"]:
            out[(rows, seed, greedy)] = _replay_and_eager(runner, worker, payload, rows, seed,
                                                          rejection_sampling, greedy)  # fmt: skip
        if rejection_sampling:
            out["swap and refresh"] = _swap_and_refresh_after_capture(runner, worker, payload)
    del os.environ[ADAPT_ENV], os.environ[ADAPT_INTERVAL_ENV]
    return out


def _faults(payload: dict) -> dict:
    """What a GPU would refuse, injected into the plugin on a working setup (local, full, greedy):
    a Python branch on a tensor value in the exchange, an ``.item()`` in the processor's per-step
    head guard, and tensors the graph reads replaced after capture."""
    from sglang.srt.runtime_context import get_spec

    from sglang_frspec.adapters.logits import FrSpecLogitsProcessor
    from sglang_frspec.core.gather import HotLogitsExchange
    from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV

    os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV] = "local", "full"
    full, check_head = HotLogitsExchange.full, FrSpecLogitsProcessor._check_head

    def full_with_a_branch(self, local, all_gather):
        if torch.isnan(local).any():  # a Python branch on a tensor value: a host sync
            local = local.nan_to_num()
        return full(self, local, all_gather)

    def check_head_with_item(self, lm_head):
        check_head(self, lm_head)
        if lm_head.weight.abs().sum().item() == 0:  # a value check: a host sync
            raise ValueError("the hot head is all zeros")

    steps, out = payload["steps"], {}
    with get_spec().override(speculative_use_rejection_sampling=False):
        injections = (
            ("branch in the exchange", HotLogitsExchange, {"full": full_with_a_branch}),
            (".item() in the head guard", FrSpecLogitsProcessor, {"_check_head": check_head_with_item}),
        )
        for name, target, injected in injections:
            worker = plugin_worker(payload)
            with patch.multiple(target, **injected):
                out[name] = _error(lambda w=worker: _build_runner(w, steps))
        worker = plugin_worker(payload)
        runner = _build_runner(worker, steps)
        rows = payload["replays"][0][0]
        batch = lambda: _forward_batch(_draft_input(rows, payload, 1, False), rows, steps, 1.0)  # noqa: E731
        out["control"] = _error(lambda: runner.execute(batch()))
        hidden_states = runner.buffers.hidden_states
        runner.buffers.hidden_states = torch.zeros_like(hidden_states)  # a new buffer the runner copies into
        out["buffer replaced"] = _error(lambda: runner.execute(batch()))
        runner.buffers.hidden_states = hidden_states
        worker.hot_token_id = worker.hot_token_id.clone()  # a map swap that replaces instead of refilling
        out["hot_token_id replaced"] = _error(lambda: runner.execute(batch()))
    return out


def _extend_batch(rows: int, payload: dict, seed: int):
    """A draft-extend batch after verify: ``rows`` requests of ``steps + 1`` tokens each (the
    target's hidden states), the last accepted token of each selected for the head."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    width = payload["steps"] + 1
    g = torch.Generator().manual_seed(seed)
    accepted = torch.randint(1, width + 1, (rows,), generator=g)
    select_index = torch.arange(rows) * width + accepted - 1
    spec_info = EagleDraftExtendInput(
        hidden_states=torch.randn(rows * width, payload["hidden"], generator=g),
        num_correct_drafts=(accepted - 1).int(),
        num_accept_tokens=accepted.int(),
        num_tokens_per_req=width,
        num_tokens_for_logprob_per_req=1,
        select_index=select_index,
    )
    seq_lens = torch.arange(rows, dtype=torch.int64) + 10
    batch = ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=rows,
        input_ids=torch.randint(0, payload["vocab"], (rows * width,), generator=g),
        req_pool_indices=torch.arange(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        extend_seq_lens=torch.full((rows,), width, dtype=torch.int32),
        extend_seq_lens_cpu=[width] * rows,
        out_cache_loc=torch.arange(rows * width, dtype=torch.int64) + 200,
        seq_lens_sum=int(seq_lens.sum()),
        positions=torch.arange(rows * width, dtype=torch.int64),
        return_logprob=False,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.LAST,
    )
    return batch, select_index


def _draft_extend_graph(payload: dict, layout: str, exchange: str) -> dict:
    """The plugin's draft with ``layout`` and ``exchange``, SGLang's draft-extend runner captured
    with recorded graphs (the processor writes SGLang's shared logits buffer), then batches of
    other values and sizes replayed, and the draft model's forward run eagerly on each."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV

    os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV] = layout, exchange
    with get_spec().override(speculative_use_rejection_sampling=False):  # else the exchange is full
        worker = plugin_worker(payload)
    draft = worker.draft_runner.model
    runner = _build_runner(worker, payload["steps"], EAGLEDraftExtendCudaGraphRunner)
    buffer = runner.buffers.next_token_logits_buffer
    out = {"exchange": draft.logits_processor.exchange, "buffer": tuple(buffer.shape),
           "collectives": {str(k): g.collectives for k, g in runner.backend.graphs.items()}}  # fmt: skip
    for rows, seed, _ in payload["replays"]:
        batch, select_index = _extend_batch(rows, payload, seed)
        replay = runner.execute(batch, select_index)
        batch, _ = _extend_batch(rows, payload, seed)
        eager = draft(batch.input_ids, batch.positions, batch)
        out[(rows, seed)] = {
            "replay": (replay.next_token_logits.clone(), replay.hidden_states.clone()),
            "eager": (eager.next_token_logits, eager.hidden_states),
            "in buffer": replay.next_token_logits.data_ptr()
            == runner.buffers.next_token_logits_buffer.data_ptr(),
        }
    return out


def _swap_and_refresh_after_capture(runner, worker, payload: dict) -> dict:
    """After capture (under rejection sampling, so q shows every hot column): the plugin's adaptive
    map swaps ids in (its own decision from committed tokens, applied on every rank), then a weight
    update in place is followed by the plugin's head refresh. Both rewrite ``hot_token_id`` and the
    head in place, so the graph must read the new map and head: each replay is compared with
    ``draft_forward`` run eagerly."""
    from sglang_frspec.adapters.state import state_of

    rows, seed, _ = payload["replays"][1]  # a captured size: the sampled tokens compare exactly
    state, hot_before = state_of(worker), worker.hot_token_id.clone()
    outside = torch.ones(payload["vocab"], dtype=torch.bool)
    outside[hot_before] = False
    incoming = outside.nonzero().flatten()[::97]  # spread over both ranks' vocab shards
    for _ in range(8):  # committed tokens outside the map, counted as the verify hook counts them
        state.coverage.counts.add(incoming, torch.tensor([incoming.numel()]), incoming.numel())
    state.coverage.adapter.after_verify()  # rank 0 decides, every rank applies
    out = {"swapped": int((worker.hot_token_id != hot_before).sum())}
    out["after swap"] = _replay_and_eager(runner, worker, payload, rows, seed, True, False)
    with torch.no_grad():
        worker.target_worker.model_runner.model.lm_head.weight.mul_(1.5)  # a weight update in place
    state.head.refresh()
    out["after refresh"] = _replay_and_eager(runner, worker, payload, rows, seed, True, False)
    return out


def _target_model_runner(payload: dict, model: _OneLayerTarget, speculative: bool):
    """A stand-in for the target's ``ModelRunner`` as SGLang's decode graph runner reads it: the
    model, its config, the server's settings; no LoRA, no pipeline, no attention."""
    from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    config = SimpleNamespace(
        vocab_size=payload["vocab"],
        hidden_size=payload["hidden"],
        is_encoder_decoder=False,
        model_is_mrope=False,
        dtype=torch.float32,
        hf_config=model.config,
        hf_text_config=model.config,
    )
    runner = SimpleNamespace(
        device="cpu",
        gpu_id=0,
        dtype=torch.float32,
        spec_algorithm=SpeculativeAlgorithm.EAGLE if speculative else SpeculativeAlgorithm.NONE,
        is_draft_worker=False,
        model_config=config,
        model=model,
        req_to_token_pool=SimpleNamespace(size=payload["max_running"]),
        server_args=get_server_args(),
        attn_backend=_AttentionStandIn(),
        lora_manager=None,
        ngram_embedding_manager=SimpleNamespace(enabled=False),
        hisparse_coordinator=None,
        kv_index_translator=SimpleNamespace(bind_runner_slots=lambda forward_batch: None),
        capture_head_hooks=[],
        capture_tail_hooks=[],
        device_timer=None,
        canary_manager=None,
        shared_read_done_event=None,
        graph_shared_output=GraphSharedOutput(device=torch.device("cpu"), max_rows=payload["max_running"]),
        attn_tp_sequence_sharded=lambda num_tokens: False,
        get_pp_proxy_topk_size=lambda: None,
        get_pp_proxy_residual_num_blocks=lambda: None,
        get_pp_proxy_dspark_hidden_size=lambda: None,
        get_aux_hidden_states_width=lambda: None,
    )
    runner.decode_num_tokens_per_req = lambda **kw: ModelRunner.decode_num_tokens_per_req(runner, **kw)
    return runner


def _build_target_runner(runner):
    """SGLang's decode graph runner of the target (TARGET_VERIFY under EAGLE) on recorded graphs."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    with _recorded_capture(DecodeCudaGraphRunner):
        return DecodeCudaGraphRunner(runner)


def _target_batch(payload: dict, input_ids: torch.Tensor, speculative: bool):
    """A target batch of ``input_ids`` ``[rows, width]``: under EAGLE a verify batch (each row the
    last verified token, then the drafted ones), else a decode batch (width 1)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rows, width = input_ids.shape
    seq_lens = torch.arange(rows, dtype=torch.int64) + 5
    positions = (seq_lens[:, None] + torch.arange(width)).flatten()
    spec_info = None
    if speculative:
        spec_info = EagleVerifyInput(
            draft_token=input_ids.flatten(),
            custom_mask=None,
            positions=positions,
            retrieve_index=None,
            retrieve_next_token=None,
            retrieve_next_sibling=None,
            retrieve_cum_len=None,
            spec_steps=payload["steps"],
            topk=1,
            draft_token_num=width,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens.clone(),
        )
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY if speculative else ForwardMode.DECODE,
        batch_size=rows,
        input_ids=input_ids.flatten(),
        req_pool_indices=torch.arange(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=torch.arange(rows * width, dtype=torch.int64) + 300,
        seq_lens_sum=int(seq_lens.sum()),
        positions=positions,
        return_logprob=False,
        spec_algorithm=SpeculativeAlgorithm.EAGLE if speculative else SpeculativeAlgorithm.NONE,
        spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.FULL if speculative else CaptureHiddenMode.NULL,
    )


def _target_graphs(payload: dict, layout: str, exchange: str, rejection_sampling: bool = False) -> dict:
    """One EAGLE step in graphs: the plugin's draft (``layout``, ``exchange``) and SGLang's
    draft-decode runner draft each batch's tokens (sampled from the hot q under rejection
    sampling), which SGLang's target runner verifies (TARGET_VERIFY, captured as the target's
    decode graphs); each replay is compared with the target run eagerly on the same batch."""
    from sglang.srt.runtime_context import get_spec

    from sglang_frspec.core.options import EXCHANGE_ENV, LAYOUT_ENV

    os.environ[LAYOUT_ENV], os.environ[EXCHANGE_ENV] = layout, exchange
    target = _OneLayerTarget(payload["vocab"], payload["hidden"])
    with get_spec().override(speculative_use_rejection_sampling=rejection_sampling):
        worker = plugin_worker(payload, target)
        draft_runner = _build_runner(worker, payload["steps"])
        verify_runner = _build_target_runner(_target_model_runner(payload, target, speculative=True))
        graphs = verify_runner.backend.graphs
        out = {"mode": verify_runner.capture_forward_mode.name, "keys": sorted(k.size for k in graphs),
               "collectives": {str(k): g.collectives for k, g in graphs.items()}}  # fmt: skip
        for rows, seed, _ in payload["replays"]:
            draft_input = _draft_input(rows, payload, seed, rejection_sampling)
            draft_batch = _forward_batch(draft_input, rows, payload["steps"], payload["temperature"])
            drafted = draft_runner.execute(draft_batch)[2].clone()  # [rows, steps] target ids
            g = torch.Generator().manual_seed(seed)
            ids = torch.cat([torch.randint(0, payload["vocab"], (rows, 1), generator=g), drafted], 1)
            replay = verify_runner.execute(_target_batch(payload, ids, speculative=True))
            batch = _target_batch(payload, ids, speculative=True)
            eager = target(batch.input_ids, batch.positions, batch)
            out[(rows, seed)] = {
                "drafted": drafted,
                "replay": (replay.next_token_logits.clone(), replay.hidden_states.clone()),
                "eager": (eager.next_token_logits, eager.hidden_states),
            }
    return out


def _target_decode_graph(payload: dict) -> dict:
    """SGLang's target decode runner without speculation (DECODE, one token per request) beside
    the plugin's draft, replayed and run eagerly; then the target's LM head replaced after capture
    (a weight update that rebinds instead of copying in place): the replay must refuse it."""
    target = _OneLayerTarget(payload["vocab"], payload["hidden"])
    plugin_worker(payload, target)  # the draft's hot head gathered from this target's head
    runner = _build_target_runner(_target_model_runner(payload, target, speculative=False))
    out = {"mode": runner.capture_forward_mode.name, "keys": sorted(k.size for k in runner.backend.graphs)}
    for rows, seed, _ in payload["replays"]:
        ids = torch.randint(0, payload["vocab"], (rows, 1), generator=torch.Generator().manual_seed(seed))
        replay = runner.execute(_target_batch(payload, ids, speculative=False))
        batch = _target_batch(payload, ids, speculative=False)
        eager = target(batch.input_ids, batch.positions, batch)
        out[(rows, seed)] = {"replay": replay.next_token_logits.clone(), "eager": eager.next_token_logits}
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    ids = torch.zeros(1, 1, dtype=torch.long)
    out["head replaced"] = _error(lambda: runner.execute(_target_batch(payload, ids, speculative=False)))
    return out


def recorded_eagle_graph_cases(payload: dict) -> dict:
    """With the plugin loaded: the draft-decode graph under each layout and exchange, greedy
    (no rejection sampling) and under rejection sampling (its sampling and all-greedy graphs,
    the exchange forced to ``full``); the draft-extend graph and one EAGLE step with the target's
    verify graph under each layout and exchange; the target's plain decode graph; then the
    injected faults and the collective captures."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out = {}
    for rejection_sampling in (False, True):
        for layout in ("local", "balanced"):
            for exchange in ("full",) if rejection_sampling else ("full", "topk"):
                case = (layout, exchange, rejection_sampling)
                out[case] = _draft_decode_graph(payload, *case)
    for layout in ("local", "balanced"):
        for exchange in ("full", "topk"):
            out[("extend", layout, exchange)] = _draft_extend_graph(payload, layout, exchange)
            out[("verify", layout, exchange)] = _target_graphs(payload, layout, exchange)
    out[("verify", "balanced", "full", "rejection")] = _target_graphs(payload, "balanced", "full", True)
    out["target decode"] = _target_decode_graph(payload)
    return out | {"faults": _faults(payload), "collective captures": collective_captures(payload)}


def collective_captures(payload: dict) -> dict:
    """Captures of collectives on this rank, recorded directly: a functional all-reduce (torch's
    ``_functional_collectives``, its output waited on by a separate op) replayed with ``x`` set to
    each of two values times (rank + 1); then a capture in which rank 1 skips the all-reduce that
    rank 0 issues (on a group of its own whose gloo timeout frees rank 0's pending op soon after),
    with ``payload["collective timeout"]``, and one in which it skips a functional all-reduce: rank
    0's errors and how long each took."""
    import datetime
    import time

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tests.harness.gpu_defaults.recorded_graphs import record

    rank, x = dist.get_rank(), torch.zeros(4)
    graph, _ = record(lambda: funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1)
    out: dict = {"replays": {}}
    for value in (1.0, 5.0):
        x.fill_(value * (rank + 1))
        out["replays"][value] = graph.replay().clone()

    skipped_group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=3))

    def skipping() -> torch.Tensor:
        y = x * 1
        if rank == 0:
            dist.all_reduce(y, group=skipped_group)
        return y

    start = time.monotonic()
    out["skipped"] = _error(lambda: record(skipping, collective_timeout=payload["collective timeout"]))
    out["seconds"] = time.monotonic() - start
    # The same with a functional all-reduce, whose wait_tensor takes no timeout (the group's: 6 s).
    functional_group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=6))

    def skipping_functional() -> torch.Tensor:
        y = x * 1
        return funcol.all_reduce(y, "sum", functional_group) + 1 if rank == 0 else y

    start = time.monotonic()
    timeout = payload["collective timeout"]
    out["skipped functional"] = _error(lambda: record(skipping_functional, collective_timeout=timeout))
    out["functional seconds"] = time.monotonic() - start
    return out
