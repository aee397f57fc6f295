"""Measure the shipped Gemma 3 draft on held-out text it never trained on (issue 53).

The shipped draft (``sglang_frspec/demo/gemma3_draft``, rounds 1 and 2) trained on the split that
came before ``sglang_frspec.demo.texts.split_documents``: the standard library's modules by position
in a sorted listing (index % 8 == 7 held out), the first half of the sorted topics, and installed
packages' files held out by a hash of their path, read in path-hash order up to 8M characters of
code and 4M of prose. ``old_training_documents`` rebuilds that training text on this install (no
manifest was saved; its counts are written beside the ones its ``training.json`` recorded). The
held-out sets here are every document of the clean corpus (``tools/draft_training/corpus.py``:
de-duplicated, no vendored copies, licenses or this project's description) that the old split
did not train on, with every line (30+ characters, normalized) of the old training text removed
from them. They are not the clean split's held-out sets: most of those were the old split's
training files (all but 8 of the prose documents), which the shipped draft was trained on. Writes
the scores with 95% intervals over documents to ``--out``, the sets' manifest beside it.

``--held-out-of MANIFEST`` keeps only the documents that a later run's manifest also held out, so
drafts of both splits are scored side by side on text neither trained on (``--draft``: each in
turn; the sets are drawn once per work folder, which defaults to one per set of manifests).

Run from the repository root: ``.venv/bin/python -m scripts.measure_shipped_gemma3_draft``
(resumes from ``--work``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pydoc_data.topics
import shutil
from pathlib import Path

import torch

from sglang_frspec.demo.fixtures import cache_root
from sglang_frspec.demo.gemma3 import gemma3_fixture
from sglang_frspec.demo.texts import (
    Document,
    long_lines,
    normalized_line,
    split_documents,
    stdlib_documents,
)
from tools.draft_training.corpus import (
    MAX_FILE_CHARS,
    PROSE_SUFFIXES,
    gemma3_documents,
    manifest,
    split_by_domain,
)
from tools.draft_training.model import LayerShape
from tools.draft_training.run import DraftRun, stderr_log, warm_start

REPO = Path(__file__).resolve().parents[1]

SHIPPED = REPO / "sglang_frspec" / "demo" / "gemma3_draft"
HOT = 32768
CHAIN_STEPS = 3
OLD_CODE_CHARS, OLD_PROSE_CHARS = 8_000_000, 4_000_000


def old_package_training(domain: str, suffixes: tuple[str, ...], chars: int) -> list[Document]:
    """The old split's training files of installed packages: path-hash order up to ``chars``
    characters (held-out files counted), a file held out when its path's hash is 7 mod 8."""
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    files = [p for p in root.glob("**/*") if p.suffix in suffixes or p.name in suffixes]
    hashes = {p: int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16) for p in files}
    files.sort(key=lambda p: f"{hashes[p]:064x}")
    train, total = [], 0
    for path in files:
        if total >= chars:
            break
        if path.stat().st_size > MAX_FILE_CHARS:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if hashes[path] % 8 != 7:
            train.append(Document(f"site-packages/{path.relative_to(root)}", domain, text))
        total += len(text)
    return train


