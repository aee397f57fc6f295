"""The text every CPython install carries, split the same way for every model built here.

Documents: the standard library's top-level modules (code) and the topics of ``pydoc_data.topics``
(the language reference's prose). ``split_documents`` decides each document's side by a hash of
its identity (``document_identity``: its module, topic or package path without versions), so a
module whose text differs between Python builds stays on its side: 1 in ``HELD_OUT_EVERY`` is held
out, but an identity the shipped draft's corpus listed (``shipped_draft_sides``) keeps that side,
and what it trained on (by identity or by content) is never held out. Exact duplicates
(normalized) are kept once. No held-out text reaches training: a training
document that is mostly held-out text (a copy with a line changed, a rewrapped license) is dropped,
and from the others every line that shares a run of ``SHINGLE_WORDS`` words with held-out text, or
is a held-out line of ``MIN_SHARED_CHARS``+ characters, is removed (topics nest: ``if`` sits whole
inside ``compound``). ``stdlib_texts`` keeps the line rule only (``near_copies``). Training text
builds the maps; held-out text gives the prompts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

HELD_OUT_EVERY = 8  # a document is held out when its identity's sha256 is 7 mod 8
MIN_SHARED_CHARS = 30  # normalized lines this long never reach training from held-out text
SHINGLE_WORDS = 8  # a run of this many words shared with held-out text does not reach training
NEAR_COPY_SHARE = 0.5  # a training document with this share of its words in held-out runs is dropped
WORD = re.compile(r"\w+")
VERSION = re.compile(r"\d+(?:[._-]\d+)*")
HEX_ID = re.compile(r"(?=[0-9a-f]*\d)[0-9a-f]{8,}")  # content hashes in generated file names
SHIPPED_SIDES = Path(__file__).with_name("gemma3_draft") / "sides.json"


@dataclass(frozen=True)
class Document:
    """One text of a corpus: ``name`` says where it came from (``stdlib/abc.py``, ``topics/if``)."""

    name: str
    domain: str
    text: str


@dataclass(frozen=True)
class DraftSides:
    """A trained draft's corpus by identity (the sides it used) and the content hashes (hex
    prefixes) of what it trained on: what ``split_documents`` keeps on the same sides."""

    trained: frozenset[str] = frozenset()
    held_out: frozenset[str] = frozenset()
    hashes: frozenset[str] = frozenset()
    prefix: int = 16

    @classmethod
    def from_record(cls, record: dict) -> DraftSides:
        """From a ``sides.json`` record (``tools/draft_training/corpus.py`` draft_sides_record)."""
        keys = ("trained", "held_out", "trained_sha256_prefixes")
        return cls(*(frozenset(record[k]) for k in keys), record["prefix"])

    def holds_out(self, doc: Document) -> bool:
        """Never what the draft trained on (its identity or its content); then the draft's side
        of the identity; a new identity by ``held_out``."""
        identity = document_identity(doc.name)
        if identity in self.trained or content_hash(doc.text)[: self.prefix] in self.hashes:
            return False
        return identity in self.held_out or held_out(identity)


def document_identity(name: str) -> str:
    """The name without versions: a ``*.dist-info`` folder's version dropped, digit runs (``15-1-0``,
    ``3.11``) and hex ids as ``#`` (``rich/_unicode_data/unicode15-1-0.py``: ``unicode#.py``)."""
    parts = name.split("/")
    parts = [
        p.split("-", 1)[0].lower() + p[p.rfind(".") :] if p.endswith((".dist-info", ".egg-info")) else p
        for p in parts
    ]
    return VERSION.sub("#", HEX_ID.sub("#", "/".join(parts)))


def normalized_line(line: str) -> str:
    """A line with its whitespace runs collapsed to one space and stripped."""
    return " ".join(line.split())


def normalized(text: str) -> str:
    """The text's non-blank lines, each normalized: what de-duplication compares."""
    return "\n".join(n for n in map(normalized_line, text.splitlines()) if n)


