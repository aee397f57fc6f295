"""Token counting over a corpus: streaming, multi-process, capped, saved for rebuilding maps."""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import torch

from sglang_frspec.maps.corpus import read_documents
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.tokenizer import eos_token_ids, load_tokenizer, token_id_space

COUNTS_FORMAT = "sglang-frspec token counts v1"
# Text per tokenization task: large enough to amortise the inter-process hand-over, small enough
# that the batches in flight (at most 2 per worker) stay a few MB.
_BATCH_CHARS = 1 << 18
_BATCH_DOCUMENTS = 1024


@dataclass(frozen=True)
class TokenCounts:
    """How often each token id occurs in a corpus, and where the counts came from."""

    counts: torch.Tensor  # int64 [id space of the tokenizer]
    num_documents: int
    tokenizer: str | None  # the path it was loaded from (absolute when local)
    eos_token_ids: tuple[int, ...]
    corpus: tuple[str, ...]
    text_field: str
    # Set for counts of a server's outputs (build-map --from-server): the server, the generation
    # settings and which prompts are counted; see maps.server_counts.
    server: dict | None = None
    # Set for counts of a serving EAGLE worker (SGLANG_FRSPEC_COUNTS): per id, how many of the
    # counted tokens were accepted draft tokens (the rest are bonus tokens), and the speculative
    # settings they were served with (verify_rows, accept_length, num_steps, topk, hot_ids).
    accepted: torch.Tensor | None = None
    speculative: dict | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def id_space(self) -> int:
        return int(self.counts.numel())

    def coverage(self, ids: torch.Tensor) -> float:
        """Fraction of the counted tokens whose id is in ``ids`` (duplicates and foreign ids ignored)."""
        hot = torch.unique(ids.to(torch.int64))
        hot = hot[(hot >= 0) & (hot < self.id_space)]
        return int(self.counts[hot].sum()) / self.num_tokens

    def best_coverage(self, sizes: Iterable[int]) -> dict[int, float]:
        """Coverage of the ``n`` most frequent ids, for each ``n`` in sizes (the most any n-id map covers)."""
        cumulative = torch.sort(self.counts, descending=True).values.cumsum(0)
        return {n: int(cumulative[min(n, self.id_space) - 1]) / self.num_tokens for n in sizes}

    def save(self, path: str | os.PathLike) -> None:
        torch.save(
            {
                "format": COUNTS_FORMAT,
                "counts": self.counts,
                "num_documents": self.num_documents,
                "tokenizer": self.tokenizer,
                "eos_token_ids": list(self.eos_token_ids),
                "corpus": list(self.corpus),
                "text_field": self.text_field,
                "server": self.server,
                "accepted": self.accepted,
                "speculative": self.speculative,
            },
            path,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenCounts:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise MapBuildError(f"counts file {path!r}: no such file.")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for unreadable files
            raise MapBuildError(
                f"counts file {path!r}: cannot be read with torch.load ({type(e).__name__})."
            ) from e
        if not isinstance(saved, dict) or saved.get("format") != COUNTS_FORMAT:
            raise MapBuildError(
                f"counts file {path!r}: is not a counts file written by `sglang-frspec build-map` "
                "(--save-counts)."
            )
        return cls(
            counts=saved["counts"],
            num_documents=saved["num_documents"],
            tokenizer=saved["tokenizer"],
            eos_token_ids=tuple(saved["eos_token_ids"]),
            corpus=tuple(saved["corpus"]),
            text_field=saved["text_field"],
            # Absent from counts saved before they existed:
            server=saved.get("server"),
            accepted=saved.get("accepted"),
            speculative=saved.get("speculative"),
        )


def encode_batch(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of texts (no special tokens added), concatenated, and the number of ids per text."""
    encoded = tokenizer(
        texts,
        add_special_tokens=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,  # long documents are fine here: no model sees them
    )["input_ids"]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    return ids, lengths


_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    # The workers already fill the cores; Rust threads inside each would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_batch(_worker_tokenizer, texts)


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for document in documents:
        batch.append(document)
        chars += len(document)
        if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCUMENTS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded_batches(
    batches: Iterator[list[str]], tokenizer, tokenizer_path: str, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded batches in corpus order; with workers > 1, at most 2 per worker are in flight."""
    if workers == 1:
        for batch in batches:
            yield encode_batch(tokenizer, batch)
        return
    # Pool.imap would read the whole corpus ahead into its task queue: submit a bounded window.
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def count_tokens(
    tokenizer_path: str,
    corpus: Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    workers: int = 1,
    max_tokens: int | None = None,
    progress: bool = True,
    tokenizer=None,
) -> TokenCounts:
    """Count every token id the tokenizer produces over the corpus (see ``maps.corpus`` for inputs).

    Memory stays bounded whatever the corpus size: documents are streamed and only the count
    array (one int64 per id) is kept. ``max_tokens`` stops after exactly that many tokens, in
    corpus order; the result does not depend on ``workers``. ``tokenizer`` is the one already
    loaded from ``tokenizer_path``, if any (worker processes load their own from the path).
    """
    from tqdm import tqdm

    if workers < 1:
        raise MapBuildError(f"workers {workers}: must be at least 1.")
    if max_tokens is not None and max_tokens < 1:
        raise MapBuildError(f"max tokens {max_tokens}: must be at least 1.")
    documents = read_documents(corpus, text_field)
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_path)
    counts = np.zeros(token_id_space(tokenizer), dtype=np.int64)
    num_tokens = num_documents = 0
    encoded = _encoded_batches(_batches(documents), tokenizer, tokenizer_path, workers)
    with (
        closing(encoded),
        tqdm(
            total=max_tokens, unit="tok", unit_scale=True, desc="counting tokens", disable=not progress
        ) as bar,
    ):
        for ids, lengths in encoded:
            if max_tokens is not None and num_tokens + ids.size >= max_tokens:
                keep = max_tokens - num_tokens
                ids = ids[:keep]
                starts = np.cumsum(lengths) - lengths
                lengths = lengths[starts < keep]  # documents with at least one token counted
            counts += np.bincount(ids, minlength=counts.size)
            num_tokens += ids.size
            num_documents += lengths.size
            bar.update(ids.size)
            bar.set_postfix(documents=num_documents, refresh=False)
            if num_tokens == max_tokens:
                break
    if num_tokens == 0:
        raise MapBuildError(
            f"corpus {', '.join(map(str, corpus))}: holds no tokens ({num_documents} documents read). "
            "Check the paths and --text-field."
        )
    local = os.path.exists(tokenizer_path)
    return TokenCounts(
        counts=torch.from_numpy(counts),
        num_documents=num_documents,
        tokenizer=os.path.abspath(tokenizer_path) if local else tokenizer_path,
        eos_token_ids=eos_token_ids(tokenizer, tokenizer_path),
        corpus=tuple(os.path.abspath(p) for p in corpus),
        text_field=text_field,
    )