def old_training_documents() -> list[Document]:
    """What the shipped draft's corpus trained on, rebuilt by the old rules on this install."""
    code = [d for d in stdlib_documents() if d.domain == "code"]
    topics = sorted(pydoc_data.topics.topics)
    first_half = topics[: len(topics) // 2]
    return (
        [d for i, d in enumerate(code) if i % 8 != 7]
        + [Document(f"topics/{k}", "prose", pydoc_data.topics.topics[k]) for k in first_half]
        + old_package_training("code", (".py",), OLD_CODE_CHARS)
        + old_package_training("prose", PROSE_SUFFIXES, OLD_PROSE_CHARS)
    )


def never_trained(docs: list[Document], old: list[Document]) -> list[Document]:
    """``docs`` the old split did not train on, less every line of its training text."""
    old_names = {d.name for d in old}
    old_lines = set().union(*(long_lines(d.text) for d in old))
    out = []
    for doc in docs:
        if doc.name in old_names:
            continue
        kept = "\n".join(line for line in doc.text.splitlines() if normalized_line(line) not in old_lines)
        if kept.strip():
            out.append(Document(doc.name, doc.domain, kept))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, help="shards (resumed); default: one folder per --held-out-of set")
    p.add_argument("--draft", type=Path, default=SHIPPED)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "gemma3-draft-never-trained.json")
    p.add_argument("--eval-seqs", type=int, default=192, help="held-out windows and continuations per domain")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--held-out-of",
        type=Path,
        action="append",
        default=[],
        help="a run's manifest.json: keep only the documents it held out too (repeatable)",
    )
    args = p.parse_args()
    later = [json.loads(path.read_text()) for path in args.held_out_of]
    recorded = json.loads((args.draft / "training.json").read_text())
    digest = recorded.get("manifest", {}).get("held_out_digest")
    if digest and digest not in {m["held_out_digest"] for m in later}:
        raise SystemExit(
            f"{args.draft} trained on a corpus that held out the set of digest {digest[:12]} (its "
            "training.json), not the old split these sets are drawn from: its held-out figures on them "
            "would score text it trained on. Pass --held-out-of the manifest of its training run "
            "(docs/results/gemma3-draft-r3-manifest.json for the shipped draft)."
        )
    if args.work is None:
        args.work = cache_root() / "-".join(["gemma3-draft-measure", *(m["held_out_digest"] for m in later)])
    torch.set_num_threads(args.threads)
    log = stderr_log()
    fixture = gemma3_fixture()
    target = Path(fixture.target)
    cfg = json.loads((target / "config.json").read_text())
    shape = LayerShape(cfg["hidden_size"], 4, 2, 128, 2048, rope_theta=10000.0, eps=cfg["rms_norm_eps"])
    run = DraftRun(args.work, target, Path(fixture.token_map(HOT)), shape, log=log)
    read = gemma3_documents()
    kept = {d.name for split in split_documents(read) for d in split}  # de-duplicated
    corpus = [d for d in read if d.name in kept]
    old = old_training_documents()
    never = measured = never_trained(corpus, old)
    for run_manifest in later:
        held = {f["name"] for f in run_manifest["files"] if f["side"] == "held_out"}
        measured = [d for d in measured if d.name in held]
    originals = {d.name: d.text for d in corpus}
    old_counts = {d: sum(doc.domain == d for doc in old) for d in ("code", "prose")}
    log(f"old training documents rebuilt: {old_counts}; measured {len(measured)} of {len(corpus)} documents")
    run.corpus(
        split_by_domain([], measured),
        seq=160,
        prompt=32,
        gen_seqs=0,
        text_seqs=0,
        eval_seqs=args.eval_seqs,
        manifest=manifest(measured, [], measured),
    )
    run.generate(batch=args.gen_batch)
    run.features(topk=16)
    report = run.score(warm_start(args.draft), CHAIN_STEPS)
    domains = recorded["data"]["domains"]
    manifest_copy = args.out.with_name(f"{args.out.stem}-manifest.json")
    shutil.copyfile(args.work / "manifest.json", manifest_copy)
    report["held_out_sets"] = {
        "rule": "the clean corpus's documents the old split did not train on, less its lines"
        + "".join(f", held out by the run of held-out digest {m['held_out_digest']}" for m in later),
        "old_split_training_documents_rebuilt": old_counts,
        "clean_corpus_documents_old_training": len(corpus) - len(never),
        "never_trained_documents_trained_on_by_later_runs": len(never) - len(measured),
        "characters_of_old_training_lines_removed": sum(
            len(originals[d.name]) - len(d.text) for d in measured
        ),
        "documents": {d: sum(doc.domain == d for doc in measured) for d in ("code", "prose")},
        "manifest": manifest_copy.name,
    }
    if not digest:  # a draft of the old split: its training.json recorded that split's counts
        report["held_out_sets"]["old_split_counts_recorded"] = {d: domains[d]["train_files"] for d in domains}
    report["draft"] = str(args.draft.relative_to(REPO) if args.draft.is_relative_to(REPO) else args.draft)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