def content_hash(text: str) -> str:
    """sha256 of the normalized text (hex)."""
    return hashlib.sha256(normalized(text).encode()).hexdigest()


def held_out(identity: str) -> bool:
    """Whether the document of this identity is held out: 1 in ``HELD_OUT_EVERY``."""
    return int(hashlib.sha256(identity.encode()).hexdigest(), 16) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def long_lines(text: str) -> set[str]:
    """The text's normalized lines of at least ``MIN_SHARED_CHARS`` characters."""
    return {n for n in map(normalized_line, text.splitlines()) if len(n) >= MIN_SHARED_CHARS}


def shingles(words: list[str]) -> list[int]:
    """Hashes of every run of ``SHINGLE_WORDS`` consecutive words (within one process)."""
    return [hash(tuple(words[i : i + SHINGLE_WORDS])) for i in range(len(words) - SHINGLE_WORDS + 1)]


def _without_held_out_text(text: str, held_lines: set[str], held_runs: set[int]) -> str | None:
    """``text`` less its lines holding held-out text (until none is left: removing lines joins
    words), or None when at least ``NEAR_COPY_SHARE`` of its words are held-out runs'."""
    lines = text.splitlines()
    first = True
    while True:
        words = [(w, i) for i, line in enumerate(lines) for w in WORD.findall(line)]
        covered: set[int] = set()
        for start, key in enumerate(shingles([w for w, _ in words])):
            if key in held_runs:
                covered.update(range(start, start + SHINGLE_WORDS))
        if first and words and len(covered) >= NEAR_COPY_SHARE * len(words):
            return None
        first = False
        drop = {words[k][1] for k in covered}
        drop |= {i for i, line in enumerate(lines) if normalized_line(line) in held_lines}
        if not drop:
            return "\n".join(lines)
        lines = [line for i, line in enumerate(lines) if i not in drop]


def split_documents(
    docs: list[Document], sides: DraftSides = DraftSides(), near_copies: bool = True
) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents, in input order: exact duplicates (normalized) after the first
    dropped, the side by identity (``sides.holds_out``), held-out text removed
    from training (a document left without text, or mostly held-out text, is dropped). Without
    ``near_copies`` only held-out lines are removed (no runs of words, no near-copies dropped)."""
    seen: set[str] = set()
    train: list[Document] = []
    held: list[Document] = []
    for doc in docs:
        key = content_hash(doc.text)
        if key in seen:
            continue
        seen.add(key)
        (held if sides.holds_out(doc) else train).append(doc)
    held_lines = set().union(*(long_lines(d.text) for d in held))
    held_runs = {key for d in held for key in shingles(WORD.findall(d.text))} if near_copies else set()
    kept = []
    for doc in train:
        text = _without_held_out_text(doc.text, held_lines, held_runs)
        if text is not None and text.strip():
            kept.append(doc if text == "\n".join(doc.text.splitlines()) else replace(doc, text=text))
    return kept, held


@functools.cache
def shipped_draft_sides() -> DraftSides:
    """The shipped Gemma 3 draft's sides (``gemma3_draft/sides.json``)."""
    return DraftSides.from_record(json.loads(SHIPPED_SIDES.read_text()))


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


@functools.cache
def stdlib_texts() -> tuple[list[str], list[str], list[str], list[str]]:
    """(training code, held-out code, training prose, held-out prose) of ``stdlib_documents``,
    split by ``split_documents`` on the shipped draft's sides, in a fixed order."""
    # Held-out lines only, no near-copy rule: these texts build the demo's maps and the trained test
    # fixture, whose tiny target lost 0.19 nats and its accept lengths' dependence on map size when
    # 0.6% of its training text went by that rule; the shipped draft trained on none of the
    # held-out documents (its sides), and its own corpus applies the rule (draft_training/corpus.py).
    train, held = split_documents(stdlib_documents(), shipped_draft_sides(), near_copies=False)
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
