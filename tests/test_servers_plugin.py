"""Real TP servers with EAGLE + token map + this plugin, on the permutation fixture."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_frspec.demo.cpu import cpu_env
from sglang_frspec.demo.server import plugin_activity
from tests.harness import sampling_law as law
from tests.harness.fixtures import random_fixture, sharp_draft_fixture
from tests.harness.gpu_defaults.overlap import DECODE_LINE, first_relayed_topk_index, relayed_ranks
from tests.harness.releases import cpu_verify_samples, draft_pick_op
from tools.serving.greedy import compare_greedy

pytestmark = pytest.mark.server
NEW = 24
# A PD decode node on SGLang's fake transfer backend: requests carry no prefill node's data. The
# retraction backup SGLang infers for a decode node's KV pool, host_pool (mem_cache/
# kv_cache_builder.py:228), registers its buffer as CUDA host memory; per-request CPU tensors
# instead (no retraction happens here).
FAKE_PD_DECODE = ("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                  "--disaggregation-decode-retraction-backup", "cpu_tensor")  # fmt: skip
# FAKE_BOOTSTRAP_HOST (disaggregation/utils.py): a request SGLang's decode node fakes the transfer
# of. Without a host, the fake backend's own requests fail in ``_bootstrap_addr`` (decode.py:155).
FAKE_BOOTSTRAP = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 7}


def assert_plugin_active(server, num_hot: int, tp: int, layout: str = "balanced", exchange: str = "full"):
    """The plugin installed its hot head on this server: one line from rank 0, with these settings."""
    assert plugin_activity(server.log()) == [(num_hot, tp, layout, exchange)]


def assert_decoded_under_overlap(server, tp: int) -> None:
    """Every rank decoded with the overlap scheduler, as on a GPU: its draft inputs were read back
    from SGLang's future map (the test servers' default, ``tests/harness/gpu_defaults/overlap.py``)."""
    assert relayed_ranks(server.log()) == set(range(tp))


def rank_threads(log: str) -> dict[int, tuple[int, list[int]]]:
    """Each TP rank's torch threads and cores, as the CPU site's binding read them back."""
    lines = re.findall(r"TP(\d+)\] frspec-cpu: rank threads (\d+) on cores \[([\d, ]*)\]", log)
    return {int(r): (int(n), [int(c) for c in cores.split(", ")]) for r, n, cores in lines}


def num_hot(token_map: str) -> int:
    """Distinct ids in a map file (a tensor or FR-Spec's Python list)."""
    return len(set(torch.as_tensor(torch.load(token_map)).tolist()))


def generate_chains(server, chain, starts=(0, 17, 33)) -> list[float]:
    """Greedy batch from several points of a pi chain; asserts the outputs, returns accept lengths."""
    outs = server.generate([list(chain[s : s + 3]) for s in starts], NEW)
    for s, out in zip(starts, outs):
        assert out["output_ids"] == list(chain[s + 3 : s + 3 + NEW])
    return [out["meta_info"]["spec_accept_length"] for out in outs]


@pytest.mark.parametrize(
    ("map_name", "chain", "layout", "exchange"),
    [
        ("hot", "chain", "local", "full"),  # crashes stock in init_lm_head
        ("hot", "chain", "balanced", "full"),
        ("hot_low", "low_chain", "local", "full"),  # crashes stock at the first request
        ("hot_low", "low_chain", "balanced", "topk"),
        ("hot_list", "chain", "local", "topk"),  # FR-Spec's own format: a list, EOS repeated
    ],
)
@pytest.mark.every_release
def test_tp2_token_map_follows_pi_with_full_acceptance(perm, start_server, map_name, chain, layout, exchange):
    env = {"SGLANG_FRSPEC_LAYOUT": layout, "SGLANG_FRSPEC_EXCHANGE": exchange}
    server = start_server(perm, 2, perm.token_map(map_name), env=env)
    assert generate_chains(server, getattr(perm, chain)) == [3.0, 3.0, 3.0]  # as at TP=1
    assert_plugin_active(server, num_hot(perm.token_map(map_name)), 2, layout, exchange)
    assert_decoded_under_overlap(server, 2)
    if map_name == "hot_list":
        assert "repeats 1 id(s)" in server.log()  # one warning for FR-Spec's repeated EOS


def test_topk_exchange_falls_back_to_full_when_topk_is_not_below_h(perm, start_server, tmp_path):
    """--speculative-eagle-topk 2 with a 2-id map: the top-k packet cannot apply; one warning."""
    token_map = tmp_path / "two_ids.pt"
    torch.save(torch.tensor(perm.chain[4:6]), token_map)
    server = start_server(perm, 2, str(token_map), env={"SGLANG_FRSPEC_EXCHANGE": "topk"})
    out = server.generate(list(perm.chain[:3]), 4)
    assert len(out["output_ids"]) == 4
    assert_plugin_active(server, 2, 2, "balanced", "full")
    warning = "exchange=topk needs 0 < --speculative-eagle-topk < 2 hot ids (topk is 2); using exchange=full."
    assert server.log().count(warning) == 1


def run_chain_pair(server, chain) -> list[tuple]:
    """(output ids, accept length, verify steps) of greedy runs from two points of a pi chain."""
    outs = server.generate([list(chain[s : s + 3]) for s in (0, 40)], NEW)
    return [
        (o["output_ids"], o["meta_info"]["spec_accept_length"], o["meta_info"]["spec_verify_ct"])
        for o in outs
    ]


# Partial acceptance against stock TP=1 (same tokens and accept lengths, both exchanges, TP=2) runs on
# a real distribution in tests/test_trained.py::test_tp2_plugin_matches_stock_tp1_on_a_real_distribution.
def test_plugin_matches_stock_tp1(perm, start_server):
    """At TP=1 with a map covering the chain: the plugin's tokens, accept lengths and verify steps
    are stock SGLang's, and every draft is accepted."""
    token_map = perm.token_map("hot")
    stock = start_server(perm, 1, token_map, plugin=False)
    expected = run_chain_pair(stock, perm.chain)
    assert plugin_activity(stock.log()) == []
    stock.stop()
    server = start_server(perm, 1, token_map)
    assert_plugin_active(server, num_hot(token_map), 1)
    assert run_chain_pair(server, perm.chain) == expected
    assert [ids for ids, _, _ in expected] == [list(perm.chain[s + 3 : s + 3 + NEW]) for s in (0, 40)]
    assert [a for _, a, _ in expected] == [3.0, 3.0]


def test_tp2_random_weights_match_plain_decoding(start_server):
    """Random weights (no structure to lean on): EAGLE + map at TP=2 decodes as plain greedy,
    up to near-ties of the target's top-2 logits (see tools.serving.greedy)."""
    fixture = random_fixture()
    prompts = [[5, 77, 1203], [31000, 17], [9, 9, 9, 9, 12000]]
    plain = start_server(fixture, 2, eagle=False)
    # Each rank on its own core with one thread, as SGLang binds ranks where its AMX kernels exist
    # (not here): unbound, both ranks ran torch's default threads (all cores) over the same cores.
    cores = [int(c) for c in cpu_env(2)["SGLANG_CPU_OMP_THREADS_BIND"].split("|")]  # one core a rank
    assert rank_threads(plain.log()) == {rank: (1, [core]) for rank, core in enumerate(cores)}
    expected = [o["output_ids"] for o in plain.generate(prompts, NEW)]
    plain.stop()
    server = start_server(fixture, 2, fixture.token_map("hot"))
    assert_plugin_active(server, num_hot(fixture.token_map("hot")), 2)
    got = [o["output_ids"] for o in server.generate(prompts, NEW)]
    assert_decoded_under_overlap(server, 2)
    compare_greedy(fixture.target, prompts, got, expected)


def test_tp2_plugin_without_map_is_unchanged(perm, start_server):
    server = start_server(perm, 2)
    assert generate_chains(server, perm.chain) == [3.0, 3.0, 3.0]
    assert "sglang-frspec:" not in server.log()


TOPK1 = ("--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
SEEDED = ("--random-seed", "36")  # the verify's coins and the draft's proposals: torch's RNG


RENORMS = {"top_k_renorm_prob", "top_p_renorm_prob"}


def sampled_ops(server, chain, shim_log) -> set[str]:
    """Temperature 1.0 requests from several points of a chain, then one with top-p and top-k:
    each completes; returns the CPU site's sampling ops that ran (its ``SGL_SHIM_LOG``)."""
    outs = server.generate(
        [list(chain[s : s + 3]) for s in (0, 17, 33)], NEW, temperature=1.0, ignore_eos=True
    )
    outs.append(
        server.generate(list(chain[50:53]), NEW, temperature=1.0, top_p=0.8, top_k=4, ignore_eos=True)
    )
    assert [len(o["output_ids"]) for o in outs] == [NEW] * 4
    return {
        line.split(".", 1)[1]
        for line in shim_log.read_text().splitlines()
        if line.startswith("CALLED sampling.")
    }


# The law check: per sampling configuration, LAW_REQUESTS requests of one prompt, 3 tokens each
# (2 decided by the verify), all in one batch; X^2 over 4 classes at level LAW_ALPHA.
LAW_CONFIGS = (law.Sampling(), law.Sampling(top_p=0.8), law.Sampling(top_k=2000))
LAW_REQUESTS, LAW_ALPHA, LAW_MIN_POWER = 150, 1e-3, 0.99


def check_sampling_law(server, fixture, rejection: bool) -> None:
    """The tokens the verify commits follow the target's law computed by an HF forward (see
    ``tests.harness.sampling_law``), at temperature 1.0, with top-p and with top-k; the map misses
    39% of the target's mass (its most probable token too, after a first token outside the map).
    Before the verdict: the check's simulated power against each scatter fault of
    ``sampling_law.fault_laws`` at these contexts is at least LAW_MIN_POWER."""
    prompt = list(fixture.chain[:3])
    configs = [c for c in LAW_CONFIGS for _ in range(LAW_REQUESTS)]
    params = [c.params() | {"max_new_tokens": 3, "ignore_eos": True} for c in configs]
    outs = server.post("/generate", {"input_ids": [prompt] * len(configs), "sampling_params": params})
    in_map = torch.zeros(fixture.vocab_size, dtype=torch.bool)
    in_map[torch.load(fixture.token_map("hot"))] = True
    failures = []
    for i, sampling in enumerate(LAW_CONFIGS):
        outputs = [o["output_ids"] for o in outs[i * LAW_REQUESTS : (i + 1) * LAW_REQUESTS]]
        assert {len(o) for o in outputs} == {3}
        contexts, tokens = law.decided_tokens([prompt] * LAW_REQUESTS, outputs)
        logits = law.target_logits(fixture.target, contexts)
        laws = law.target_laws(logits, sampling)
        probs = law.class_probs(laws, in_map)
        result = law.check_law(probs, law.classes_of(tokens, laws, in_map), LAW_ALPHA)
        powers = {
            fault: law.power(result, law.class_probs(wrong, in_map))
            for fault, wrong in law.fault_laws(logits, sampling, in_map, rejection).items()
        }
        print(f"{sampling}: {result}; power {powers}")
        assert min(powers.values()) >= LAW_MIN_POWER, (sampling, powers)
        if result.p_value < LAW_ALPHA:
            failures.append(f"{sampling}: {result}")
    assert not failures, failures


def test_tp2_topk1_with_a_map(perm, start_server, tmp_path):
    """--speculative-eagle-topk 1: the draft takes an argmax over the hot logits (SGLang's fast
    path that writes draft tokens directly is off with a map) and the top-k packet carries k=1.
    Temperature 1.0 requests take SGLang's target-only sampling verify (the CPU site routes it),
    and the tokens it commits follow the target's law."""
    sharp = sharp_draft_fixture(perm)
    env = {"SGLANG_FRSPEC_EXCHANGE": "topk", "SGL_SHIM_LOG": str(tmp_path / "shim.log")}
    server = start_server(sharp, 2, sharp.token_map("hot"), env=env, extra=(*TOPK1, *SEEDED))
    assert generate_chains(server, sharp.chain) == [3.0, 3.0, 3.0]  # 2 steps, every draft accepted
    assert_plugin_active(server, num_hot(sharp.token_map("hot")), 2, "balanced", "topk")
    assert_decoded_under_overlap(server, 2)
    assert (
        sampled_ops(server, sharp.chain, tmp_path / "shim.log")
        == {"tree_speculative_sampling_target_only"} | RENORMS
    )
    check_sampling_law(server, sharp, rejection=False)


@pytest.mark.every_release
@pytest.mark.skipif(
    not cpu_verify_samples(),
    reason="this SGLang's verify commits argmax on a CPU whatever the sampling "
    "(tests/harness/releases.py); tests/test_hot_probs.py checks the law on the verify op itself",
)
def test_tp2_rejection_sampling_with_a_map(perm, start_server, tmp_path):
    """--speculative-use-rejection-sampling with a map (refused by stock): exchange=topk falls back
    to full (rejection sampling needs the draft's whole distribution), temperature 1.0 requests
    complete through SGLang's rejection-sampling verify and the tokens it commits follow the
    target's law (the draft's hot probabilities laid over the vocab right), and greedy still
    follows the chain."""
    sharp = sharp_draft_fixture(perm)
    env = {"SGLANG_FRSPEC_EXCHANGE": "topk", "SGL_SHIM_LOG": str(tmp_path / "shim.log")}
    extra = ("--speculative-use-rejection-sampling", *TOPK1, *SEEDED)
    server = start_server(sharp, 2, sharp.token_map("hot"), env=env, extra=extra)
    assert (
        sampled_ops(server, sharp.chain, tmp_path / "shim.log")
        == {"chain_speculative_sampling_triton"} | draft_pick_op() | RENORMS
    )
    check_sampling_law(server, sharp, rejection=True)
    # Greedy: plain greedy's chain (accept lengths may fall below 3.0: under rejection sampling
    # stock's draft extend after prefill samples its first proposal at T=1 for greedy rows too).
    generate_chains(server, sharp.chain)
    assert_plugin_active(server, num_hot(sharp.token_map("hot")), 2, "balanced", "full")
    assert_decoded_under_overlap(server, 2)
    warning = "exchange=topk cannot give rejection sampling the draft's whole hot distribution"
    assert server.log().count(warning) == 1


def test_tp2_pd_decode_node_drafts_under_sglangs_decode_loop(perm, start_server, tmp_path):
    """A plugin PD decode node (TP=2, a map, overlap on) runs SGLang's decode loop
    (``event_loop_overlap_disagg_decode``) on the fake transfer backend, which skips the prefill and
    the KV transfer and commits a metadata row of zeros: file position 0 for every first draft.
    With the map's ids in reverse order in its file, the first draft step reads them as the plugin's
    PD hook translates them (the file's first id, then its next distinct one: the last canonical
    indices, not the raw zeros), and the request completes with speculative verifies."""
    file_ids = torch.as_tensor(torch.load(perm.token_map("hot"))).flip(0)
    token_map = str(tmp_path / "reversed.pt")
    torch.save(file_ids, token_map)
    server = start_server(perm, 2, token_map, extra=FAKE_PD_DECODE)
    body = {"input_ids": list(perm.chain[:3]), "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    out = server.post("/generate", body | FAKE_BOOTSTRAP)
    assert len(out["output_ids"]) == 8 and out["meta_info"]["spec_verify_ct"] > 0, out
    assert_plugin_active(server, num_hot(token_map), 2)
    log = server.log()
    assert log.count(DECODE_LINE + "on") == 2  # both ranks' decode loop: the overlap one
    assert "'disaggregation_mode': 'decode'" in log
    file_order = list(dict.fromkeys(file_ids.tolist()))
    hot = sorted(file_order)
    translated = [[hot.index(file_order[0]), hot.index(file_order[1])]]
    assert first_relayed_topk_index(log) == {0: translated, 1: translated}


def test_tp2_chunked_prefill_and_retracted_requests(perm, start_server):
    """A prompt prefilled in chunks (the draft extends after its last chunk) and requests that the
    full KV pool retracts and prefills again (their draft extends a second time), at TP=2 with a
    map: outputs follow the chain and every draft is accepted."""
    server = start_server(perm, 2, perm.token_map("hot"),
                          extra=("--chunked-prefill-size", "32", "--max-total-tokens", "320"))  # fmt: skip
    long_start, long_len, new = 100, 90, 40
    starts = (0, 17, 33, 49, 200, 230, 260, 290)
    prompts = [list(perm.chain[long_start : long_start + long_len])] + [
        list(perm.chain[s : s + 3]) for s in starts
    ]
    outs = server.generate(prompts, new)
    assert outs[0]["output_ids"] == list(perm.chain[long_start + long_len : long_start + long_len + new])
    for s, out in zip(starts, outs[1:]):
        assert out["output_ids"] == list(perm.chain[s + 3 : s + 3 + new])
    chunks = re.findall(r"Prefill batch, #new-seq: \d+, #new-token: 32,", server.log())
    assert len(chunks) >= 2  # the long prompt's full 32-token chunks
    assert sum(out["meta_info"]["num_retractions"] for out in outs) > 0, server.log()[-3000:]
    assert "KV cache pool is full. Retract requests." in server.log()
    # After its first token (made by the prefill) each verify step commits 2 drafts and a bonus.
    assert [out["meta_info"]["spec_verify_ct"] for out in outs] == [-(-(new - 1) // 3)] * len(outs)


def _expected_accept_length(new_tokens: int, drafts_accepted: bool) -> float:
    """Accept length of one greedy request on the permutation fixture, from first principles.

    The prefill gives the first token; each verify step then gives steps + 1 = 3 tokens when
    every draft is right (a chain in the hot set), or 1 when none is (a cold chain: the drafts
    are hot ids, the target's next token is cold). SGLang reports completion tokens / verify steps.
    """
    per_step = 3 if drafts_accepted else 1
    return new_tokens / -(-(new_tokens - 1) // per_step)


def test_32_concurrent_mixed_requests_match_plain_decoding(perm, start_server):
    """Per request at TP=2: plain greedy's tokens, and the accept length of the first-principles
    count. Batches differ between runs (32 concurrent requests), but on this fixture every greedy
    and draft choice has a margin of several logits, far above any batch-shape rounding, so each
    request's drafts, hence its accept length, depend on that request alone."""
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(32):
        if i % 3 == 2:  # random tokens: the chain then runs through cold ids the map lacks
            prompts.append(torch.randint(3, perm.vocab_size, (5 + i,), generator=gen).tolist())
        else:
            start = (i * 13) % 200
            prompts.append(list(perm.chain[start : start + 3 + i]))
    new_tokens = [8 + (i * 7) % 41 for i in range(32)]
    hot = set(torch.load(perm.token_map("hot")).tolist())

    def run_all(server) -> tuple[list, list]:
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(server.generate, p, n) for p, n in zip(prompts, new_tokens)]
            outs = [f.result() for f in futures]
        return [o["output_ids"] for o in outs], [o["meta_info"].get("spec_accept_length") for o in outs]

    plain = start_server(perm, 2, eagle=False)
    expected, _ = run_all(plain)
    plain.stop()
    assert [len(e) for e in expected] == new_tokens  # nothing dropped or cut short
    server = start_server(perm, 2, perm.token_map("hot"))
    outputs, accept = run_all(server)
    assert outputs == expected
    # The fixture's chains stay in (or out of) the hot set, so the prompt's last token decides.
    assert accept == [_expected_accept_length(n, p[-1] in hot) for p, n in zip(prompts, new_tokens)]
    assert {p[-1] in hot for p in prompts} == {True, False}  # both kinds of request are present
