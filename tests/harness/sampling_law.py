"""The law of the tokens EAGLE's sampling verify commits, against the target's exact law.

Speculative sampling is lossless when every token the verify decides (a request's second and later
tokens: the first comes from the prefill's plain sampler) follows the target's own next-token law
given everything before it: p(. | context) at the request's temperature, top-k and top-p, renormalised
as SGLang's verify renormalises it. ``target_laws`` computes that law exactly with an HF forward of
the target (independent of SGLang), ``check_law`` tests observed tokens against it.

The test classifies each token relative to its context into four classes: the context's most
probable token, another id of the map, an id outside the map in TP rank 0's half of the vocab, one in
rank 1's half. The map's misses (and the vocab halves the TP ranks own) are where a wrong scatter of
the draft's hot probabilities shows. Its statistic is Pearson's X^2 of the class counts against
their expectation (the sum over tokens of each context's class probabilities); its null distribution
is simulated from those exact per-token class probabilities (seeded), so the significance holds for
small expected counts too and the outcome is deterministic. ``power`` simulates the same test under a
wrong law at the same contexts; ``fault_laws`` gives the laws of the two scatter faults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tools.serving.greedy import _load_target

CLASSES = ("most probable", "other map ids", "outside the map, rank 0 half", "outside the map, rank 1 half")
REPLICATES = 20000  # simulated statistics under the null (and per power estimate)


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters as SGLang reads them (top_k -1: all tokens)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def params(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def renormalised(probs: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """SGLang's verify target: top-k, then top-p (each keeping every tie at its pivot), renormalised.

    Written from the definitions, independently of the CPU stand-in's ops: top-k keeps the tokens
    at least as probable as the k-th most probable; top-p keeps a token when the mass of the tokens
    strictly more probable than it is below p."""
    if 0 < sampling.top_k < probs.shape[-1]:
        pivot = probs.topk(sampling.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= pivot, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1.0:
        ordered = probs.sort(-1, descending=True).values
        before = ordered.cumsum(-1) - ordered  # mass of the tokens ahead in the order
        pivot_rank = (before < sampling.top_p).sum(-1, keepdim=True) - 1
        pivot = ordered.gather(-1, pivot_rank)
        probs = torch.where(probs >= pivot, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def target_logits(target_path: str, contexts: list[list[int]]) -> torch.Tensor:
    """``[n, V]`` float32 next-token logits after each context: HF forwards of the target, batched
    by context length."""
    model = _load_target(target_path)
    out = torch.empty(len(contexts), model.config.vocab_size)
    for length in {len(c) for c in contexts}:
        rows = [i for i, c in enumerate(contexts) if len(c) == length]
        with torch.no_grad():
            out[rows] = model(torch.tensor([contexts[i] for i in rows])).logits[:, -1].float()
    return out


def target_laws(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The verify's target law: softmax(logits / T), renormalised by top-k and top-p."""
    return renormalised(torch.softmax(logits / sampling.temperature, -1), sampling)


def decided_tokens(prompts: list[list[int]], outputs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(context, token) of every token after each output's first (the verify's decisions)."""
    pairs = [(p + out[:i], out[i]) for p, out in zip(prompts, outputs) for i in range(1, len(out))]
    return [c for c, _ in pairs], [t for _, t in pairs]


def _class_masks(laws: torch.Tensor, in_map: torch.Tensor) -> list[torch.Tensor]:
    """Per context, the four classes as ``[n, V]`` masks."""
    vocab = laws.shape[-1]
    top = torch.zeros_like(laws, dtype=torch.bool).scatter_(-1, laws.argmax(-1, keepdim=True), True)
    low = torch.arange(vocab) < -(-vocab // 2)  # rank 0's half of the vocab at TP=2
    return [top, in_map & ~top, ~in_map & low & ~top, ~in_map & ~low & ~top]


def class_probs(laws: torch.Tensor, in_map: torch.Tensor) -> torch.Tensor:
    """``[n, 4]``: each context's probability of each class."""
    return torch.stack([(laws * m).sum(-1) for m in _class_masks(laws, in_map)], -1)


def classes_of(tokens: list[int], laws: torch.Tensor, in_map: torch.Tensor) -> torch.Tensor:
    """``[n]``: the class of each token relative to its context's law."""
    index = torch.tensor(tokens).unsqueeze(-1)
    hits = torch.stack([m.gather(-1, index).squeeze(-1) for m in _class_masks(laws, in_map)], -1)
    assert bool((hits.sum(-1) == 1).all())  # the classes partition the vocab
    return hits.float().argmax(-1)


