"""Sampling with a map: the draft's hot probabilities laid over the target vocab for rejection
sampling (``core/hot_probs.py``), the exchange rule's pick, and a PD decode node's received drafts
through the target-only verify, against independent references."""

from __future__ import annotations

import pytest
import torch

from sglang_frspec.core import HotWireOrder, canonical_hot_ids
from sglang_frspec.core.exchange_rule import exchange_at_start
from sglang_frspec.core.hot_probs import lay_hot_probs_over_vocab
from sglang_frspec.core.plan import plan_from_ranges
from tests import rank_cases_sampling
from tests.harness.tp_group import run_tp_group

VOCAB, HIDDEN, ROWS, TOPK, TEMPERATURE = 1009, 32, 5, 2, 0.7


def _placed(hot_probs: torch.Tensor, ids: list[int], vocab: int) -> torch.Tensor:
    """Reference: column j of ``hot_probs`` is token ``ids[j]``; every other token has q = 0."""
    out = torch.zeros(*hot_probs.shape[:-1], vocab)
    for j, token in enumerate(ids):
        out[..., token] = hot_probs[..., j]
    return out


def test_hot_probs_land_on_their_ids_and_nowhere_else():
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=g)[:37]  # distinct, in no particular order
    probs = torch.softmax(torch.randn(4, 3, 37, generator=g), -1)  # [bs, steps, H]
    q = lay_hot_probs_over_vocab(probs, ids, VOCAB)
    assert q.shape == (4, 3, VOCAB)
    assert torch.equal(q, _placed(probs, ids.tolist(), VOCAB))
    torch.testing.assert_close(q.sum(-1), torch.ones(4, 3))  # a distribution over the target vocab
    with pytest.raises(ValueError, match="36 probability columns for 37 hot ids"):
        lay_hot_probs_over_vocab(probs[..., :36], ids, VOCAB)


def test_rejection_sampling_makes_the_exchange_rule_pick_full():
    plan = plan_from_ranges(torch.arange(0, 40, 3), [(0, 20), (20, 40)], "balanced")
    requested = ("full", "topk", "auto")
    assert [exchange_at_start(e, plan, TOPK) for e in requested] == ["full", "topk", "auto"]
    assert [exchange_at_start(e, plan, TOPK, needs_distribution=True) for e in requested] == ["full"] * 3


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_draft_distribution_over_the_vocab_matches_the_single_rank_reference(tp):
    """Both layouts, both requested exchanges: the processor runs ``full``, and q over the target
    vocab is softmax(reference / T) at the map's ids, zero elsewhere, bit-identical on every rank."""
    ids = [7, 1008, 500, 3, 250, 251, 999, 12, 640, 77, 500]  # unordered, one repeat, both shards
    payload = {"vocab": VOCAB, "hidden": HIDDEN, "rows": ROWS, "topk": TOPK, "ids": ids,
               "temperature": TEMPERATURE}  # fmt: skip
    results = run_tp_group(rank_cases_sampling.draft_probs_over_vocab, tp, payload)
    columns = sorted(set(ids))
    expected = _placed(torch.softmax(results[0]["reference"] / TEMPERATURE, -1), columns, VOCAB)
    for key in [(layout, exchange) for layout in ("local", "balanced") for exchange in ("full", "topk")]:
        exchange, q = results[0][key]
        assert exchange == "full", key
        torch.testing.assert_close(q, expected, rtol=1e-5, atol=1e-7, msg=str(key))
        assert torch.count_nonzero(q[:, [t for t in range(VOCAB) if t not in columns]]) == 0, key
        assert all(torch.equal(r[key][1], q) for r in results[1:]), key  # the same on every rank


