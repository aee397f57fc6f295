"""The offline text a draft trains and is measured on, by domain, split by content, with a manifest.

Documents: the standard library's (``sglang_frspec.demo.texts.stdlib_documents``) and installed
packages' files (code: ``.py``; prose: ``.md``, ``.rst`` and package descriptions), read in the
order of a hash of their path up to a character budget. Not read: vendored copies, license texts
and this project's own package description (it embeds README.md's demo prompt and its greedy
continuation). All of them are split together by ``split_documents`` on the shipped draft's sides:
the side by the document's identity (its path without versions: the same on every Python and
package set), exact duplicates once, near-copies of held-out text dropped from training, and no
held-out line of 30+ characters or run of 8 words left in any training text, whatever its source.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import re
import sysconfig
from pathlib import Path

from sglang_frspec.demo.texts import (
    Document,
    by_domain,
    content_hash,
    document_identity,
    shipped_draft_sides,
    split_documents,
    stdlib_documents,
)

MAX_FILE_CHARS = 200_000  # longer package files are mostly generated tables
CODE_CHARS, PROSE_CHARS = 16_000_000, 4_000_000  # package text read per domain
PROSE_SUFFIXES = (".md", ".rst", "METADATA")
LICENSE = re.compile(r"^(licen[cs]e|copying|notice|authors)", re.IGNORECASE)
VENDORED = ("3rdparty", "third_party")  # folders of other projects' copies
OWN_PACKAGE = "sglang_frspec"  # this project's dist-info and editable finder


def unread_because(relative: Path) -> str | None:
    """Why a package file is not read (``vendored``, ``license``, ``this project``), or None."""
    if any("_vendor" in part or "vendored" in part or part in VENDORED for part in relative.parts):
        return "vendored"
    if LICENSE.match(relative.name) or "licenses" in relative.parts:
        return "license"
    if any(part.startswith((OWN_PACKAGE, f"__editable___{OWN_PACKAGE}")) for part in relative.parts):
        return "this project"
    return None


def package_documents(domain: str, suffixes: tuple[str, ...], chars: int) -> list[Document]:
    """Installed packages' files with these suffixes (or names), in the order of their path's hash,
    until about ``chars`` characters: the same files wherever the same versions are installed."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = [p for p in root.glob("**/*") if p.suffix in suffixes or p.name in suffixes]
    files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())
    docs: list[Document] = []
    total = 0
    for path in files:
        if total >= chars:
            break
        relative = path.relative_to(root)
        if path.stat().st_size > MAX_FILE_CHARS or unread_because(relative):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(Document(f"site-packages/{relative}", domain, text))
        total += len(text)
    return docs


def gemma3_documents(code_chars: int = CODE_CHARS, prose_chars: int = PROSE_CHARS) -> list[Document]:
    """Every document of the draft's corpus: the standard library's, then packages' code and prose."""
    return (
        stdlib_documents()
        + package_documents("code", (".py",), code_chars)
        + package_documents("prose", PROSE_SUFFIXES, prose_chars)
    )


def split_by_domain(train: list[Document], held: list[Document]) -> dict[str, tuple[list[str], list[str]]]:
    """``{domain: (training texts, held-out texts)}`` for ``DraftRun.corpus``."""
    domains = sorted({d.domain for d in train + held})
    return {name: (by_domain(train, name), by_domain(held, name)) for name in domains}


def manifest(read: list[Document], train: list[Document], held: list[Document]) -> dict:
    """What a corpus was made of: Python, installed distributions, and every document kept with
    its side and the content hash of its text as used (a training text after held-out lines left)."""
    files = [
        {"name": d.name, "domain": d.domain, "side": side}
        | {"sha256": content_hash(d.text), "chars": len(d.text)}
        for side, docs in (("train", train), ("held_out", held))
        for d in docs
    ]
    return {
        "python": platform.python_version(),
        "distributions": {
            d.metadata["Name"]: d.version
            for d in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower())
        },
        "documents_read": len(read),
        "dropped_duplicates_or_emptied": len(read) - len(train) - len(held),
        "files": files,
    }


def draft_sides_record(manifest: dict, read: list[Document], prefix: int = 16) -> dict:
    """A draft's ``sides.json`` (``sglang_frspec.demo.texts.DraftSides``) from its corpus manifest
    and the documents as read: the identities it trained on and held out, and content-hash
    prefixes of its training texts as used and as read (a later Python's copy of a trained
    module then stays out of held-out sets)."""
    train = [f for f in manifest["files"] if f["side"] == "train"]
    trained = {document_identity(f["name"]) for f in train}
    held = {document_identity(f["name"]) for f in manifest["files"] if f["side"] == "held_out"} - trained
    originals = {d.name: d.text for d in reversed(read)}  # the first copy read of each name
    hashes = {f["sha256"][:prefix] for f in train}
    hashes |= {content_hash(originals[f["name"]])[:prefix] for f in train if f["name"] in originals}
    return {
        "about": f"A draft's corpus (Python {manifest['python']}) by sglang_frspec.demo.texts."
        "document_identity: the identities it trained on and held out, and content_hash prefixes"
        " of its training texts as read and as used (tools/draft_training/corpus.py draft_sides_record).",
        "prefix": prefix,
        "trained": sorted(trained),
        "held_out": sorted(held),
        "trained_sha256_prefixes": sorted(hashes),
    }


def gemma3_corpus() -> tuple[dict[str, tuple[list[str], list[str]]], dict, dict]:
    """The draft's domains (training, held-out texts each), their manifest and its sides record."""
    read = gemma3_documents()
    train, held = split_documents(read, shipped_draft_sides())
    record = manifest(read, train, held)
    return split_by_domain(train, held), record, draft_sides_record(record, read)
