"""Timed runs of real servers, shared by the demo and the server benchmarks: the warm-up, one timed
batch, and interleaved rounds whose reference system runs first and last, with the rule that
refuses a ratio to it when its own runs drifted apart."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sglang_frspec.demo.server import SGLangServer

# Tokens per request of an untimed warm-up batch: enough to run every shape a timed batch runs.
WARM_UP_TOKENS = 4
# The largest spread (max / min - 1) of the reference system's tokens/s over its runs at which a
# ratio to it is still printed: beyond it the machine's speed moved more than the effects measured.
MAX_REFERENCE_DRIFT = 0.10

Prompt = str | list[int]


def generate(server: SGLangServer, prompts: Sequence[Prompt], max_new_tokens: int, **sampling) -> list[dict]:
    """One ``/generate`` call for all of ``prompts`` (texts or token ids) together; greedy unless
    ``sampling`` says otherwise, never stopped early by EOS (every request makes its tokens)."""
    key = "text" if isinstance(prompts[0], str) else "input_ids"
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True} | sampling
    outs = server.post("/generate", {key: list(prompts), "sampling_params": params})
    return outs if isinstance(outs, list) else [outs]


def warm_up(server: SGLangServer, prompts: Sequence[Prompt], sizes: Sequence[int] = (1,)) -> None:
    """Untimed batches of the first ``size`` prompts for each of ``sizes``, a few tokens each: the
    first requests of a server (or of one resumed after SIGSTOP) also time its start-up."""
    for size in sizes:
        generate(server, prompts[:size], WARM_UP_TOKENS)


def timed_batch(
    server: SGLangServer, prompts: Sequence[Prompt], max_new_tokens: int, at_once: int = 0
) -> dict:
    """Greedy outputs of ``prompts`` sent as closed batches of ``at_once`` requests (default: all in
    one batch), one after another, and ``batch_figures`` of them all over the time of all batches."""
    at_once = at_once or len(prompts)
    outs: list[dict] = []
    begin = time.perf_counter()
    for first in range(0, len(prompts), at_once):
        outs += generate(server, prompts[first : first + at_once], max_new_tokens)
    return batch_figures(outs, time.perf_counter() - begin)


def batch_figures(outs: list[dict], seconds: float) -> dict:
    """The figures of ``/generate`` responses that took ``seconds``: outputs, tokens, EAGLE's verify
    cycles (the sum of SGLang's ``spec_verify_ct``; None for plain decoding), tokens/s, the accept
    length over all requests (tokens per verify cycle, as SGLang's ``spec_accept_length`` is per
    request; None for plain decoding) and each request's accept length and verify cycles."""
    tokens = sum(len(o["output_ids"]) for o in outs)
    verify = [o["meta_info"].get("spec_verify_ct") for o in outs]
    cycles = None if None in verify else sum(verify)
    return {
        "outputs": [o["output_ids"] for o in outs],
        "texts": [o.get("text") for o in outs],
        "seconds": seconds,
        "tokens": tokens,
        "cycles": cycles,
        "tokens_per_s": tokens / seconds,
        "accept_length": tokens / cycles if cycles else None,
        "accept_lengths": [o["meta_info"].get("spec_accept_length") for o in outs],
        "verify_ct": [o["meta_info"].get("spec_verify_ct") or 0 for o in outs],
    }


def round_order(names: Sequence[str], rounds: int) -> list[str]:
    """The order interleaved rounds run ``names`` in: each round all of them in the order given,
    then the first (the reference, e.g. plain decoding) once more, so it runs before and after
    everything else and its drift over the run is measured."""
    return [*names] * rounds + [names[0]] if len(names) > 1 else [*names] * rounds


def interleaved_rounds(
    run: Callable[[str], dict], names: Sequence[str], rounds: int
) -> dict[str, list[dict]]:
    """``run(name)`` (one timed sample of system ``name``) in ``round_order``; the samples by name."""
    samples: dict[str, list[dict]] = {name: [] for name in names}
    for name in round_order(names, rounds):
        samples[name].append(run(name))
    return samples


def drift(tokens_per_s: Sequence[float]) -> float:
    """The spread of one system's runs: max / min - 1 (0 for a single run)."""
    return max(tokens_per_s) / min(tokens_per_s) - 1


def ratio_refusal(reference: Sequence[float], max_drift: float = MAX_REFERENCE_DRIFT) -> str | None:
    """Why no ratio to the reference system may be printed (its runs' tokens/s ``reference`` drifted
    apart by more than ``max_drift``), or None when it may."""
    if len(reference) < 2:
        return "the reference ran once: its drift over the run is unknown (run it at least twice)"
    spread = drift(reference)
    if spread <= max_drift:
        return None
    return (
        f"the reference's runs differ by {spread:.0%} (tokens/s {min(reference):.3g}-{max(reference):.3g}), "
        f"more than the {max_drift:.0%} allowed: the machine's speed moved more than a ratio can show"
    )
