"""Token counting over a corpus: streaming, multi-process, capped, saved for rebuilding maps."""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing

import numpy as np
import torch

from sglang_frspec.maps.corpus import read_documents
from sglang_frspec.maps.counts_file import TokenCounts
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.tokenizer import eos_token_ids, load_tokenizer, token_id_space

# Text per tokenization task: large enough to amortise the inter-process hand-over, small enough
# that the batches in flight (at most 2 per worker) stay a few MB.
_BATCH_CHARS = 1 << 18
_BATCH_DOCUMENTS = 1024


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
    pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,))
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        # Never terminate() a pool with tasks in flight (as `with Pool` does when the consumer stops
        # early, at max_tokens): a worker killed while it writes its result holds the result queue's
        # lock forever, and the pool's shutdown then waits on that lock for good.
        for result in pending:
            result.wait()
        pool.close()
        pool.join()


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
