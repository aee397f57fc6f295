"""Token maps: reading, validating and canonicalising the hot ids (torch only)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from sglang_frspec.core.errors import TokenMapError

_SAVE_HINT = (
    "Save the hot ids as a 1-D int64 tensor, e.g. "
    "torch.save(torch.tensor(ids, dtype=torch.int64), 'map.pt'), "
    "or build one with `sglang-frspec build-map`."
)


def read_token_map(path: str | os.PathLike) -> torch.Tensor:
    """Read a token-map file (a saved 1-D integer tensor or a saved Python list of ints).

    Returns the ids as an int64 CPU tensor in file order, duplicates kept.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TokenMapError(
            f"token map {path!r}: no such file. Check the --speculative-token-map path "
            f"(it must exist on every node that runs a TP rank). {_SAVE_HINT}"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for unreadable files
        raise TokenMapError(
            f"token map {path!r}: cannot be read with torch.load(weights_only=True) "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). {_SAVE_HINT}"
        ) from e
    return ids_from_object(obj, source=path)


def ids_from_object(obj: object, source: str = "token map") -> torch.Tensor:
    """Turn a loaded token-map object (tensor, list or tuple of ints) into 1-D int64 ids."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype == torch.bool or obj.dtype.is_floating_point or obj.dtype.is_complex:
            raise TokenMapError(
                f"token map {source!r}: holds a {obj.dtype} tensor, but hot ids must be "
                f"integers. {_SAVE_HINT}"
            )
        if obj.dim() != 1:
            raise TokenMapError(
                f"token map {source!r}: holds a {obj.dim()}-D tensor of shape "
                f"{tuple(obj.shape)}, but hot ids must be a 1-D tensor. "
                f"Flatten it (ids.flatten()) if it is one list of ids. {_SAVE_HINT}"
            )
        ids = obj.to(torch.int64)
    elif isinstance(obj, (list, tuple)):
        bad = next((x for x in obj if isinstance(x, bool) or not isinstance(x, int)), None)
        if bad is not None:
            raise TokenMapError(
                f"token map {source!r}: holds a {type(obj).__name__} with a "
                f"{type(bad).__name__} element ({bad!r}); hot ids must be ints. {_SAVE_HINT}"
            )
        ids = torch.tensor(list(obj), dtype=torch.int64)
    else:
        raise TokenMapError(
            f"token map {source!r}: holds a {type(obj).__name__}, not a tensor or list of ids. {_SAVE_HINT}"
        )
    if ids.numel() == 0:
        raise TokenMapError(f"token map {source!r}: is empty; it must hold at least one id.")
    return ids


@dataclass(frozen=True)
class HotIds:
    """Canonical hot ids: sorted, unique, all inside the original vocab."""

    ids: torch.Tensor  # int64 [H], ascending
    num_duplicates: int  # entries the file repeated (dropped)
    digest: str  # sha256 of the canonical ids; equal maps give equal digests

    def __len__(self) -> int:
        return int(self.ids.numel())


def canonical_hot_ids(ids: torch.Tensor, vocab_size: int, source: str = "token map") -> HotIds:
    """Sort and de-duplicate ids and check them against the target's original vocab size.

    The canonical (ascending) order is the same for every TP size, so a prefill node and a
    decode node with different TP agree on what hot index j means.
    """
    ids = ids.to(torch.int64).flatten()
    if ids.numel() == 0:
        raise TokenMapError(f"token map {source!r}: is empty; it must hold at least one id.")
    negative = ids[ids < 0]
    if negative.numel():
        raise TokenMapError(
            f"token map {source!r}: has {negative.numel()} negative id(s) "
            f"(first: {negative[:5].tolist()}); ids must lie in [0, {vocab_size}). "
            "Rebuild the map from the target model's tokenizer."
        )
    too_big = ids[ids >= vocab_size]
    if too_big.numel():
        raise TokenMapError(
            f"token map {source!r}: has {too_big.numel()} id(s) >= the target's vocab size "
            f"{vocab_size} (first: {too_big[:5].tolist()}); such ids would select padding or "
            "LoRA-added rows of the LM head. The map was probably built for another "
            "model: rebuild it with this model's tokenizer."
        )
    hot = torch.unique(ids, sorted=True)
    digest = hashlib.sha256(hot.numpy().tobytes()).hexdigest()
    return HotIds(ids=hot, num_duplicates=int(ids.numel() - hot.numel()), digest=digest)


@dataclass(frozen=True)
class HotWireOrder:
    """Stock SGLang's hot order (positions in the map file, duplicates kept) against the canonical
    one: PD disaggregation ships hot indices between nodes, and stock reads them in file order."""

    canonical_to_file: torch.Tensor  # int64 [H]: canonical hot index -> first file position of its id
    file_to_canonical: torch.Tensor  # int64 [len(file)]: file position -> canonical hot index
    by_file_order: torch.Tensor  # int64 [H]: canonical hot indices by first file position
    # Names the file's ids in file order (what a position on the wire means): equal files, equal
    # tags. Negative, so a receiver never reads it as a hot index.
    tag: int

    @classmethod
    def of(cls, file_ids: torch.Tensor, hot: HotIds) -> HotWireOrder:
        """The maps for a file's ids (in range: ``hot`` was made from them)."""
        file_ids = file_ids.to(torch.int64)
        file_to_canonical = torch.searchsorted(hot.ids, file_ids)
        positions = torch.arange(file_ids.numel(), dtype=torch.int64)
        canonical_to_file = torch.full((len(hot),), file_ids.numel(), dtype=torch.int64)
        canonical_to_file.scatter_reduce_(0, file_to_canonical, positions, reduce="amin")
        by_file_order = torch.argsort(canonical_to_file)  # first positions are distinct: no ties
        digest = hashlib.sha256(file_ids.cpu().numpy().astype("<i8").tobytes()).digest()
        tag = -1 - (int.from_bytes(digest[:8], "little") >> 2)
        return cls(canonical_to_file, file_to_canonical, by_file_order, tag)

    def to(self, device: torch.device | str) -> HotWireOrder:
        return HotWireOrder(
            self.canonical_to_file.to(device),
            self.file_to_canonical.to(device),
            self.by_file_order.to(device),
            self.tag,
        )

    def to_wire(self, hot_index: torch.Tensor) -> torch.Tensor:
        """Canonical hot indices as stock SGLang's file positions (same shape)."""
        return self.canonical_to_file.to(hot_index.device)[hot_index]

    def from_wire(self, rows: torch.Tensor) -> torch.Tensor:
        """Received first drafts ``[requests, topk]`` (file positions, as a stock node ships them)
        as canonical hot indices, distinct within each row.

        A row's slots are sibling drafts of one tree node, and SGLang's target-only tree verify adds
        each sibling's target mass before its coin test: a token drafted twice would be committed
        with twice its probability. So a slot whose position lies outside this map (the sender's
        map is longer), or whose id an earlier slot of the row already holds (a stock sender's file
        repeats ids), takes the map file's first ids (FR-Spec's most frequent) that the row does
        not hold, in file order. Such a slot is then a proposal like any other, verified exactly;
        under rejection sampling (top-k 1) the proposal q is built one-hot at it. All on the device
        (no host sync, no out-of-range gather: a device assert on CUDA), the same on every rank;
        ``count_outside`` tells the host."""
        table = self.file_to_canonical.to(rows.device)
        inside = (rows >= 0) & (rows < table.numel())
        hot = table[torch.where(inside, rows, 0)]
        width = rows.shape[-1]
        earlier = torch.ones(width, width, dtype=torch.bool, device=rows.device).tril(-1)  # [i, j]: j < i
        repeats = ((hot.unsqueeze(-1) == hot.unsqueeze(-2)) & earlier & inside.unsqueeze(-2)).any(-1)
        kept = inside & ~repeats
        # The map's first ``width`` ids in file order hold enough free ones: the map has at least
        # top-k ids (check_hot_ids_cover_topk), and each kept slot takes at most one of them.
        spares = self.by_file_order[:width].to(rows.device)
        taken = ((hot.unsqueeze(-1) == spares) & kept.unsqueeze(-1)).any(-2)  # [..., spares]
        free = spares[torch.argsort(taken.to(torch.int8), dim=-1, stable=True)]  # untaken first, in order
        nth = (torch.cumsum(~kept, dim=-1) - 1).clamp(min=0)  # each replaced slot's rank among them
        return torch.where(kept, hot, free.gather(-1, nth))

    def count_outside(self, received: torch.Tensor, num_states: int) -> int:
        """Check the rows a PD decode node received ([requests, width] as SGLang's metadata
        buffer holds them: file positions in the first ``num_states`` columns, and in the last
        the sender's tag when the width leaves room) and return how many positions lie outside
        this map. A row tagged with another map's tag raises TokenMapError."""
        if received.shape[1] > num_states:
            tags = received[:, -1]
            foreign = tags[(tags < 0) & (tags != self.tag)]
            if foreign.numel():
                raise TokenMapError(
                    "[sglang-frspec] prefill/decode: the prefill node's token map differs from "
                    f"this decode node's (map tag {int(foreign[0])} received, {self.tag} here, "
                    f"for this node's file of {self.file_to_canonical.numel()} entries). A prefill "
                    "node ships each request's first draft as positions in its "
                    "--speculative-token-map file, so both nodes must load the same file with its "
                    "ids in the same order: a longer or shorter map, or the same ids in another "
                    "order (e.g. a sorted or adapted map saved on one node), turns every first "
                    "draft into other tokens. Copy one map file to every prefill and decode node "
                    "and restart the nodes that loaded another."
                )
        positions = received[:, :num_states]
        return int(((positions < 0) | (positions >= self.file_to_canonical.numel())).sum())


def check_hot_ids_cover_topk(num_hot: int, topk: int, source: str = "token map") -> None:
    """Refuse a map with fewer distinct ids than the draft's top-k: each draft step takes the
    top-k of ``num_hot`` columns, which SGLang's ``fast_topk`` cannot do (it fails at the first
    request)."""
    if num_hot < topk:
        raise TokenMapError(
            f"token map {source!r}: holds {num_hot} distinct id(s), fewer than "
            f"--speculative-eagle-topk {topk}; every draft step picks the top {topk} of the map's "
            f"ids. Use a map of at least {topk} distinct ids (FR-Spec maps hold thousands), or "
            f"--speculative-eagle-topk {num_hot} or less."
        )
