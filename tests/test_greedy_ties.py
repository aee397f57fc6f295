"""compare_greedy (tools.serving.greedy) on the random fixture, against HF greedy decoding."""

from __future__ import annotations

import pytest

from tests.harness.fixtures import random_fixture
from tools.serving.greedy import TIE_EPSILON, compare_greedy, next_token_logits

PROMPT = [9, 9, 9, 9, 12000]  # its 20th greedy token is a near-tie (the CI flake of issue 11)


def hf_greedy(target: str, prompt: list[int], steps: int) -> tuple[list[int], list[tuple[int, float]]]:
    """Greedy tokens, and each step's (runner-up id, top-2 margin), from plain HF forwards."""
    tokens, runners_up = [], []
    for _ in range(steps):
        values, ids = next_token_logits(target, prompt + tokens).topk(2)
        tokens.append(int(ids[0]))
        runners_up.append((int(ids[1]), float(values[0] - values[1])))
    return tokens, runners_up


@pytest.fixture(scope="module")
def decoded():
    target = random_fixture().target
    return target, *hf_greedy(target, PROMPT, 20)


def test_a_flip_at_a_near_tie_is_accepted_and_ends_the_comparison(decoded):
    target, tokens, runners_up = decoded
    tie = min(range(len(tokens)), key=lambda i: runners_up[i][1])
    assert runners_up[tie][1] < TIE_EPSILON  # the fixture really has a near-tie here
    flipped = tokens[:tie] + [runners_up[tie][0]] + [3] * (len(tokens) - tie - 1)  # then anything
    [divergence] = compare_greedy(target, [PROMPT], [flipped], [tokens])
    assert (divergence.position, divergence.got, divergence.expected) == (
        tie,
        runners_up[tie][0],
        tokens[tie],
    )
    assert compare_greedy(target, [PROMPT], [tokens], [tokens]) == []


def test_a_flip_with_a_clear_margin_or_outside_the_top2_fails(decoded):
    target, tokens, runners_up = decoded
    clear = max(range(len(tokens)), key=lambda i: runners_up[i][1])
    assert runners_up[clear][1] > 10 * TIE_EPSILON
    runner_up = tokens[:clear] + [runners_up[clear][0]] + tokens[clear + 1 :]
    with pytest.raises(AssertionError, match=f"sequence 0 token {clear}: got {runners_up[clear][0]}"):
        compare_greedy(target, [PROMPT], [runner_up], [tokens])
    outside = tokens[:-1] + [3 if tokens[-1] != 3 else 4]
    with pytest.raises(AssertionError, match="beyond near-ties"):
        compare_greedy(target, [PROMPT], [outside], [tokens])
    with pytest.raises(AssertionError, match="equal up to the shorter"):
        compare_greedy(target, [PROMPT], [tokens[:-1]], [tokens])
