"""The text every CPython install carries, split the same way for every model built here.

Documents: the standard library's top-level modules (code) and the topics of ``pydoc_data.topics``
(the language reference's prose). ``split_documents`` decides each document's side by a hash of
its normalized content (each line's whitespace collapsed, blank lines dropped): 1 in
``HELD_OUT_EVERY`` is held out, the same document on the same side on every Python. Exact
duplicates are kept once, and every line of a training document whose normalized form (at least
``MIN_SHARED_CHARS`` characters) is also a held-out line is removed from it: topics nest (``if`` sits
whole inside ``compound``), and none of a held-out document's lines reaches training that way.
Training text builds the maps; held-out text gives the prompts.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

HELD_OUT_EVERY = 8  # a document is held out when its normalized content's sha256 is 7 mod 8
MIN_SHARED_CHARS = 30  # normalized lines this long never reach training from held-out text


@dataclass(frozen=True)
class Document:
    """One text of a corpus: ``name`` says where it came from (``stdlib/abc.py``, ``topics/if``)."""

    name: str
    domain: str
    text: str


def normalized_line(line: str) -> str:
    """A line with its whitespace runs collapsed to one space and stripped."""
    return " ".join(line.split())


def normalized(text: str) -> str:
    """The text's non-blank lines, each normalized: what the split hashes and de-duplicates by."""
    return "\n".join(n for n in map(normalized_line, text.splitlines()) if n)


def content_hash(text: str) -> str:
    """sha256 of the normalized text (hex)."""
    return hashlib.sha256(normalized(text).encode()).hexdigest()


def held_out(key: str) -> bool:
    """Whether the document of this content hash is held out: 1 in ``HELD_OUT_EVERY``."""
    return int(key, 16) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def long_lines(text: str) -> set[str]:
    """The text's normalized lines of at least ``MIN_SHARED_CHARS`` characters."""
    return {n for n in map(normalized_line, text.splitlines()) if len(n) >= MIN_SHARED_CHARS}


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents, in input order: exact duplicates (normalized) after the first
    dropped, the side by content hash, held-out long lines removed from every training document
    (one left without text is dropped)."""
    seen: set[str] = set()
    train: list[Document] = []
    held: list[Document] = []
    for doc in docs:
        key = content_hash(doc.text)
        if key in seen:
            continue
        seen.add(key)
        (held if held_out(key) else train).append(doc)
    held_lines = set().union(*(long_lines(d.text) for d in held))
    kept = []
    for doc in train:
        lines = [line for line in doc.text.splitlines() if normalized_line(line) not in held_lines]
        text = "\n".join(lines)
        if text.strip():
            kept.append(doc if len(lines) == len(doc.text.splitlines()) else replace(doc, text=text))
    return kept, held


def stdlib_documents() -> list[Document]:
    """The standard library's top-level modules (``code``) and the language reference's topics
    (``prose``), sorted by name."""
    import pydoc_data.topics

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    code = [Document(f"stdlib/{f.name}", "code", text) for f, text in zip(files, texts)]
    topics = pydoc_data.topics.topics
    return code + [Document(f"topics/{k}", "prose", topics[k]) for k in sorted(topics)]


def by_domain(docs: list[Document], domain: str) -> list[str]:
    """The texts of ``docs`` in ``domain``, in order."""
    return [d.text for d in docs if d.domain == domain]


def stdlib_texts() -> tuple[list[str], list[str], list[str], list[str]]:
    """(training code, held-out code, training prose, held-out prose) of ``stdlib_documents``,
    split by ``split_documents``, in a fixed order."""
    train, held = split_documents(stdlib_documents())
    code, held_code, prose, held_prose = (
        by_domain(docs, d) for d in ("code", "prose") for docs in (train, held)
    )
    return code, held_code, prose, held_prose


def text_digest(*groups: list[str]) -> str:
    """Short sha256 of groups of texts: part of a cached fixture's name (another Python's stdlib
    is another corpus)."""
    digest = hashlib.sha256()
    for group in groups:
        for text in group:
            digest.update(hashlib.sha256(text.encode()).digest())
        digest.update(b"|")
    return digest.hexdigest()[:12]