def test_rejection_sampling_with_a_hot_draft_commits_the_target_distribution():
    """SGLang's chain rejection sampling (the CPU site's torch op, checked against the Triton
    kernel in test_cpu_standin_sampling.py) with drafts drawn from a hot-only q laid over the vocab
    by ``lay_hot_probs_over_vocab``: the committed token follows p, including the 30% of p's mass
    outside the map. Seeded; a chi-square over 12 tokens at 40 (p-value about 4e-5 under p)."""
    from tests.test_cpu_standin_sampling import ops

    g = torch.Generator().manual_seed(36)
    n, vocab = 20000, 12
    hot_ids = torch.tensor([9, 2, 5, 0, 7, 3])  # unordered: column j is token hot_ids[j]
    p = torch.tensor([0.02, 0.05, 0.2, 0.1, 0.05, 0.1, 0.03, 0.12, 0.08, 0.05, 0.1, 0.1])
    hot_q = torch.softmax(torch.randn(6, generator=g), -1)  # the draft: far from p on the map
    drafts = hot_ids[torch.multinomial(hot_q, n, replacement=True, generator=g)]
    q = lay_hot_probs_over_vocab(hot_q.expand(n, 1, 6), hot_ids, vocab)
    predicts = torch.full((2 * n,), -1, dtype=torch.int32)
    candidates = torch.stack([torch.zeros(n, dtype=torch.int64), drafts], 1)
    retrive = torch.arange(2 * n).view(n, 2)
    ops.chain_speculative_sampling_triton(
        predicts, torch.full((n, 2), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), candidates,
        retrive, retrive, retrive, torch.rand(n, 2, generator=g), torch.rand(n, generator=g),
        p.expand(n, 2, vocab).contiguous(), q, 1.0, 1.0, True,
    )  # fmt: skip
    committed = torch.bincount(predicts[0::2].long(), minlength=vocab).float()  # the root's next token
    chi2 = float(((committed - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 40, (chi2, committed / n, p)


def _target_only_law(p: torch.Tensor, siblings: list[int]) -> torch.Tensor:
    """Reference law of the token SGLang's target-only tree verify commits after a root whose
    children are the sibling drafts ``siblings`` (leaves), from the kernel's definition: sibling i
    is taken when the coin falls in [sum of p over the siblings before it, that sum + p(sibling i));
    after all are rejected the token comes from p with the siblings' tokens removed."""
    law, tried = torch.zeros_like(p), 0.0
    for token in siblings:
        taken = min(tried + float(p[token]), 1.0) - tried
        law[token] += taken
        tried += taken
    rest = p.clone()
    rest[siblings] = 0
    return law + (1.0 - tried) * rest / rest.sum()


def test_target_only_sampling_of_pd_received_drafts_commits_the_target_distribution():
    """A PD decode node's first verify: the plugin reads the received rows of file positions as hot
    indices (``HotWireOrder.from_wire``, as its hook on SGLang's draft-input builder does), and
    SGLang's default sampling verify (the CPU site's torch version of the CUDA tree kernel, checked
    in test_cpu_standin_sampling.py) takes them as sibling drafts. Rows hold positions beyond the
    decode node's map (a stock prefill node with a longer map), one beside a real position 0, and
    two positions of one id (the file repeats it): the committed token follows p in every case.

    The law check is the server tests' (``sampling_law``: classes most probable / other map ids /
    outside the map, seeded, level 0.001); its simulated power against reading outside positions as
    position 0 (the same token twice as siblings, committed with twice its probability; simulated
    from ``_target_only_law``) must be at least 0.99: it is 1.0."""
    from tests.harness import sampling_law as law
    from tests.test_cpu_standin_sampling import ops

    vocab, n = 12, 2000
    decode_file = [9, 2, 5, 0, 9, 7]  # FR-Spec's list format: unsorted, the most frequent id repeated
    hot = canonical_hot_ids(torch.tensor(decode_file), vocab)
    wire = HotWireOrder.of(torch.tensor(decode_file), hot)
    # A stock prefill node with the map decode_file + [3, 11] (positions 6, 7 beyond this node's),
    # top-k 2: two outside, a real position 0 beside an outside one, positions 4 and 0 (both id 9),
    # and an ordinary row.
    kinds = torch.tensor([[6, 7], [0, 6], [4, 0], [1, 2]])
    received = kinds.repeat(n // len(kinds), 1)
    siblings = hot.ids[wire.from_wire(received)]
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(n // len(kinds), vocab, generator=g)
    logits[:, 9] += 2.0  # the file's first id is often the most probable, as FR-Spec's map expects
    p = torch.softmax(logits, -1).repeat_interleave(len(kinds), 0)  # four rows per context
    candidates = torch.cat([torch.zeros(n, 1, dtype=torch.int64), siblings], 1)  # root, two siblings
    next_token = torch.tensor([1, -1, -1]).expand(n, 3).contiguous()
    next_sibling = torch.tensor([-1, 2, -1]).expand(n, 3).contiguous()
    predicts = torch.full((3 * n,), -1, dtype=torch.int32)
    ops.tree_speculative_sampling_target_only(
        predicts, torch.full((n, 2), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), candidates,
        torch.arange(3 * n).view(n, 3), next_token, next_sibling, torch.rand(n, 3, generator=g),
        torch.rand(n, generator=g), p.unsqueeze(1).expand(n, 3, vocab).contiguous(), torch.zeros(n, 3, vocab),
    )  # fmt: skip
    committed = predicts[0::3].tolist()  # the root's next token
    in_map = torch.zeros(vocab, dtype=torch.bool)
    in_map[hot.ids] = True
    result = law.check_law(law.class_probs(p, in_map), law.classes_of(committed, p, in_map), 0.001)
    # The fault (the plugin before this check): each position read on its own, an outside one as
    # position 0 (id 9), so three row kinds of four draft 9 twice. With distinct siblings the
    # reference law is p itself.
    for r in range(len(kinds)):
        torch.testing.assert_close(_target_only_law(p[r], siblings[r].tolist()), p[r])
    read_as_0 = [
        [decode_file[i] if i < len(decode_file) else decode_file[0] for i in row] for row in received.tolist()
    ]
    wrong = torch.stack([_target_only_law(p[r], read_as_0[r]) for r in range(n)])
    power = law.power(result, law.class_probs(wrong, in_map))
    print(f"{result}; power against reading outside positions as position 0: {power}")
    assert power >= 0.99, power
    assert result.p_value > 0.001, str(result)


def test_the_law_checks_fault_model_is_what_the_verify_commits():
    """The server law check (tests/test_servers_plugin.py) takes its power against a wrong scatter
    from ``sampling_law.chain_rejection_law``: drafts from the hot q, the verify reading q rescaled
    to the target's mass on the map. SGLang's chain rejection sampling (the CPU site's op) commits
    that law, far from p (seeded chi-square over 12 tokens at 40 against it, above 1000 against p)."""
    from tests.harness.sampling_law import chain_rejection_law
    from tests.test_cpu_standin_sampling import ops

    g = torch.Generator().manual_seed(11)
    n, vocab = 20000, 12
    in_map = torch.zeros(vocab, dtype=torch.bool)
    in_map[[9, 2, 5, 0, 7, 3]] = True
    logits = torch.randn(vocab, generator=g) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits.masked_fill(~in_map, -torch.inf), -1)  # a draft that is p on the map
    q_seen = q * p[in_map].sum()  # the fault: rescaled to the target's mass on the map
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    predicts = torch.full((2 * n,), -1, dtype=torch.int32)
    candidates = torch.stack([torch.zeros(n, dtype=torch.int64), drafts], 1)
    retrive = torch.arange(2 * n).view(n, 2)
    ops.chain_speculative_sampling_triton(
        predicts, torch.full((n, 2), -1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), candidates,
        retrive, retrive, retrive, torch.rand(n, 2, generator=g), torch.rand(n, generator=g),
        p.expand(n, 2, vocab).contiguous(), q_seen.expand(n, 1, vocab).contiguous(), 1.0, 1.0, True,
    )  # fmt: skip
    committed = torch.bincount(predicts[0::2].long(), minlength=vocab).float()
    law = chain_rejection_law(p, q, q_seen)
    assert committed[law == 0].sum() == 0
    chi2 = float(((committed - n * law) ** 2 / (n * law))[law > 0].sum())
    assert chi2 < 40, (chi2, committed / n, law)
    assert float(((committed - n * p) ** 2 / (n * p)).sum()) > 1000
