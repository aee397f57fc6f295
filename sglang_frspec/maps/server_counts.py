"""Token counts from a running SGLang server: the ids the target itself generates for a set of prompts.

A corpus count measures what a text says; the draft must propose what the target says. Sending
prompts like the served traffic to the target and counting its output ids calibrates the map to
the model. The server's native API is used: ``GET /model_info`` (model and tokenizer paths) and
``POST /generate`` with ``{"text", "sampling_params"}``, whose answer holds the ``output_ids``
(and, asked with ``return_prompt_token_ids``, the ``prompt_token_ids`` the server tokenized).

The counts are saved as they grow, with which prompts are done, so an interrupted run resumes
where it stopped (see ``count_server_tokens``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import queue
import signal
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from sglang_frspec.maps.corpus import JSON_LINES_SUFFIXES, read_documents
from sglang_frspec.maps.counts_file import TokenCounts
from sglang_frspec.maps.errors import MapBuildError
from sglang_frspec.maps.ranking import check_map_size, top_token_ids
from sglang_frspec.maps.tokenizer import (
    eos_token_ids,
    load_tokenizer,
    resolve_tokens,
    vocab_id_space,
    vocab_size_of,
)

_INFO_TIMEOUT_S = 30.0
# One greedy generation of a few hundred tokens on a loaded server: minutes at worst.
_GENERATE_TIMEOUT_S = 600.0
# How soon a Ctrl-C is acted on while every request is still in flight.
_SIGINT_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a server serves: its paths as the server sees them, and the id space of its outputs."""

    url: str
    model_path: str
    tokenizer_path: str | None
    vocab_size: int


