"""Functions run on a real SGLang rank: the draft-decode CUDA graph runner's q under rejection
sampling with a map (see tests/test_graph_rejection_sampling.py).

SGLang's own ``EAGLEDraftCudaGraphRunner`` is built, captured and replayed on the CPU: its
``__init__`` allocates the buffers, ``capture_one_shape`` runs ``EagleDraftWorker.draft_forward``
on them (the stack of q) and ``execute`` copies a batch into them (the copy of q), as SGLang's own
runner test kit does (``sglang/test/kits/attention_unittest/runner_modes/
speculative_draft_runner.py``). Only what needs a GPU is stood in for: a CUDA graph (the backend
below runs the captured function again at replay, on the same buffers, which is what replaying a
graph computes), the graph-capture stream, attention metadata, and the draft model, whose forward
returns ``[rows, H]`` logits as the plugin's logits processor does.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from unittest.mock import patch

import torch

GRAPH_CAPTURE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.graph_capture"
RESOLVE_BACKEND = "sglang.srt.speculative.eagle_draft_cuda_graph_runner.resolve_decode_backend"


def hot_draft_head(hot: int, hidden: int) -> torch.Tensor:
    """The stand-in draft's ``[H, hidden]`` head (the test recomputes it from the same seed)."""
    return torch.randn(hot, hidden, generator=torch.Generator().manual_seed(5)) / hidden**0.5


def _eager_graph_backend(runner):
    """A graph backend that captures a function by running it once and replays it by running it
    again: the captured function reads and writes the runner's buffers, as a CUDA graph does. A
    graph also freezes the Python branches taken at capture; the one that differs between the
    runner's two captures of a size is the greedy variant's (no q), so it is restored at replay."""
    from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend

    def captured_batch(forward_fn):  # the capture's ForwardBatch, which the function closes over
        return forward_fn.__closure__[forward_fn.__code__.co_freevars.index("forward_batch")].cell_contents

    class EagerGraphBackend(BaseCudaGraphBackend):
        def __init__(self):
            self.graphs = {}

        @contextlib.contextmanager
        def capture_session(self, stream):
            yield

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            forward_fn()
            greedy = captured_batch(forward_fn).sampling_info.is_all_greedy

            def replay():
                captured_batch(forward_fn).sampling_info.is_all_greedy = greedy
                return forward_fn()

            self.graphs[shape_key] = replay

        def can_run(self, forward_batch, shape_key):
            return shape_key in self.graphs

        @contextlib.contextmanager
        def replay_session(self):
            yield

        def replay(self, shape_key, static_forward_batch, **kwargs):
            return self.graphs[shape_key]()

        def cleanup(self):
            self.graphs.clear()

    return EagerGraphBackend()


@contextlib.contextmanager
def _no_capture_stream(stream=None):
    yield SimpleNamespace(stream=stream)


def _draft_worker(payload: dict):
    """A real ``EagleDraftWorker`` (its ``draft_forward``, and the plugin's state on it) over a
    stand-in draft runner; ``__init__`` is skipped as in SGLang's kit (it loads a model)."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_frspec.adapters.state import FrSpecState, attach_state

    hot, hidden, steps = payload["hot"], payload["hidden"], payload["steps"]
    head = hot_draft_head(hot, hidden)

    class AttentionStandIn:
        attn_backends = property(lambda self: [self] * steps)

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def init_cuda_graph_state(self, *args, **kwargs):
            pass

        def init_forward_metadata_in_graph(self, *args, **kwargs):
            pass

        def init_forward_metadata_out_graph(self, *args, **kwargs):
            pass

    def forward(forward_batch):  # the draft: hidden states unchanged, logits over the H hot ids
        states = forward_batch.spec_info.hidden_states
        return SimpleNamespace(
            logits_output=LogitsProcessorOutput(next_token_logits=states @ head.T, hidden_states=states)
        )

    config = SimpleNamespace(
        vocab_size=payload["vocab"],  # the draft model's vocab, as SGLang reads it for the buffer
        model_is_mrope=False,
        spec_hidden_size=hidden,
        dtype=torch.float32,
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLMEagle"]),
    )
    runner = SimpleNamespace(
        device="cpu",
        gpu_id=0,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        is_draft_worker=True,
        model_config=config,
        model=SimpleNamespace(shared_experts_config=SharedExpertsConfig(), forward=None),
        req_to_token_pool=SimpleNamespace(size=payload["max_running"]),
        server_args=get_server_args(),
        kv_index_translator=SimpleNamespace(bind_runner_slots=lambda forward_batch: None),
        device_timer=None,
        canary_manager=None,
        draft_attn_backend=AttentionStandIn(),
        forward=forward,
    )
    worker = EagleDraftWorker.__new__(EagleDraftWorker)
    worker.server_args, worker.device = get_server_args(), "cpu"
    worker.draft_runner, worker.draft_attn_backend = runner, runner.draft_attn_backend
    worker.topk, worker.speculative_num_steps, worker.speculative_num_draft_tokens = 1, steps, steps + 1
    worker.hot_token_id = torch.tensor(payload["hot_ids"])
    worker.speculative_algorithm = SpeculativeAlgorithm.EAGLE
    worker.index_share_for_mtp_iteration = worker.seed_dsa_topk_from_draft_extend = False
    worker.dsa_seed_topk_width = None
    worker._rebuild_topk1_chain_buffers()
    attach_state(worker, FrSpecState(payload["map"], None, None))  # what init_token_map attaches
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


def _build_runner(worker, steps: int):
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    with patch(GRAPH_CAPTURE, _no_capture_stream), patch(RESOLVE_BACKEND, _eager_graph_backend):
        return EAGLEDraftCudaGraphRunner(worker, speculative_num_steps=steps)


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
    worker = _draft_worker(payload)
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
