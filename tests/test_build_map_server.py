"""``build-map --from-server``: maps counted from what real CPU SGLang servers generate.

The permutation fixture's target decodes greedily x -> pi(x) and its tokenizer reads "w{i}" as id
i, so for the prompt "w{chain[s]} w{chain[s+1]}" the server must generate chain[s+2:s+2+n]: the
expected counts come from ``perm.chain``, never from the server.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_frspec.cli import main
from sglang_frspec.core import read_token_map
from sglang_frspec.demo.server import free_port
from sglang_frspec.maps import MapBuildError, TokenCounts, rebuild_token_map
from tests.conftest import fixture_server
from tests.test_maps import cli, reference_counts, reference_ranking

MAX_NEW_TOKENS = 6
EOS = 2  # the fixture's </s> (tokenizer and generation_config.json)
# Overlapping chain windows, so some ids are generated more often than others.
STARTS = [0, 3, 6, 50, 100]


def chain_prompt(perm, start: int) -> str:
    return f"w{perm.chain[start]} w{perm.chain[start + 1]}"


def expected_counts(perm, starts, count_prompts: bool = False) -> list[int]:
    """Counts of the ids the fixture's greedy target must generate (and read) for these prompts."""
    counter: Counter = Counter()
    for s in starts:
        counter.update(perm.chain[s + 2 : s + 2 + MAX_NEW_TOKENS])
        if count_prompts:
            counter.update(perm.chain[s : s + 2])
    return reference_counts(counter, perm.vocab_size)


def write_prompts(path: Path, perm, starts) -> Path:
    path.write_text("".join(chain_prompt(perm, s) + "\n" for s in starts))
    return path


def build_map(*args: str) -> list[str]:
    """``build-map`` with the test's generation length and no progress bar, as argv."""
    return ["build-map", *args, "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress"]


@pytest.fixture(scope="module")
def plain_server(perm, tmp_path_factory):
    """One plain (no speculative decoding) TP=1 server with --enable-metrics for the tests below
    (each counts only the requests it sends)."""
    log = tmp_path_factory.mktemp("plain-server") / "server.log"
    with fixture_server(perm, 1, log, eagle=False, extra=("--enable-metrics",)) as server:
        yield server