def server_url(url: str) -> str:
    """The server's base URL without a trailing slash; a URL that is not http(s)://HOST is refused."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MapBuildError(
            f"server URL {url!r}: must be http://HOST:PORT (or https://), where sglang.launch_server "
            "listens, e.g. http://127.0.0.1:30000."
        )
    return url.rstrip("/")


def _http_json(url: str, path: str, body: dict | None = None, timeout: float = _INFO_TIMEOUT_S):
    """The JSON answer of ``GET url+path`` (or ``POST`` of ``body``); every failure is a MapBuildError."""
    method = "GET" if body is None else "POST"
    request = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:1000].decode(errors="replace").strip()
        hint = (
            "Is --from-server the base URL of an SGLang server (no path after HOST:PORT)?"
            if e.code == 404
            else "The server's log says more."
        )
        raise MapBuildError(
            f"server {url}: {method} {path} answered HTTP {e.code} {e.reason}: "
            f"{detail or '(no body)'}. {hint}"
        ) from e
    except urllib.error.URLError as e:  # connection refused, unknown host, connect timeout
        raise MapBuildError(
            f"server {url}: cannot be reached ({e.reason}). Start the server (python -m "
            "sglang.launch_server ...) or fix --from-server (e.g. http://127.0.0.1:30000)."
        ) from e
    except (OSError, http.client.HTTPException) as e:  # read timeout, reset, not an HTTP server
        raise MapBuildError(
            f"server {url}: {method} {path} failed ({type(e).__name__}: {e}). Check that --from-server "
            "is an SGLang server and that it is still running."
        ) from e
    try:
        return json.loads(raw)
    except ValueError as e:
        raise MapBuildError(
            f"server {url}: {method} {path} answered something that is not JSON ({raw[:80]!r}). Is it "
            "an SGLang server?"
        ) from e


def served_model(url: str, vocab_size: int | None = None) -> ServedModel:
    """Ask the server what it serves; the id space is ``vocab_size`` or its model's config.

    The vocab size is read from the model's ``config.json`` when the server's model path is a
    directory on this machine; it must then equal ``vocab_size`` if both are known.
    """
    from sglang_frspec.core import UnsupportedSetupError

    url = server_url(url)
    if vocab_size is not None and vocab_size < 1:
        raise MapBuildError(f"--vocab-size {vocab_size}: must be at least 1.")
    info = _http_json(url, "/model_info")
    model_path = info.get("model_path") if isinstance(info, dict) else None
    if not isinstance(model_path, str):
        raise MapBuildError(f"server {url}: GET /model_info has no model_path. Is it an SGLang server?")
    if info.get("is_generation") is False:
        raise MapBuildError(
            f"server {url}: serves {model_path!r}, which does not generate (an embedding model)."
        )
    configured = None
    if os.path.isdir(model_path):
        try:
            configured = vocab_size_of(model_path)
        except UnsupportedSetupError as e:
            raise MapBuildError(f"server {url}: {e}") from e
    if vocab_size is not None and configured is not None and vocab_size != configured:
        raise MapBuildError(
            f"--vocab-size {vocab_size}: the server's model {model_path!r} has vocab_size {configured} "
            "(its config.json). Drop --vocab-size, or point --from-server at the server of the model "
            "the map is for."
        )
    if vocab_size is None and configured is None:
        raise MapBuildError(
            f"server {url}: serves {model_path!r}, which is not a directory on this machine, so its "
            "vocab size is unknown. Pass --vocab-size (vocab_size in the model's config.json)."
        )
    tokenizer_path = info.get("tokenizer_path")
    return ServedModel(
        url=url,
        model_path=model_path,
        tokenizer_path=tokenizer_path if isinstance(tokenizer_path, str) else None,
        vocab_size=vocab_size or configured,
    )


def read_prompts(path: str | os.PathLike, text_field: str = "text") -> list[str]:
    """The non-empty prompts of a JSON Lines file (its ``text_field``) or a text file (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise MapBuildError(
            f"prompts {str(path)!r}: "
            + ("is a directory; pass one file." if path.is_dir() else "no such file.")
        )
    documents = read_documents([path], text_field)
    if path.suffix not in JSON_LINES_SUFFIXES:
        # A line's break ends the prompt; it is not part of it.
        documents = (line.rstrip("\r\n") for line in documents)
    prompts = [prompt for prompt in documents if prompt]
    if not prompts:
        raise MapBuildError(f"prompts file {str(path)!r}: holds no prompts. Check the file and --text-field.")
    return prompts


def prompts_digest(prompts: Sequence[str]) -> str:
    """sha256 of the prompts in order (length-prefixed, so prompt boundaries count)."""
    digest = hashlib.sha256()
    for prompt in prompts:
        encoded = prompt.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def _generate(url: str, prompt: str, sampling_params: dict, count_prompts: bool) -> list[int]:
    """The ids to count for one prompt: the output ids, after the prompt's ids with ``count_prompts``."""
    body: dict = {"text": prompt, "sampling_params": sampling_params}
    if count_prompts:
        body["return_prompt_token_ids"] = True
    answer = _http_json(url, "/generate", body, timeout=_GENERATE_TIMEOUT_S)
    keys = ("prompt_token_ids", "output_ids") if count_prompts else ("output_ids",)
    ids: list[int] = []
    for key in keys:
        value = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            fields = ", ".join(answer) if isinstance(answer, dict) else type(answer).__name__
            fix = "Drop --count-prompts if this SGLang cannot return them." if count_prompts else ""
            raise MapBuildError(
                f"server {url}: POST /generate answered without a list of {key} (fields: {fields}). "
                f"Is it an SGLang server? {fix}".strip()
            )
        ids += value
    return ids


@dataclasses.dataclass(frozen=True)
class _Run:
    """What a server count depends on; a counts file resumes only a run with the same values."""

    url: str
    model_path: str
    prompts: str  # absolute path
    text_field: str
    sampling_params: dict
    count_prompts: bool
    vocab_size: int

    def mismatches(self, saved: dict) -> list[str]:
        """How the run recorded in a counts file's ``server`` dict differs from this one."""
        return [
            f"{name} {saved.get(name)!r} (now {value!r})"
            for name, value in dataclasses.asdict(self).items()
            if saved.get(name) != value
        ]


def _resumed_state(counts_path: str, run: _Run, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Counts and done-flags (one per prompt) saved by an earlier run of the same count, else zeros."""
    counts = np.zeros(run.vocab_size, dtype=np.int64)
    done = np.zeros(len(prompts), dtype=bool)
    if not os.path.exists(counts_path):
        return counts, done
    saved = TokenCounts.load(counts_path)
    fresh = "pass another --save-counts file (or delete this one) to count afresh"
    if saved.server is None:
        raise MapBuildError(
            f"counts file {counts_path!r}: holds counts of a corpus ({', '.join(saved.corpus)}), not of "
            f"a --from-server run; {fresh}."
        )
    mismatches = run.mismatches(saved.server)
    if mismatches:
        raise MapBuildError(
            f"counts file {counts_path!r}: was counted with another {'; '.join(mismatches)}. Rerun with "
            f"the same options to resume it, or {fresh}."
        )
    num_saved = saved.server["num_prompts"]
    if num_saved > len(prompts) or prompts_digest(prompts[:num_saved]) != saved.server["prompts_sha256"]:
        raise MapBuildError(
            f"prompts file {run.prompts!r}: its first {num_saved} prompts are not those counted in "
            f"{counts_path!r} (only appending prompts keeps a count resumable); {fresh}."
        )
    counts[:] = saved.counts.numpy()
    done[:num_saved] = saved.server["done"].numpy()
    return counts, done


def count_server_tokens(
    model: ServedModel,
    prompts_path: str | os.PathLike,
    counts_path: str | os.PathLike,
    *,
    text_field: str = "text",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    concurrency: int = 8,
    count_prompts: bool = False,
    tokenizer_path: str | None = None,
    eos_ids: Sequence[int] = (),
    save_every: int = 100,
    progress: bool = True,
) -> TokenCounts:
    """Count the ids the server generates for each prompt (and reads, with ``count_prompts``).

    At most ``concurrency`` requests are in flight. The counts, with which prompts are done, are
    saved to ``counts_path`` every ``save_every`` answers, on Ctrl-C and on an error (once some
    prompts are counted); a counts file already there from the same server, model, prompts file
    (appended to or not) and settings is resumed: its prompts are not sent again.
    ``tokenizer_path`` and ``eos_ids`` are only recorded. Prints ``resuming: ...`` and the
    progress bar on stderr.
    """
    prompts = read_prompts(prompts_path, text_field)
    run = _Run(
        url=model.url,
        model_path=model.model_path,
        prompts=os.path.abspath(prompts_path),
        text_field=text_field,
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": float(temperature)},
        count_prompts=count_prompts,
        vocab_size=model.vocab_size,
    )
    recorded_tokenizer = (
        os.path.abspath(tokenizer_path)
        if tokenizer_path and os.path.exists(tokenizer_path)
        else tokenizer_path
    )
    counting = _ServerCount(
        run, prompts, os.fspath(counts_path), recorded_tokenizer, tuple(sorted(set(eos_ids)))
    )
    return counting.run(concurrency, save_every, progress)


class _ServerCount:
    """One (possibly resumed) count: the per-id counts, which prompts are done, and their file."""

    def __init__(self, run: _Run, prompts: list[str], counts_path: str, tokenizer: str | None,
                 eos_ids: tuple[int, ...]):  # fmt: skip
        self.run_settings = run
        self.prompts = prompts
        self.counts_path = counts_path
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        resuming = os.path.exists(counts_path)
        self.counts, self.done = _resumed_state(counts_path, run, prompts)
        if resuming:
            print(
                f"resuming: {int(self.done.sum())} of {len(prompts)} prompts already counted", file=sys.stderr
            )

    def save(self) -> TokenCounts:
        """Write the counts so far."""
        run = self.run_settings
        snapshot = TokenCounts(
            counts=torch.from_numpy(self.counts.copy()),
            num_documents=int(self.done.sum()),
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_ids,
            corpus=(run.prompts,),
            text_field=run.text_field,
            server=dataclasses.asdict(run)
            | {
                "num_prompts": len(self.prompts),
                "prompts_sha256": prompts_digest(self.prompts),
                "done": torch.from_numpy(self.done.copy()),
            },
        )
        snapshot.save(self.counts_path)
        return snapshot

    def add(self, index: int, ids: list[int]) -> None:
        """Count prompt ``index``'s generated ids (all must lie in the served model's id space)."""
        run = self.run_settings
        outside = sorted({i for i in ids if not 0 <= i < run.vocab_size})
        if outside:
            raise MapBuildError(
                f"server {run.url}: generated token ids {outside[:10]} for prompt {index + 1}, "
                f"outside the id space [0, {run.vocab_size}). Pass the served model's "
                "--vocab-size (vocab_size in its config.json)."
            )
        np.add.at(self.counts, ids, 1)
        self.done[index] = True

    def run(self, concurrency: int, save_every: int, progress: bool) -> TokenCounts:
        """Send the prompts not yet counted, ``concurrency`` at a time, and count the answers."""
        from tqdm import tqdm

        run, num_prompts = self.run_settings, len(self.prompts)
        pending: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in np.flatnonzero(~self.done).tolist():
            pending.put(index)
        answers: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def send_prompts() -> None:
            while not stop.is_set():
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    ids = _generate(run.url, self.prompts[index], run.sampling_params, run.count_prompts)
                    answers.put((index, ids))
                except MapBuildError as e:
                    answers.put((index, e))

        num_pending = int((~self.done).sum())
        # Daemon threads: Ctrl-C ends the process without waiting for the requests still in flight.
        for _ in range(min(concurrency, num_pending)):
            threading.Thread(target=send_prompts, daemon=True).start()
        bar = tqdm(total=num_prompts, initial=num_prompts - num_pending, unit="prompt", desc="generating",
                   disable=not progress or not num_pending)  # fmt: skip
        answered = 0
        with bar, _sigint_as_flag() as interrupted:
            try:
                while answered < num_pending and not interrupted.is_set():
                    try:
                        index, ids = answers.get(timeout=_SIGINT_POLL_S)
                    except queue.Empty:
                        continue
                    if isinstance(ids, MapBuildError):
                        raise MapBuildError(f"prompt {index + 1} of {run.prompts!r}: {ids}")
                    self.add(index, ids)
                    answered += 1
                    bar.update(1)
                    bar.set_postfix(tokens=int(self.counts.sum()), refresh=False)
                    if answered % save_every == 0:
                        self.save()
            except MapBuildError as e:
                stop.set()
                if not self.done.any():
                    raise  # nothing to resume: no counts file pinned to what may be a wrong setting
                self.save()
                raise MapBuildError(
                    f"{e} ({int(self.done.sum())} of {num_prompts} prompts are counted in "
                    f"{self.counts_path}; the same command resumes from there.)"
                ) from e
        stop.set()
        snapshot = self.save()
        if answered < num_pending:
            print(
                f"interrupted: {snapshot.num_documents} of {num_prompts} prompts counted, saved to "
                f"{self.counts_path}; the same command resumes from there.",
                file=sys.stderr,
            )
            raise KeyboardInterrupt
        return snapshot


@contextlib.contextmanager
def _sigint_as_flag() -> Iterator[threading.Event]:
    """Ctrl-C sets the event instead of raising, so it never lands between two updates of a count.

    Off the main thread (where Python never delivers SIGINT) the handler is left alone.
    """
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def build_token_map_from_server(
    url: str,
    prompts_path: str | os.PathLike,
    size: int,
    counts_path: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    tokenizer_path: str | None = None,
    include: Sequence[str | int] = (),
    text_field: str = "text",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    concurrency: int = 8,
    count_prompts: bool = False,
    save_every: int = 100,
    progress: bool = True,
) -> tuple[torch.Tensor, TokenCounts]:
    """The ``size`` most frequent ids the server generates for the prompts, and the counts.

    EOS ids (forced into the map) come from ``tokenizer_path``, by default the server's own
    tokenizer when that path is a directory here; without a tokenizer only ``include`` is forced.
    Sizes, included tokens and the server are checked before any prompt is sent.
    """
    for name, value, least in (
        ("--max-new-tokens", max_new_tokens, 1),
        ("--concurrency", concurrency, 1),
        ("--save-every", save_every, 1),
        ("--temperature", temperature, 0),
    ):
        if value < least:
            raise MapBuildError(f"{name} {value}: must be at least {least}.")
    read_prompts(prompts_path, text_field)  # a wrong file fails before the server is asked
    model = served_model(url, vocab_size)
    if tokenizer_path is None and model.tokenizer_path and os.path.isdir(model.tokenizer_path):
        tokenizer_path = model.tokenizer_path
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    eos_ids: tuple[int, ...] = ()
    if tokenizer is not None:
        if vocab_id_space(tokenizer) > model.vocab_size:
            raise MapBuildError(
                f"tokenizer {tokenizer_path!r}: its vocab has {vocab_id_space(tokenizer)} ids, more than the "
                f"{model.vocab_size} of the server's model {model.model_path!r}. Pass that model's tokenizer."
            )
        eos_ids = eos_token_ids(tokenizer, tokenizer_path)
    forced = eos_ids + resolve_tokens(include, model.vocab_size, tokenizer, f"tokenizer {tokenizer_path!r}")
    check_map_size(size, model.vocab_size, forced)
    counts = count_server_tokens(
        model,
        prompts_path,
        counts_path,
        text_field=text_field,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        concurrency=concurrency,
        count_prompts=count_prompts,
        tokenizer_path=tokenizer_path,
        eos_ids=eos_ids,
        save_every=save_every,
        progress=progress,
    )
    return top_token_ids(counts.counts, size, forced), counts
