"""The split of the draft's and the demo's text: held-out text never reaches training.

``sglang_frspec/demo/texts.py`` splits documents by a hash of their normalized content;
``tools/draft_training/corpus.py`` gathers the draft's documents from every source (the standard
library, the language reference's topics, installed packages' code and docs) and splits them
together. The checks here read the texts the split hands out, with their own normalization.
"""

from __future__ import annotations

import re

from sglang_frspec.demo.texts import Document, content_hash, held_out, split_documents, stdlib_texts

MIN_CHARS = 30


def lines_of(texts: list[str]) -> set[str]:
    """Every line of ``texts`` with whitespace runs as one space, stripped (the test's own reading)."""
    return {re.sub(r"\s+", " ", line).strip() for text in texts for line in text.splitlines()}


def leaked(train: list[str], held: list[str]) -> set[str]:
    """Held-out lines of ``MIN_CHARS``+ characters that also are training lines."""
    return {line for line in lines_of(held) if len(line) >= MIN_CHARS} & lines_of(train)


def test_no_held_out_line_reaches_training_through_any_source():
    """The draft's whole corpus on this install: no held-out line of 30+ characters (normalized) in
    any training text of either domain, and both domains hold text out."""
    from tools.draft_training.corpus import gemma3_corpus

    domains, manifest = gemma3_corpus()
    train = [t for texts, _ in domains.values() for t in texts]
    held = [t for _, texts in domains.values() for t in texts]
    assert all(held_texts for _, held_texts in domains.values())
    assert leaked(train, held) == set()
    sides = {f["side"] for f in manifest["files"]}
    assert sides == {"train", "held_out"} and len(manifest["files"]) == len(train) + len(held)
    names = [f["name"] for f in manifest["files"]]
    assert not [n for n in names if "_vendor" in n or "vendored" in n or "sglang_frspec" in n]
    assert not [n for n in names if re.match(r"licen[cs]e", n.rsplit("/", 1)[-1], re.IGNORECASE)]


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


def test_side_is_the_contents_and_duplicates_are_kept_once():
    """A document's side follows its text, not its name or place (another Python lists other
    files around it); an exact duplicate, up to whitespace, is kept once; a training document
    that is a held-out one with a line added keeps only what held-out text lacks."""
    docs = [Document(f"d{i}", "code", f"text number {i}\n" + "x = 1\n" * i) for i in range(64)]
    train, held = split_documents(docs)
    assert 0 < len(held) < len(docs) and len(train) + len(held) == len(docs)
    moved = [Document(f"other/{d.name}", d.domain, d.text) for d in reversed(docs[5:])]
    train2, held2 = split_documents(moved)
    assert {d.text for d in held2} == {d.text for d in held if d in docs[5:]}
    inner, outer = (
        next(t for t in (f"{prefix} {i}, long enough to count\nshort\n" for i in range(200)) if side(t))
        for prefix, side in (
            ("a held-out line", lambda t: held_out(content_hash(t))),
            ("a training line", lambda t: not held_out(content_hash(t))),
        )
    )
    spaced = "  ".join(inner.split(" "))
    train3, held3 = split_documents(
        [
            Document("inner", "code", inner),
            Document("copy", "code", spaced),
            Document("outer", "code", outer + inner),
        ]
    )
    assert [d.name for d in held3] == ["inner"]
    assert [d.text for d in train3] == [outer + "short"]  # lines under 30 characters may repeat
