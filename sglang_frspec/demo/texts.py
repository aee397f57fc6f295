"""The text every CPython install carries, split the same way for every model built here.

The standard library's top-level modules (code, in sorted file order; files with index % 8 == 7
are held out) and ``pydoc_data.topics`` (the language reference's prose; the topics sorted by name
are split in half: the first half is for training and maps, the second gives held-out prompts).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELD_OUT_EVERY = 8  # code file i is held out when i % 8 == 7


def stdlib_texts() -> tuple[list[str], list[str], list[str], list[str]]:
    """(training code, held-out code, prose for training and maps, held-out prose), in a fixed order."""
    import pydoc_data.topics

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    code = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    train = [t for i, t in enumerate(code) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [t for i, t in enumerate(code) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    topics = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    half = len(topics) // 2
    return train, held_out, topics[:half], topics[half:]


def text_digest(*groups: list[str]) -> str:
    """Short sha256 of groups of texts: part of a cached fixture's name (another Python's stdlib
    is another corpus)."""
    digest = hashlib.sha256()
    for group in groups:
        for text in group:
            digest.update(hashlib.sha256(text.encode()).digest())
        digest.update(b"|")
    return digest.hexdigest()[:12]
