"""Token-map tooling: counting, ranking, inputs, rebuilds, inspect and plot, checked against
independent references on a locally trained byte-level BPE tokenizer and a generated corpus."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.pool
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_frspec.cli import main
from sglang_frspec.core import read_token_map, vocab_shard_ranges
from sglang_frspec.maps import (
    MapBuildError,
    TokenCounts,
    build_token_map,
    corpus_sources,
    count_tokens,
    read_documents,
    rebuild_token_map,
    resolve_tokens,
    top_token_ids,
)
from sglang_frspec.maps import counting as counting_module
from tests.harness.cli import cli

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|eot|>"]
PROSE = (
    "the of and to in is was for on that with as by at from it an be this are or have which one had not "
    "but all were when we there can more if no out so said what up its about into than them only other "
    "new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should"
)
WORDS = PROSE.split()


def make_lines(n: int = 400, seed: int = 0) -> list[str]:
    """Varied lines: Zipf-like prose, code, numbers, accented and CJK text, blank lines."""
    rng = random.Random(seed)
    zipf = [1 / (rank + 1) for rank in range(len(WORDS))]
    lines = []
    for i in range(n):
        kind = i % 5
        if i % 37 == 0:
            lines.append("")
        elif kind == 0:
            lines.append(" ".join(rng.choices(WORDS, weights=zipf, k=rng.randint(3, 30))).capitalize() + ".")
        elif kind == 1:
            lines.append(f"def f_{i}(x, y={rng.randint(0, 99)}):    return x * {rng.random():.4f} - y")
        elif kind == 2:
            lines.append(
                f"Order #{rng.randint(1000, 99999)}: {rng.choice(WORDS)} × {rng.randint(1, 9)} — café"
            )
        elif kind == 3:
            lines.append(f"東京 {rng.choice(WORDS)}!? naïve façade {rng.randint(0, 10**6)} (ok) [x]")
        else:
            lines.append(" ".join(rng.choices(WORDS, k=rng.randint(1, 12))))
    return lines


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer trained here (special tokens added after the merges, at the top
    ids, as in Llama-3), the corpus as one text file, and the raw ``tokenizers`` object."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bpe")
    lines = make_lines()
    texts = [line + "\n" for line in lines]  # a text file's documents keep their line breaks
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(texts, trainer)
    raw.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=SPECIALS[0], pad_token=SPECIALS[1]
    ).save_pretrained(root / "tok")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(texts), encoding="utf-8")

    class Bpe:
        pass

    bpe = Bpe()
    bpe.root, bpe.tokenizer, bpe.corpus, bpe.texts, bpe.raw = root, str(root / "tok"), str(corpus), texts, raw
    bpe.id_space = raw.get_vocab_size(with_added_tokens=True)
    bpe.eos, bpe.eot = raw.token_to_id(SPECIALS[0]), raw.token_to_id(SPECIALS[2])
    bpe.encodings = [raw.encode(text, add_special_tokens=False).ids for text in texts]
    bpe.reference = Counter(i for ids in bpe.encodings for i in ids)
    return bpe


def reference_counts(counter: Counter, id_space: int) -> list[int]:
    return [counter.get(i, 0) for i in range(id_space)]


def reference_ranking(counts: list[int], size: int, forced: set[int]) -> list[int]:
    """Forced ids plus the most frequent others (ties: smaller id), ordered by (-count, id)."""
    others = sorted((i for i in range(len(counts)) if i not in forced), key=lambda i: (-counts[i], i))
    kept = set(others[: size - len(forced)]) | forced
    return sorted(kept, key=lambda i: (-counts[i], i))


def test_bpe_fixture_is_realistic(bpe):
    """The fixture exercises what real vocabularies have: merges, specials at the top, newlines."""
    assert bpe.id_space > 500 and bpe.eos == bpe.id_space - 3 and bpe.eot == bpe.id_space - 1
    assert bpe.reference[bpe.raw.token_to_id("Ċ")] == len(bpe.texts)  # one newline token per line
    assert bpe.reference.get(bpe.eos, 0) == 0 and bpe.reference.get(bpe.eot, 0) == 0
    assert len(set(bpe.reference.values())) < len(bpe.reference)  # ties exist, so tie-breaking matters


def test_counts_equal_an_independent_count(bpe):
    counts = count_tokens(bpe.tokenizer, [bpe.corpus], progress=False)
    assert counts.counts.dtype == torch.int64 and counts.id_space == bpe.id_space
    assert counts.counts.tolist() == reference_counts(bpe.reference, bpe.id_space)
    assert counts.num_tokens == sum(map(len, bpe.encodings))
    assert counts.num_documents == len(bpe.texts)
    assert counts.eos_token_ids == (bpe.eos,)
    assert counts.tokenizer == os.path.abspath(bpe.tokenizer)


@pytest.mark.parametrize("size", [1, 2, 40, 300, "all"])
def test_built_map_is_the_reference_ranking(bpe, size):
    size = bpe.id_space if size == "all" else size
    include = [SPECIALS[2]] if size > 1 else []
    ids, counts = build_token_map(bpe.tokenizer, [bpe.corpus], size, include=include, progress=False)
    reference = reference_counts(bpe.reference, bpe.id_space)
    forced = {bpe.eos, *([bpe.eot] if include else [])}
    assert ids.tolist() == reference_ranking(reference, size, forced)
    assert ids.numel() == size and forced <= set(ids.tolist())


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    data=st.data(),
)
def test_ranking_ties_and_forced_ids(counts, data):
    """Many ties (counts 0..5), any forced subset, any size that can hold it."""
    forced = set(data.draw(st.lists(st.integers(0, len(counts) - 1), max_size=4)))
    size = data.draw(st.integers(max(1, len(forced)), len(counts)))
    got = top_token_ids(torch.tensor(counts, dtype=torch.int64), size, sorted(forced))
    assert got.dtype == torch.int64 and got.tolist() == reference_ranking(counts, size, forced)


def test_ranking_size_and_forced_errors():
    counts = torch.tensor([3, 2, 1, 0])
    for size in (0, 5):
        with pytest.raises(
            MapBuildError, match=f"map size {size}: must be between 1 and the tokenizer's 4 ids"
        ):
            top_token_ids(counts, size)
    with pytest.raises(MapBuildError, match=r"smaller than the 2 tokens it must include \(\[0, 3\]\)"):
        top_token_ids(counts, 1, [3, 0])
    with pytest.raises(MapBuildError, match=r"forced token ids \[4\]: outside"):
        top_token_ids(counts, 2, [4])


def test_cli_build_then_inspect(bpe, tmp_path):
    """The main path, as a user runs it: build (with --include), load, inspect with a model and TP."""
    map_path = tmp_path / "map.pt"
    out = cli(
        "build-map",
        "--tokenizer",
        bpe.tokenizer,
        "--corpus",
        bpe.corpus,
        "--size",
        "128",
        "-o",
        str(map_path),
        "--include",
        SPECIALS[2],
    )
    assert out.returncode == 0, out.stderr
    assert "counting tokens" in out.stderr  # the progress bar, on stderr
    ids = read_token_map(map_path)
    reference = reference_counts(bpe.reference, bpe.id_space)
    assert ids.tolist() == reference_ranking(reference, 128, {bpe.eos, bpe.eot})
    assert torch.load(map_path, weights_only=True).dtype == torch.int64  # SGLang's loader: torch.load
    coverage = sum(reference[i] for i in ids.tolist()) / sum(reference)
    assert f"covering {coverage:.2%} of the counted tokens" in out.stdout
    assert (tmp_path / "map.pt.counts.pt").is_file()

    model = tmp_path / "model"
    model.mkdir()
    vocab = bpe.id_space + 61  # padded like a real checkpoint's embedding
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
    report = cli("inspect", str(map_path), "--model-path", str(model), "--tp", "2", "--json")
    assert report.returncode == 0, report.stderr
    facts = json.loads(report.stdout)
    assert facts["num_ids"] == facts["num_unique"] == 128 and facts["num_duplicates"] == 0
    assert (facts["min_id"], facts["max_id"]) == (min(ids.tolist()), max(ids.tolist()))
    assert facts["vocab_size"] == vocab and facts["fits_vocab"] is True
    assert facts["counts"]["coverage"] == pytest.approx(coverage)
    best = sorted(reference, reverse=True)
    for size, value in facts["counts"]["best_coverage_by_size"].items():
        assert value == pytest.approx(sum(best[: int(size)]) / sum(reference))
    split = vocab_shard_ranges(vocab, 2)[1][0]
    low = sum(i < split for i in ids.tolist())
    local, balanced = facts["plans"]
    assert [r["columns"] for r in local["ranks"]] == [low, 128 - low]
    assert [r["columns"] for r in balanced["ranks"]] == [64, 64]

    table = cli("inspect", str(map_path), "--vocab-size", str(vocab), "--tp", "2")
    assert table.returncode == 0, table.stderr
    assert f"coverage   {coverage:.2%} of {sum(reference):,} counted tokens" in table.stdout
    assert f"{vocab:,}: every id fits" in table.stdout
    assert "layout local: 128 hot ids over 2 rank(s)" in table.stdout
    assert "layout balanced: 128 hot ids over 2 rank(s), width 64, max/mean 1.00" in table.stdout


def test_inspect_flags_foreign_ids_and_duplicates(tmp_path, capsys):
    torch.save([5, 5, 7, 700], tmp_path / "frspec_list.pt")  # FR-Spec's list format, an id >= vocab
    assert main(["inspect", str(tmp_path / "frspec_list.pt"), "--vocab-size", "600"]) == 1
    text = capsys.readouterr().out
    assert "4 (3 unique, 1 duplicates), range [5, 700]" in text
    assert "does NOT fit: ids outside [0, 600): [700]" in text
    assert "coverage" not in text  # no counts file beside this map


def test_api_is_deterministic_and_workers_agree(bpe, monkeypatch):
    # Small batches, so two workers really interleave many tasks and results must be reordered.
    monkeypatch.setattr(counting_module, "_BATCH_DOCUMENTS", 7)
    builds = [
        build_token_map(bpe.tokenizer, [bpe.corpus], 200, workers=workers, max_tokens=cap, progress=False)
        for workers, cap in ((1, None), (1, None), (2, None), (1, 3001), (2, 3001))
    ]
    (ids, counts), *others = builds
    for other_ids, other_counts in others[:2]:
        assert torch.equal(other_ids, ids) and torch.equal(other_counts.counts, counts.counts)
        assert other_counts.num_documents == counts.num_documents
    (capped_ids, capped), (capped_ids_2, capped_2) = others[2:]
    assert torch.equal(capped_ids, capped_ids_2) and torch.equal(capped.counts, capped_2.counts)
    assert capped.num_documents == capped_2.num_documents
    # The cap cuts the stream in corpus order, so two workers' results were put back in order.
    first_tokens = [i for ids in bpe.encodings for i in ids][:3001]
    assert capped_2.counts.tolist() == reference_counts(Counter(first_tokens), bpe.id_space)


def _slow_encode_in_worker(texts: list[str]):
    time.sleep(0.5)  # still encoding when the consumer stops
    return counting_module.encode_batch(counting_module._worker_tokenizer, texts)


def test_a_capped_count_shuts_its_workers_down_cleanly(bpe, monkeypatch):
    # The cap stops the consumer with tasks in flight. Terminating the pool then could kill a worker
    # inside its result write, leaving the result queue's lock held and the shutdown hung (a CI run
    # hung 900 s so): the workers must instead finish their tasks and exit on their own.
    pools = []

    class RecordedPool(multiprocessing.pool.Pool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(counting_module.multiprocessing, "Pool", RecordedPool)
    monkeypatch.setattr(counting_module, "_BATCH_DOCUMENTS", 7)
    # Pickled by reference: workers (forked after this patch) resolve the slow one.
    monkeypatch.setattr(counting_module, "_encode_in_worker", _slow_encode_in_worker)
    counts = count_tokens(bpe.tokenizer, [bpe.corpus], workers=2, max_tokens=10, progress=False)
    assert int(counts.counts.sum()) == 10  # the first batch was enough; three were still in flight
    (pool,) = pools
    assert [worker.exitcode for worker in pool._pool] == [0, 0]  # exited, not SIGTERM-ed (-15)


def test_max_tokens_counts_exactly_the_first_tokens(bpe):
    stream = [i for ids in bpe.encodings for i in ids]
    cap = 3001  # inside a document: the cut is exact, not at a document boundary
    assert not any(sum(map(len, bpe.encodings[:n])) == cap for n in range(len(bpe.encodings)))
    counts = count_tokens(bpe.tokenizer, [bpe.corpus], max_tokens=cap, progress=False)
    assert counts.num_tokens == cap
    assert counts.counts.tolist() == reference_counts(Counter(stream[:cap]), bpe.id_space)
    starts, position = [], 0
    for ids in bpe.encodings:
        starts.append(position)
        position += len(ids)
    assert counts.num_documents == sum(start < cap for start in starts)
    more = count_tokens(bpe.tokenizer, [bpe.corpus], max_tokens=10**9, progress=False)
    assert more.num_tokens == len(stream)


def test_text_jsonl_and_saved_datasets_agree(bpe, tmp_path):
    from datasets import Dataset, DatasetDict

    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(bpe.texts)))
    as_json = tmp_path / "corpus.json"  # .json files are JSON Lines too
    as_json.write_text(jsonl.read_text())
    Dataset.from_dict({"content": bpe.texts}).save_to_disk(str(tmp_path / "dataset"))
    half = len(bpe.texts) // 2
    DatasetDict(
        {
            "train": Dataset.from_dict({"content": bpe.texts[:half]}),
            "test": Dataset.from_dict({"content": bpe.texts[half:]}),
        }
    ).save_to_disk(str(tmp_path / "dataset_dict"))
    expected = reference_counts(bpe.reference, bpe.id_space)
    for source in ("corpus.jsonl", "corpus.json", "dataset", "dataset_dict"):
        counts = count_tokens(bpe.tokenizer, [tmp_path / source], text_field="content", progress=False)
        assert counts.counts.tolist() == expected, source
        assert counts.num_documents == len(bpe.texts), source
    assert list(read_documents([tmp_path / "dataset_dict"], "content")) == bpe.texts  # splits in saved order


def test_directories_are_walked_in_sorted_order(bpe, tmp_path):
    from datasets import Dataset

    root = tmp_path / "corpus"
    (root / "b_sub").mkdir(parents=True)
    (root / "a.txt").write_text("".join(bpe.texts[:100]))
    (root / "b_sub" / "c.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in bpe.texts[100:250])
    )
    (root / "notes.md").write_text("not a corpus file: skipped in directories\n")
    Dataset.from_dict({"text": bpe.texts[250:]}).save_to_disk(str(root / "d_saved"))
    assert [p.relative_to(root).as_posix() for p in corpus_sources([root])] == [
        "a.txt",
        "b_sub/c.jsonl",
        "d_saved",
    ]
    assert list(read_documents([root])) == bpe.texts
    counts = count_tokens(bpe.tokenizer, [root], progress=False)
    assert counts.counts.tolist() == reference_counts(bpe.reference, bpe.id_space)


def test_from_counts_rebuilds_without_tokenizing(bpe, tmp_path):
    first = tmp_path / "m200.pt"
    out = cli(
        "build-map", "--tokenizer", bpe.tokenizer, "--corpus", bpe.corpus, "--size", "200", "-o", str(first)
    )
    assert out.returncode == 0, out.stderr
    counts_file = tmp_path / "m200.pt.counts.pt"
    same = tmp_path / "again.pt"
    out = cli("build-map", "--from-counts", str(counts_file), "--size", "200", "-o", str(same))
    assert out.returncode == 0, out.stderr
    assert torch.equal(read_token_map(same), read_token_map(first))
    assert torch.equal(
        TokenCounts.load(tmp_path / "again.pt.counts.pt").counts, TokenCounts.load(counts_file).counts
    )

    # Another size, a token string resolved through the tokenizer the counts remember, an id.
    counts = TokenCounts.load(counts_file)
    smaller = rebuild_token_map(counts, 50, include=[SPECIALS[2], str(bpe.raw.token_to_id(SPECIALS[1]))])
    direct, _ = build_token_map(
        bpe.tokenizer, [bpe.corpus], 50, include=[SPECIALS[2], SPECIALS[1]], progress=False
    )
    assert torch.equal(smaller, direct)
    with pytest.raises(MapBuildError, match="a token string needs the tokenizer"):
        rebuild_token_map(dataclasses.replace(counts, tokenizer=None), 50, include=["x"])


@pytest.mark.parametrize("past", [-2, 64], ids=["tokens-added-past-the-vocab", "padded-vocab"])
def test_counts_of_a_models_outputs_rebuild_with_its_tokenizer(bpe, past):
    """Counts of a model's outputs span its vocab: a tokenizer may add tokens past it (Gemma 3's adds
    <image_soft_token> at 262144 to 262144-id text models; here <|pad|>, <|eot|> past a 601-id
    model) or a vocab may be padded past the tokenizer (Qwen2.5). Either rebuilds with strings."""
    vocab = bpe.id_space + past
    word = bpe.raw.id_to_token(300)
    served = {"verify_rows": 10, "accept_length": 2.0, "num_steps": 2, "topk": 1, "hot_ids": 64}
    for source in ({"server": {"url": "http://127.0.0.1:30000"}}, {"speculative": served}):
        counts = TokenCounts(torch.arange(vocab) % 7, 1, bpe.tokenizer, (bpe.eos,), ("p",), "text", **source)
        ids = rebuild_token_map(counts, 16, include=[word])
        assert ids.tolist() == reference_ranking(counts.counts.tolist(), 16, {bpe.eos, 300})
        if past < 0:
            with pytest.raises(MapBuildError, match=f"forced token ids \\[{bpe.eot}\\]: outside"):
                rebuild_token_map(counts, 16, include=[SPECIALS[2]])
    # Corpus counts are made with the tokenizer itself: another id space is another tokenizer.
    with pytest.raises(MapBuildError, match=f"has {bpe.id_space} ids, but the counts were made"):
        rebuild_token_map(dataclasses.replace(counts, speculative=None), 16, include=[word])


def test_generation_config_eos_ids_are_kept(bpe, tmp_path):
    """Chat models list several EOS ids in generation_config.json: all of them stay in the map."""
    import shutil

    tok = tmp_path / "chat"
    shutil.copytree(bpe.tokenizer, tok)
    (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": [bpe.eos, bpe.eot]}))
    ids, counts = build_token_map(str(tok), [bpe.corpus], 10, progress=False)
    assert counts.eos_token_ids == (bpe.eos, bpe.eot)
    assert {bpe.eos, bpe.eot} <= set(ids.tolist()) and ids.numel() == 10


def test_include_resolution(bpe):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bpe.tokenizer)
    the = bpe.raw.token_to_id("Ġthe")
    assert resolve_tokens(["Ġthe", str(the), the, SPECIALS[2]], bpe.id_space, tokenizer) == (
        the,
        the,
        the,
        bpe.eot,
    )
    with pytest.raises(MapBuildError, match="include token ' the': .* has no such token"):
        resolve_tokens([" the"], bpe.id_space, tokenizer)
    outside = rf"include token '99999': id outside the tokenizer's ids \[0, {bpe.id_space}\)"
    with pytest.raises(MapBuildError, match=outside):
        resolve_tokens(["99999"], bpe.id_space, tokenizer)


def test_plan_plot_writes_a_png(tmp_path):
    from matplotlib.image import imread

    ids = torch.cat([torch.arange(0, 3000), torch.arange(70000, 71000)])
    torch.save(ids, tmp_path / "map.pt")
    png = tmp_path / "balance.png"
    args = ["plan", "--token-map", str(tmp_path / "map.pt"), "--vocab-size", "128256", "--tp", "4"]
    out = cli(*args, "--json", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)) == 2  # stdout stays pure JSON
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(png).shape
    assert width >= 700 and height >= 500


def write_bad_inputs(tmp_path: Path) -> None:
    files = {
        "empty.txt": "",
        "empty_texts.jsonl": '{"text": ""}\n' * 3,
        "fields.jsonl": '{"text": "fine"}\n{"body": "no text field"}\n',
        "broken.jsonl": '{"text": "fine"}\n{"text": \n',
        "array.json": '["a", "b"]\n',
        "number.jsonl": '{"text": 42}\n',
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (tmp_path / "no_corpus_files").mkdir()
    (tmp_path / "no_corpus_files" / "x.md").write_text("skipped\n")
    (tmp_path / "not_a_tokenizer").mkdir()
    (tmp_path / "model_without_config").mkdir()
    torch.save(torch.arange(5), tmp_path / "map.pt")


BAD_BUILDS = {
    "missing tokenizer": (["--tokenizer", "/nonexistent/tok"], "'/nonexistent/tok': no such directory"),
    "unloadable tokenizer": (["--tokenizer", "@not_a_tokenizer"], "cannot be loaded with transformers"),
    "missing corpus": (["--corpus", "@missing.txt"], "missing.txt': no such file or directory"),
    "empty corpus": (["--corpus", "@empty.txt"], "holds no tokens (0 documents read)"),
    "empty texts": (["--corpus", "@empty_texts.jsonl"], "holds no tokens (3 documents read)"),
    "no corpus files": (["--corpus", "@no_corpus_files"], "holds no .txt, .jsonl, .json files"),
    "size 0": (["--size", "0"], "map size 0: must be between 1 and the tokenizer's"),
    "size over vocab": (["--size", "100000"], "map size 100000: must be between 1 and the tokenizer's"),
    "unknown include": (["--include", "nope"], "include token 'nope'"),
    "missing text field": (["--corpus", "@fields.jsonl"], "line 2: has no 'text' field (fields: 'body')"),
    "bad json": (["--corpus", "@broken.jsonl"], "line 2: is not valid JSON"),
    "json array": (["--corpus", "@array.json"], "line 1: holds a JSON list, not an object"),
    "text not a string": (["--corpus", "@number.jsonl"], "field 'text' holds a int, not a string"),
    "not utf-8": (["--corpus", "@latin1.txt"], "is not UTF-8 text"),
    "map as counts": (["--from-counts", "@map.pt"], "is not a counts file written by"),
    "workers with counts": (["--from-counts", "@map.pt", "--workers", "2"], "--workers: only apply"),
    "workers 0": (["--workers", "0"], "workers 0: must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUILDS))
def test_bad_build_inputs_are_clear_errors(bpe, tmp_path, capsys, case):
    write_bad_inputs(tmp_path)
    overrides, message = BAD_BUILDS[case]
    # "@name" stands for the file of that name in this test's folder.
    overrides = [str(tmp_path / arg[1:]) if arg.startswith("@") else arg for arg in overrides]
    args = {"--tokenizer": [bpe.tokenizer], "--corpus": [bpe.corpus], "--size": ["16"]}
    if "--from-counts" in overrides:
        del args["--tokenizer"], args["--corpus"]
    flags = [arg for flag, values in args.items() if flag not in overrides for arg in (flag, *values)]
    argv = ["build-map", *flags, *overrides, "-o", str(tmp_path / "out.pt"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sglang-frspec build-map: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.pt").exists()


def test_bad_inspect_inputs_are_clear_errors(tmp_path, capsys):
    write_bad_inputs(tmp_path)
    cases = [
        (["--tp", "2"], "--tp needs the target's vocab size"),
        (["--model-path", str(tmp_path / "model_without_config")], "cannot read its vocab size"),
        (["--counts", str(tmp_path / "none.pt")], "none.pt': no such file"),
    ]
    for extra, message in cases:
        assert main(["inspect", str(tmp_path / "map.pt"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sglang-frspec inspect: error: ") and message in err, err


def test_cli_errors_have_no_traceback(tmp_path):
    """The same errors from a real process: one line, exit status 2."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    tokenizer = tmp_path / "nope"
    out = cli("build-map", "--tokenizer", str(tokenizer), "--corpus", str(empty), "--size", "8", "-o", "m.pt")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    expected = f"tokenizer '{tokenizer}': no such directory. Pass the model's directory."
    assert out.stderr.strip() == f"sglang-frspec build-map: error: {expected}"
