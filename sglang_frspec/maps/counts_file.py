"""The counts file: per-id token counts and where they came from (torch only).

Written by ``build-map`` (corpus or server counts) and by a serving scheduler
(``SGLANG_FRSPEC_COUNTS``), read by ``build-map --from-counts``, ``inspect`` and ``size``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from sglang_frspec.maps.errors import MapBuildError

COUNTS_FORMAT = "sglang-frspec token counts v1"


def save_atomically(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` beside ``path``, then rename over it: a reader (or a crash) never sees half
    a file."""
    partial = f"{os.fspath(path)}.partial"
    torch.save(obj, partial)
    os.replace(partial, path)


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
        """Write the counts file (beside it, then renamed over it: a reader never sees half)."""
        save_atomically(
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
