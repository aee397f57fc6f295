"""The split of the draft's and the demo's text: held-out text never reaches training.

``sglang_frspec/demo/texts.py`` splits documents by their identity (path without versions) on the
shipped draft's sides;
``tools/draft_training/corpus.py`` gathers the draft's documents from every source (the standard
library, the language reference's topics, installed packages' code and docs) and splits them
together. The checks here read the texts the split hands out, with their own normalization.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from sglang_frspec.demo.texts import (
    Document,
    DraftSides,
    content_hash,
    document_identity,
    held_out,
    shipped_draft_sides,
    split_documents,
    stdlib_documents,
    stdlib_texts,
)

REPO = Path(__file__).resolve().parents[1]

MIN_CHARS = 30


def lines_of(texts: list[str]) -> set[str]:
    """Every line of ``texts`` with whitespace runs as one space, stripped (the test's own reading)."""
    return {re.sub(r"\s+", " ", line).strip() for text in texts for line in text.splitlines()}


def leaked(train: list[str], held: list[str]) -> set[str]:
    """Held-out lines of ``MIN_CHARS``+ characters that also are training lines."""
    return {line for line in lines_of(held) if len(line) >= MIN_CHARS} & lines_of(train)


def test_no_held_out_line_reaches_training_through_any_source():
    """The draft's whole corpus on this install: no held-out line of 30+ characters (normalized) nor
    run of 8 words in any training text of either domain, and both domains hold text out."""
    from tools.draft_training.corpus import gemma3_corpus

    domains, manifest, sides_record = gemma3_corpus()
    train = [t for texts, _ in domains.values() for t in texts]
    held = [t for _, texts in domains.values() for t in texts]
    assert all(held_texts for _, held_texts in domains.values())
    assert leaked(train, held) == set()
    sides = {f["side"] for f in manifest["files"]}
    assert sides == {"train", "held_out"} and len(manifest["files"]) == len(train) + len(held)
    names = [f["name"] for f in manifest["files"]]
    assert not [n for n in names if re.search(r"_vendor|vendored|sglang_frspec|/3rdparty/|/third_party/", n)]
    assert not shared_runs(train, held)
    assert not [n for n in names if re.match(r"licen[cs]e", n.rsplit("/", 1)[-1], re.IGNORECASE)]
    # the sides record a draft trained on this corpus would ship: none of its training documents,
    # as used here, would be held out by it
    recorded = DraftSides.from_record(sides_record)
    trained_docs = [Document(f["name"], f["domain"], "") for f in manifest["files"] if f["side"] == "train"]
    assert not [d.name for d in trained_docs if recorded.holds_out(d)]


def test_the_demo_split_keeps_nested_topics_apart():
    """The demo's texts (maps from training, prompts from held-out): no held-out line in training,
    though the topics nest (``if`` inside ``compound``, ``naming`` inside ``execmodel``)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    nested = [
        (inner, outer) for inner, outer in (("if", "compound"), ("naming", "execmodel")) if outer in topics
    ]
    assert any(leaked([topics[outer]], [topics[inner]]) for inner, outer in nested)  # they do share lines
    train_code, held_code, train_prose, held_prose = stdlib_texts()
    assert held_code and held_prose
    assert leaked(train_code + train_prose, held_code + held_prose) == set()


def shared_runs(train: list[str], held: list[str]) -> set[tuple[str, ...]]:
    """Runs of 8 words (the test's own reading: letters and digits) of held-out text in training text."""
    held_runs = set()
    for text in held:
        words = re.findall(r"\w+", text)
        held_runs |= {tuple(words[i : i + 8]) for i in range(len(words) - 7)}
    shared = set()
    for text in train:
        words = re.findall(r"\w+", text)
        shared |= {run for i in range(len(words) - 7) if (run := tuple(words[i : i + 8])) in held_runs}
    return shared


def name_on(side: bool, pattern: str) -> str:
    """The first ``pattern`` with a letter pair (digits are versions) whose identity is held out
    (``side``) or not."""
    pairs = (a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz")
    return next(n for n in map(pattern.format, pairs) if held_out(document_identity(n)) == side)


def text_on(side: bool, body: str) -> str:
    """``body`` with a first line chosen so its content hash is held out (``side``) or not: the
    side the former rule (by content) gave it."""
    return next(
        t for t in (f"# variant {i}\n{body}" for i in range(500)) if held_out(content_hash(t)) == side
    )


CODE = "".join(
    f"def f{i}(x):\n    if x:\n        return {i}\n    else:\n        return x + {i}\n" for i in range(40)
)
LICENSE = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
    "associated documentation files, to deal in the Software without restriction, including without "
    "limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and or sell "
    "copies of the Software, subject to the following conditions: the above copyright notice and this "
    "permission notice shall be included in all copies or substantial portions of the Software."
)


def test_a_copy_with_one_line_changed_stays_out_of_training():
    """A held-out module copied under another name with one line changed (and short lines only
    besides long ones in common): the copy is dropped from training, its changed line too."""
    original = text_on(True, CODE)
    copy = original.replace("return 7\n", "return 7  # changed in the copy\n")
    train, held = split_documents(
        [
            Document(name_on(True, "site-packages/a/mod{}.py"), "code", original),
            Document(name_on(False, "site-packages/b/copy{}.py"), "code", text_on(False, copy)),
        ]
    )
    assert [d.text for d in held] == [original]
    assert train == [] and not shared_runs([d.text for d in train], [original])


def test_a_rewrapped_license_stays_out_of_training():
    """A license paragraph held out in one package's description and rewrapped, as comments, in
    another's module: the paragraph leaves training, the module's own code stays."""
    held_text = text_on(True, "A package that does things.\n\n" + textwrap.fill(LICENSE, 72))
    own = "".join(
        f"def own_{i}(value):\n    return value * {i} + 1  # this module's own code\n" for i in range(12)
    )
    rewrapped = textwrap.indent(textwrap.fill(LICENSE, 50), "# ") + "\n" + own
    train, held = split_documents(
        [
            Document(name_on(True, "site-packages/a{}.dist-info/METADATA"), "prose", held_text),
            Document(name_on(False, "site-packages/b/m{}.py"), "code", text_on(False, rewrapped)),
        ]
    )
    assert [d.text for d in held] == [held_text]
    assert len(train) == 1 and own.strip() in train[0].text
    assert not shared_runs([d.text for d in train], [held_text])


def test_versions_of_a_file_stay_on_one_side():
    """Versioned copies (``rich/_unicode_data/unicode*-*.py``, a package's description in each
    version's ``dist-info``) share one identity and one side, though their texts differ."""
    for names in (
        [
            "site-packages/rich/_unicode_data/unicode15-1-0.py",
            "site-packages/rich/_unicode_data/unicode16-0-0.py",
        ],
        ["site-packages/Foo-1.2.dist-info/METADATA", "site-packages/foo-1.3.0.dist-info/METADATA"],
    ):
        assert len({document_identity(n) for n in names}) == 1
        texts = [
            text_on(side, f"table = {list(range(i * 50, i * 50 + 40))}\n")
            for i, side in ((1, True), (2, False))
        ]
        train, held = split_documents([Document(n, "code", t) for n, t in zip(names, texts)])
        assert len(train) + len(held) == 2 and min(len(train), len(held)) == 0


def test_side_is_the_identity_and_duplicates_are_kept_once():
    """A document's side follows its identity, not its text (another Python's build of a module
    stays on its side) nor its place in the list; an exact duplicate, up to whitespace, is kept
    once; a training document holding a held-out one keeps only what held-out text lacks."""
    docs = [
        Document(f"stdlib/m{chr(97 + i % 26)}{chr(97 + i // 26)}.py", "code", f"text {i}\n")
        for i in range(64)
    ]
    train, held = split_documents(docs)
    assert 0 < len(held) < len(docs) and len(train) + len(held) == len(docs)
    rebuilt = [Document(d.name, d.domain, d.text + "x = 1\n") for d in reversed(docs)]
    _, held2 = split_documents(rebuilt)
    assert {d.name for d in held2} == {d.name for d in held}
    inner_text = "a held-out line, long enough to count\nshort\n"
    outer_text = "a training line, long enough to count, with words of its own\nshort\n"
    inner, outer = name_on(True, "topics/inner{}"), name_on(False, "topics/outer{}")
    train3, held3 = split_documents(
        [
            Document(inner, "prose", inner_text),
            Document("topics/copy", "prose", "  ".join(inner_text.split(" "))),
            Document(outer, "prose", outer_text + inner_text),
        ]
    )
    assert [d.name for d in held3] == [inner]
    assert [d.text for d in train3] == [outer_text.rstrip()]  # inner's "short" with it (a run of 8 words)


def test_nothing_the_shipped_draft_trained_on_is_held_out_on_any_python():
    """The shipped draft's sides (``gemma3_draft/sides.json``) hold every identity its corpus's
    manifest trained on; a trained module with another Python's text (a line changed), or a
    trained text under a new module name, is not held out, though the bare rule holds it out."""
    import json

    sides = shipped_draft_sides()
    manifest = json.loads((REPO / "docs/results/gemma3-draft-r3-manifest.json").read_text())
    trained = {document_identity(f["name"]) for f in manifest["files"] if f["side"] == "train"}
    assert trained <= sides.trained and not sides.trained & sides.held_out
    docs = {d.name: d for d in stdlib_documents()}
    module = next(
        n for n in sorted(docs) if document_identity(n) in sides.trained and held_out(document_identity(n))
    )
    rebuilt = Document(module, "code", docs[module].text.replace("\n", "\n# built elsewhere\n", 1))
    renamed = Document(name_on(True, "stdlib/new_module{}.py"), "code", docs[module].text)
    for doc in (rebuilt, renamed):
        assert doc in split_documents([doc])[1]  # the rule alone would hold it out
        train, held = split_documents([doc], sides)
        assert not held and train == [doc]
    _, held_code, _, held_prose = stdlib_texts()
    held_here = [d for d in stdlib_documents() if d.text in held_code + held_prose]
    assert held_here and not {document_identity(d.name) for d in held_here} & sides.trained


def test_the_shipped_draft_records_its_weights():
    """``training.json`` beside the shipped draft records the sha256 of the weights shipped."""
    import hashlib
    import json

    folder = REPO / "sglang_frspec/demo/gemma3_draft"
    recorded = json.loads((folder / "training.json").read_text())["weights_sha256"]
    assert recorded == {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("model.safetensors", "config.json")
    }