def _statistic(counts: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Pearson's X^2 over the classes (rows of ``counts``); a count where none is expected is inf."""
    terms = (counts - expected) ** 2 / expected
    return torch.where(expected > 0, terms, torch.where(counts > 0, torch.inf, 0.0)).sum(-1)


def _simulated_counts(probs: torch.Tensor, seed: int) -> torch.Tensor:
    """``[REPLICATES, 4]`` class counts, each token's class drawn from its row of ``probs``."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(probs, REPLICATES, replacement=True, generator=gen)  # [n, REPLICATES]
    counts = torch.zeros(REPLICATES, probs.shape[-1])
    return counts.scatter_add_(1, draws.T, torch.ones(REPLICATES, draws.shape[0]))


@dataclass(frozen=True)
class LawCheck:
    """The outcome of ``check_law``: observed and expected class counts, X^2 and its p-value."""

    observed: list[int]
    expected: list[float]
    statistic: float
    p_value: float
    critical: float  # the statistic's simulated (1 - alpha) quantile under the target's law

    def __str__(self) -> str:
        cells = ", ".join(f"{n}: {o} vs {e:.1f}" for n, o, e in zip(CLASSES, self.observed, self.expected))
        return f"X^2 {self.statistic:.2f} (p {self.p_value:.2g}, critical {self.critical:.2f}); {cells}"


def check_law(probs: torch.Tensor, observed: torch.Tensor, alpha: float, seed: int = 0) -> LawCheck:
    """Test observed classes against per-token class probabilities ``probs`` ``[n, 4]``."""
    expected = probs.sum(0)
    counts = torch.bincount(observed, minlength=probs.shape[-1]).float()
    null = _statistic(_simulated_counts(probs, seed), expected)
    statistic = float(_statistic(counts, expected))
    p_value = (1 + int((null >= statistic).sum())) / (1 + REPLICATES)
    critical = float(null.quantile(1 - alpha))
    return LawCheck(counts.long().tolist(), expected.tolist(), statistic, p_value, critical)


def power(check: LawCheck, wrong: torch.Tensor, seed: int = 1) -> float:
    """Chance that ``check``'s test rejects tokens whose classes follow ``wrong`` (``[n, 4]``, at
    the same contexts) instead of the target's law: simulated."""
    statistics = _statistic(_simulated_counts(wrong, seed), torch.tensor(check.expected))
    return float((statistics > check.critical).float().mean())


def chain_rejection_law(p: torch.Tensor, q_drawn: torch.Tensor, q_seen: torch.Tensor) -> torch.Tensor:
    """Law of one chain rejection-sampling decision (SGLang's ``chain_speculative_sampling_triton``):
    the draft X ~ ``q_drawn`` is kept when coin * q_seen(X) < p(X), else the token comes from
    relu(p - q_seen). Equals ``p`` when ``q_seen`` is ``q_drawn``."""
    keep = torch.where(q_seen > 0, q_drawn * torch.clamp(p / q_seen, max=1.0), 0.0)
    residual = torch.clamp(p - q_seen, min=0)
    rejected = torch.clamp(1 - keep.sum(-1, keepdim=True), min=0)  # not below 0 by rounding
    return keep + rejected * residual / residual.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)


def fault_laws(logits: torch.Tensor, sampling: Sampling, in_map: torch.Tensor, rejection: bool) -> dict:
    """Laws of the committed tokens under the two scatter faults, for a draft whose logits equal the
    target's on the map (``tests.harness.fixtures.sharp_draft_fixture``): ``renormalised q`` lays the
    hot probabilities over the vocab rescaled to the target's mass on the map (rejection sampling
    only: target-only verify reads no q); ``p without the misses`` drops the target's mass outside
    the map from p (the verify then commits p restricted to the map, renormalised)."""
    p = target_laws(logits, sampling)
    laws = {"p without the misses": p * in_map / (p * in_map).sum(-1, keepdim=True)}
    if rejection:
        q = torch.softmax((logits / sampling.temperature).masked_fill(~in_map, -torch.inf), -1)
        laws["renormalised q"] = chain_rejection_law(p, q, q * (p * in_map).sum(-1, keepdim=True))
    return laws
