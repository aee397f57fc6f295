"""Corpus reading: documents streamed one at a time from text files, JSON Lines and saved datasets.

A corpus argument is a file or a directory:

- ``*.jsonl`` and ``*.json`` files are JSON Lines: one object per line, whose text field (default
  ``text``) is one document. Blank lines are skipped.
- any other file is plain text: each line is one document, its line break included, so the
  newline tokens a model emits are counted too.
- a directory written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) is
  read from its memory-mapped Arrow files, text field as above, splits in their saved order.
- any other directory is walked recursively in sorted order; it contributes its ``.txt``,
  ``.jsonl`` and ``.json`` files and the saved datasets under it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from sglang_frspec.maps.errors import MapBuildError

CORPUS_SUFFIXES = (".txt", ".jsonl", ".json")
JSON_LINES_SUFFIXES = (".jsonl", ".json")
_DATASET_ROWS_PER_READ = 1024


def is_saved_dataset(path: Path) -> bool:
    """True for a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def corpus_sources(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The files and saved-dataset directories a corpus is read from, in reading order."""
    sources: list[Path] = []
    for arg in paths:
        path = Path(arg)
        if not path.exists():
            raise MapBuildError(f"corpus {str(arg)!r}: no such file or directory.")
        if path.is_file() or is_saved_dataset(path):
            sources.append(path)
            continue
        found = _walk(path)
        if not found:
            raise MapBuildError(
                f"corpus directory {str(arg)!r}: holds no {', '.join(CORPUS_SUFFIXES)} files and no "
                "saved dataset. Name the files directly to read other text files."
            )
        sources.extend(found)
    return sources


def _walk(directory: Path) -> list[Path]:
    found: list[Path] = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir():
            # A saved dataset's own .json metadata files are not corpus text.
            found.extend([entry] if is_saved_dataset(entry) else _walk(entry))
        elif entry.suffix in CORPUS_SUFFIXES:
            found.append(entry)
    return found


def read_documents(paths: Sequence[str | os.PathLike], text_field: str = "text") -> Iterator[str]:
    """Stream the documents of a corpus (see the module docstring), one at a time.

    Paths are checked before the first document is read, so a missing path fails at once.
    """
    sources = corpus_sources(paths)

    def documents() -> Iterator[str]:
        for source in sources:
            if source.is_dir():
                yield from _dataset_documents(source, text_field)
            elif source.suffix in JSON_LINES_SUFFIXES:
                yield from _json_lines_documents(source, text_field)
            else:
                yield from _text_documents(source)

    return documents()


def _text_documents(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        try:
            yield from f
        except UnicodeDecodeError as e:
            raise MapBuildError(f"corpus file {str(path)!r}: is not UTF-8 text ({e.reason}).") from e


def _json_lines_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        try:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    yield _text_of_record(line, text_field, f"corpus file {str(path)!r} line {line_number}")
        except UnicodeDecodeError as e:
            raise MapBuildError(f"corpus file {str(path)!r}: is not UTF-8 text ({e.reason}).") from e


def _text_of_record(line: str, text_field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise MapBuildError(
            f"{where}: is not valid JSON ({e.msg}); .jsonl and .json corpus files must be JSON Lines "
            "(one object per line)."
        ) from e
    if not isinstance(record, dict):
        raise MapBuildError(
            f"{where}: holds a JSON {type(record).__name__}, not an object; .jsonl and .json corpus "
            "files must be JSON Lines (one object per line)."
        )
    if text_field not in record:
        raise MapBuildError(
            f"{where}: has no {text_field!r} field (fields: {', '.join(map(repr, record)) or 'none'}); "
            "choose the field with --text-field."
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise MapBuildError(f"{where}: field {text_field!r} holds a {type(text).__name__}, not a string.")
    return text


def _dataset_documents(path: Path, text_field: str) -> Iterator[str]:
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for damaged folders
        raise MapBuildError(
            f"corpus {str(path)!r}: looks like a saved dataset but datasets.load_from_disk failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
        ) from e
    splits = loaded.items() if isinstance(loaded, DatasetDict) else [(None, loaded)]
    for split, dataset in splits:
        where = f"dataset {str(path)!r}" + (f" split {split!r}" if split else "")
        if text_field not in dataset.column_names:
            raise MapBuildError(
                f"{where}: has no {text_field!r} column (columns: {', '.join(dataset.column_names)}); "
                "choose the column with --text-field."
            )
        batches = dataset.select_columns([text_field]).iter(batch_size=_DATASET_ROWS_PER_READ)
        for row, text in enumerate(text for batch in batches for text in batch[text_field]):
            if not isinstance(text, str):
                raise MapBuildError(
                    f"{where} row {row}: {text_field!r} holds a {type(text).__name__}, not a string."
                )
            yield text