def generate_requests(server) -> int:
    """How many POST /generate requests the server has received (its --enable-metrics counter)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    found = re.search(
        r'^sglang:http_requests_total\{endpoint="/generate",method="POST"\} (\S+)$', metrics, re.M
    )
    return int(float(found.group(1))) if found else 0


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.server
def test_counts_and_map_are_the_targets_outputs(perm, plain_server, tmp_path, capsys):
    server = plain_server
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": s, "prompt": chain_prompt(perm, s)}) + "\n" for s in STARTS))
    map_path = tmp_path / "map.pt"
    argv = build_map("--from-server", server.url, "--prompts", str(prompts), "--text-field", "prompt")
    status, out, err = run_cli(capsys, [*argv, "--size", "16", "-o", str(map_path)])
    assert status == 0, err
    expected = expected_counts(perm, STARTS)
    counts = TokenCounts.load(f"{map_path}.counts.pt")
    assert counts.counts.tolist() == expected
    assert counts.num_documents == len(STARTS) and counts.server["done"].all()
    # EOS came from the server's own tokenizer (its path is a directory here).
    assert counts.eos_token_ids == (EOS,) and counts.tokenizer == perm.target
    assert counts.corpus == (str(prompts),) and counts.server["url"] == server.url
    assert read_token_map(map_path).tolist() == reference_ranking(expected, 16, {EOS})
    assert f"{sum(expected)} generated tokens for {len(STARTS)} prompts from {server.url}" in out

    # The counts file is an ordinary one: inspect and --from-counts read it unchanged.
    status, out, err = run_cli(capsys, ["inspect", str(map_path), "--vocab-size", str(perm.vocab_size)])
    assert status == 0, err
    assert f"of {sum(expected)} counted tokens in {len(STARTS)} documents" in out
    smaller = tmp_path / "map8.pt"
    counts_file = f"{map_path}.counts.pt"
    status, _, err = run_cli(
        capsys, ["build-map", "--from-counts", counts_file, "--size", "8", "-o", str(smaller)]
    )
    assert status == 0, err
    assert read_token_map(smaller).tolist() == reference_ranking(expected, 8, {EOS})

    # A tokenizer may add tokens past the model's vocab (Gemma 3's adds <image_soft_token> at 262144
    # to its 262144-id text models): it still gives the EOS ids. The finished count only re-ranks.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(perm.target)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert len(tokenizer) == perm.vocab_size + 1
    argv = build_map("--from-server", server.url, "--prompts", str(prompts), "--text-field", "prompt")
    argv += ["--tokenizer", str(tmp_path / "tokenizer"), "--save-counts", counts_file, "--size", "8"]
    status, _, err = run_cli(capsys, [*argv, "-o", str(smaller)])
    assert status == 0, err
    assert f"resuming: {len(STARTS)} of {len(STARTS)} prompts already counted" in err
    assert read_token_map(smaller).tolist() == reference_ranking(expected, 8, {EOS})

    # Prompt ids too, from a text file (one prompt per line; the blank line is no prompt).
    text = tmp_path / "prompts.txt"
    lines = [chain_prompt(perm, s) for s in STARTS]
    text.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    with_prompts = tmp_path / "with_prompts.pt"
    argv = build_map("--from-server", server.url, "--prompts", str(text), "--count-prompts")
    status, out, err = run_cli(capsys, [*argv, "--size", "16", "-o", str(with_prompts)])
    assert status == 0, err
    assert TokenCounts.load(f"{with_prompts}.counts.pt").counts.tolist() == expected_counts(
        perm, STARTS, count_prompts=True
    )

    # A --vocab-size that is not the served model's, and a URL that is not the server's base.
    argv = build_map("--from-server", server.url, "--prompts", str(text), "--size", "8")
    status, _, err = run_cli(capsys, [*argv, "--vocab-size", "32001", "-o", str(tmp_path / "x.pt")])
    assert status == 2
    assert f"--vocab-size 32001: the server's model '{perm.target}' has vocab_size {perm.vocab_size}" in err
    argv = build_map("--from-server", server.url + "/v1", "--prompts", str(text), "--size", "8")
    status, _, err = run_cli(capsys, [*argv, "-o", str(tmp_path / "x.pt")])
    assert status == 2
    assert "GET /model_info answered HTTP 404" in err and "no path after HOST:PORT" in err
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.pt.counts.pt").exists()


@pytest.mark.server
def test_a_server_whose_model_is_elsewhere_needs_the_vocab_size(perm, start_server, tmp_path, capsys):
    """As with a remote server: its model path is no directory here (the link is gone once loaded)."""
    link = tmp_path / "remote-model"
    link.symlink_to(perm.target)
    server = start_server(SimpleNamespace(target=str(link)), 1, eagle=False)
    link.unlink()
    prompts = write_prompts(tmp_path / "prompts.txt", perm, STARTS[:2])
    map_path = tmp_path / "map.pt"
    argv = build_map(
        "--from-server", server.url, "--prompts", str(prompts), "--size", "8", "-o", str(map_path)
    )

    status, _, err = run_cli(capsys, argv)
    assert status == 2
    assert f"serves '{link}', which is not a directory on this machine" in err and "Pass --vocab-size" in err

    # Too small an id space: the first answer already holds ids outside it.
    status, _, err = run_cli(capsys, [*argv, "--vocab-size", "1000", "--concurrency", "1"])
    assert status == 2
    outside = sorted({i for i in perm.chain[2 : 2 + MAX_NEW_TOKENS] if i >= 1000})
    assert f"generated token ids {outside} for prompt 1, outside the id space [0, 1000)" in err
    assert not map_path.exists() and not Path(f"{map_path}.counts.pt").exists()

    status, _, err = run_cli(capsys, [*argv, "--vocab-size", str(perm.vocab_size)])
    assert status == 0, err
    assert "warning: no tokenizer" in err
    counts = TokenCounts.load(f"{map_path}.counts.pt")
    expected = expected_counts(perm, STARTS[:2])
    assert counts.counts.tolist() == expected and counts.eos_token_ids == () and counts.tokenizer is None
    assert read_token_map(map_path).tolist() == reference_ranking(expected, 8, set())

    # The same count with a tokenizer: nothing is sent again, EOS is now kept.
    status, _, err = run_cli(
        capsys, [*argv, "--vocab-size", str(perm.vocab_size), "--tokenizer", perm.target]
    )
    assert status == 0, err
    assert "resuming: 2 of 2 prompts already counted" in err
    assert TokenCounts.load(f"{map_path}.counts.pt").eos_token_ids == (EOS,)
    assert read_token_map(map_path).tolist() == reference_ranking(expected, 8, {EOS})


@pytest.mark.server
def test_resume_sends_only_the_prompts_not_counted(perm, plain_server, tmp_path, capsys):
    server = plain_server
    prompts = write_prompts(tmp_path / "prompts.txt", perm, STARTS[:3])
    map_path, counts_file = tmp_path / "map.pt", tmp_path / "map.pt.counts.pt"
    argv = build_map(
        "--from-server", server.url, "--prompts", str(prompts), "--size", "8", "-o", str(map_path)
    )

    sent = generate_requests(server)
    status, _, err = run_cli(capsys, argv)
    assert status == 0, err
    assert generate_requests(server) - sent == 3
    assert TokenCounts.load(counts_file).counts.tolist() == expected_counts(perm, STARTS[:3])

    # Two prompts appended: only they are sent, and the counts are those of one full run.
    write_prompts(prompts, perm, STARTS)
    sent = generate_requests(server)
    status, _, err = run_cli(capsys, argv)
    assert status == 0, err
    assert "resuming: 3 of 5 prompts already counted" in err
    assert generate_requests(server) - sent == 2
    resumed = TokenCounts.load(counts_file)
    full_map = tmp_path / "full.pt"
    status, _, err = run_cli(capsys, [*argv, "-o", str(full_map)])
    assert status == 0, err
    full = TokenCounts.load(f"{full_map}.counts.pt")
    assert torch.equal(resumed.counts, full.counts)
    assert resumed.counts.tolist() == expected_counts(perm, STARTS) and resumed.num_documents == 5
    assert torch.equal(read_token_map(map_path), read_token_map(full_map))

    # A counts file of another count is refused, before any prompt is sent.
    sent = generate_requests(server)
    other = write_prompts(tmp_path / "other.txt", perm, STARTS)
    refusals = [
        (["--prompts", str(other)], f"another prompts '{prompts}' (now '{other}')"),
        (["--max-new-tokens", "5"], "another sampling_params {'max_new_tokens': 6, 'temperature': 0.0}"),
        (["--count-prompts"], "another count_prompts False (now True)"),
    ]
    for extra, message in refusals:
        status, _, err = run_cli(capsys, [*argv, *extra])
        assert status == 2 and message in err and "pass another --save-counts file" in err, err
    prompts.write_text(prompts.read_text().replace("w", "w1", 1))  # the first prompt edited
    status, _, err = run_cli(capsys, argv)
    assert status == 2 and "its first 5 prompts are not those counted" in err, err
    corpus_counts = dataclasses.replace(full, server=None)
    corpus_counts.save(counts_file)
    status, _, err = run_cli(capsys, argv)
    assert status == 2 and "holds counts of a corpus" in err, err
    assert generate_requests(server) == sent


@pytest.mark.server
def test_ctrl_c_saves_the_counts_and_the_rerun_resumes(perm, plain_server, tmp_path, capsys):
    server = plain_server
    starts = list(range(0, 100, 10))
    prompts = write_prompts(tmp_path / "prompts.txt", perm, starts)
    map_path, counts_file = tmp_path / "map.pt", tmp_path / "map.pt.counts.pt"
    argv = build_map(
        "--from-server", server.url, "--prompts", str(prompts), "--size", "8", "-o", str(map_path)
    )
    # No periodic save (--save-every > prompts): a counts file can only come from the Ctrl-C.
    sent = generate_requests(server)
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_frspec", *argv, "--concurrency", "1", "--save-every", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        # One request in flight at a time: the second one arrives after the first answer did.
        while generate_requests(server) < sent + 2:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        server.suspend()  # no more answers: the interrupt lands mid-run
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        server.resume()
    assert process.returncode == 130, err
    saved = TokenCounts.load(counts_file)
    counted = saved.num_documents
    assert 1 <= counted < len(starts)
    assert f"interrupted: {counted} of {len(starts)} prompts counted, saved to {counts_file}" in err
    done = [s for s, flag in zip(starts, saved.server["done"].tolist(), strict=True) if flag]
    assert saved.counts.tolist() == expected_counts(perm, done)

    status, _, err = run_cli(capsys, argv)
    assert status == 0, err
    assert f"resuming: {counted} of {len(starts)} prompts already counted" in err
    assert TokenCounts.load(counts_file).counts.tolist() == expected_counts(perm, starts)


def test_unreachable_server_and_bad_options_are_clear_errors(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6\n")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    base = ["--prompts", str(prompts), "--size", "8", "-o", str(tmp_path / "m.pt"), "--no-progress"]
    cases = [
        (["--from-server", url], f"server {url}: cannot be reached ("),
        (["--from-server", "127.0.0.1:30000"], "server URL '127.0.0.1:30000': must be http://HOST:PORT"),
        (["--from-server", url, "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--from-server", url, "--concurrency", "0"], "--concurrency 0: must be at least 1"),
        (["--from-server", url, "--prompts", str(tmp_path / "none.txt")], "none.txt': no such file"),
        (["--from-server", url, "--workers", "2"], "--workers: only apply to counting a --corpus."),
        (["--corpus", str(prompts), "--tokenizer", "t"], "--prompts: only apply to counting a --from-server"),
    ]
    for extra, message in cases:
        assert main(["build-map", *base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sglang-frspec build-map: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert main(["build-map", "--from-server", url, "--size", "8", "-o", "m.pt"]) == 2
    assert "--from-server needs --prompts" in capsys.readouterr().err
    # The same error from a real process: one line, no traceback.
    out = cli("build-map", "--from-server", url, *base)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "cannot be reached" in out.stderr


def test_server_counts_of_a_padded_vocab_rebuild_with_its_tokenizer(perm, tmp_path):
    """A server's counts span the model's vocab, which may be padded past the tokenizer's ids."""
    padded = perm.vocab_size + 64
    counts = TokenCounts(
        counts=torch.arange(padded, dtype=torch.int64) % 7,
        num_documents=1,
        tokenizer=None,
        eos_token_ids=(),
        corpus=(str(tmp_path / "prompts.txt"),),
        text_field="text",
        server={"url": "http://127.0.0.1:30000"},
    )
    ids = rebuild_token_map(counts, 16, include=["w9"], tokenizer_path=perm.target)
    reference = reference_ranking(counts.counts.tolist(), 16, {EOS, 9})
    assert ids.tolist() == reference
    # Corpus counts are made with the tokenizer itself: another id space is another tokenizer.
    with pytest.raises(MapBuildError, match=f"has {perm.vocab_size} ids, but the counts were made"):
        rebuild_token_map(dataclasses.replace(counts, server=None), 16, tokenizer_path=perm.target)
