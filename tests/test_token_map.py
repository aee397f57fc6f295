"""Reading and validating token-map files: every bad input gets a clear, specific error."""

from __future__ import annotations

import argparse

import pytest
import torch

from sglang_frspec.adapters.token_map import load_token_map_ids
from sglang_frspec.core import (
    HotWireOrder,
    TokenMapError,
    canonical_hot_ids,
    check_hot_ids_cover_topk,
    read_token_map,
)


def _save(tmp_path, obj, name="map.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def test_tensor_and_frspec_list_formats(tmp_path):
    ids = [5, 1, 9, 1, 3]
    from_tensor = read_token_map(_save(tmp_path, torch.tensor(ids), "t.pt"))
    from_list = read_token_map(_save(tmp_path, ids, "l.pt"))
    from_int32 = read_token_map(_save(tmp_path, torch.tensor(ids, dtype=torch.int32), "i.pt"))
    for got in (from_tensor, from_list, from_int32):
        assert got.dtype == torch.int64 and got.tolist() == ids  # file order, duplicates kept
    hot = canonical_hot_ids(from_list, 10)
    assert hot.ids.tolist() == [1, 3, 5, 9] and hot.num_duplicates == 1
    assert hot.digest == canonical_hot_ids(torch.tensor([9, 5, 3, 1]), 10).digest


BAD_OBJECTS = {
    "2d": (torch.zeros(2, 3, dtype=torch.int64), "2-D tensor of shape (2, 3)"),
    "float": (torch.tensor([1.0, 2.0]), "torch.float32 tensor"),
    "bool": (torch.tensor([True, False]), "torch.bool tensor"),
    "strings": (["a", "b"], "str element ('a')"),
    "nested": ([[1, 2], [3]], "list element"),
    "empty_list": ([], "is empty"),
    "empty_tensor": (torch.zeros(0, dtype=torch.int64), "is empty"),
    "dict": ({"ids": [1, 2]}, "holds a dict"),
    "bools_in_list": ([1, True], "bool element"),
}


@pytest.mark.parametrize("case", sorted(BAD_OBJECTS))
def test_bad_contents(tmp_path, case):
    obj, message = BAD_OBJECTS[case]
    path = _save(tmp_path, obj)
    with pytest.raises(TokenMapError, match="token map") as err:
        read_token_map(path)
    assert message in str(err.value) and path in str(err.value)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.pt")
    with pytest.raises(TokenMapError, match="no such file"):
        load_token_map_ids(path)


def test_not_loadable_with_weights_only(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a torch file")
    with pytest.raises(TokenMapError, match=r"cannot be read with torch.load\(weights_only=True\)"):
        read_token_map(garbage)
    pickled = _save(tmp_path, argparse.Namespace(ids=[1, 2]), "obj.pt")
    with pytest.raises(TokenMapError, match="weights_only"):
        read_token_map(pickled)


def test_relative_path_that_is_neither_file_nor_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenMapError, match="not a local file, and fetching it as a hub"):
        load_token_map_ids("some-org/some-repo/freq_32768.pt")


@pytest.mark.parametrize(
    ("ids", "message"),
    [([-3, 4], "1 negative id"), ([4, 10, 11], "2 id(s) >= the target's vocab size 10")],
)
def test_out_of_range(ids, message):
    with pytest.raises(TokenMapError) as err:
        canonical_hot_ids(torch.tensor(ids), 10, source="m.pt")
    assert message in str(err.value) and "m.pt" in str(err.value)


def test_a_map_must_hold_at_least_topk_distinct_ids():
    hot = canonical_hot_ids(torch.tensor([9, 3, 9]), 10, source="m.pt")  # FR-Spec lists repeat EOS
    check_hot_ids_cover_topk(len(hot), 2, source="m.pt")
    with pytest.raises(TokenMapError) as err:
        check_hot_ids_cover_topk(len(hot), 3, source="m.pt")
    message = str(err.value)
    assert "holds 2 distinct id(s), fewer than --speculative-eagle-topk 3" in message
    assert "m.pt" in message and "--speculative-eagle-topk 2 or less" in message


def test_wire_order_maps_file_positions_and_canonical_indices_both_ways():
    file_ids = torch.tensor([2, 300, 5, 9, 5, 17, 2, 40])  # FR-Spec's list: unsorted, repeats
    hot = canonical_hot_ids(file_ids, 1000)
    wire = HotWireOrder.of(file_ids, hot)
    positions = torch.arange(file_ids.numel()).unsqueeze(1)  # each its own request, top-k 1
    assert torch.equal(hot.ids[wire.from_wire(positions)].flatten(), file_ids)  # repeats too
    canonical = torch.arange(len(hot))
    assert torch.equal(file_ids[wire.to_wire(canonical)], hot.ids)
    assert wire.to_wire(canonical).tolist() == [0, 2, 3, 5, 7, 1]  # each id's first position
    assert wire.to_wire(torch.tensor([[5, 0], [3, 1]])).shape == (2, 2)


def _distinct_drafts(rows: list[list[int]], file_ids: list[int]) -> list[list[int]]:
    """Reference: the ids a decode node drafts for received rows of file positions. A slot keeps
    its position's id when the position is in the file and no earlier slot kept that id; the other
    slots take, in turn, the file's ids in file order that no kept slot holds."""
    out = []
    for row in rows:
        kept: list[int | None] = []
        for position in row:
            fits = 0 <= position < len(file_ids) and file_ids[position] not in kept
            kept.append(file_ids[position] if fits else None)
        spares = iter([t for t in dict.fromkeys(file_ids) if t not in kept])
        out.append([t if t is not None else next(spares) for t in kept])
    return out


def test_wire_order_makes_outside_and_repeated_positions_distinct_map_ids_and_refuses_another_maps_tag():
    """A received row is one request's sibling drafts: positions outside this map, and positions
    whose id an earlier slot already holds, become the file's first ids the row lacks, so no token
    is drafted twice (the target-only tree verify would commit it with twice its probability)."""
    file_ids = torch.tensor([2, 300, 5, 9, 5, 17, 2, 40])
    hot = canonical_hot_ids(file_ids, 1000)
    wire = HotWireOrder.of(file_ids, hot)
    # Positions of a longer map (8, 9), a corrupt one (-3), a real position 0 beside an outside
    # one, and positions 0 and 6 (both id 2: a stock sender's file repeats it), at top-k 2 and 4.
    received = torch.tensor([[9, 1], [8, -3], [7, 0], [9, 0], [0, 6]])
    assert hot.ids[wire.from_wire(received)].tolist() == [[2, 300], [2, 300], [40, 2], [300, 2], [2, 300]]
    wide = torch.tensor([[9, 9, 9, 0], [4, 2, 3, 1]])
    assert hot.ids[wire.from_wire(wide)].tolist() == [[300, 5, 9, 2], [5, 2, 9, 300]]
    g = torch.Generator().manual_seed(5)
    for width in range(1, 7):  # the map holds 6 distinct ids: top-k up to 6
        rows = torch.randint(-2, 12, (200, width), generator=g)
        drafted = hot.ids[wire.from_wire(rows)].tolist()
        assert drafted == _distinct_drafts(rows.tolist(), file_ids.tolist()), width
        assert all(len(set(row)) == width for row in drafted), width
    received = received[:3]
    rows = torch.zeros(3, 16, dtype=torch.int64)
    rows[:, :2] = received
    assert wire.count_outside(rows, 2) == 3
    rows[:, -1] = wire.tag  # this map's tag, as a plugin prefill node with the same file sends it
    assert wire.count_outside(rows, 2) == 3
    # The tag is of the ids in file order: the same ids sorted, or one more id, differ.
    same = HotWireOrder.of(file_ids.clone(), canonical_hot_ids(file_ids.clone(), 1000))
    assert wire.tag < 0 and same.tag == wire.tag
    for other_ids in (hot.ids, torch.cat([file_ids, torch.tensor([500])])):
        other = HotWireOrder.of(other_ids, canonical_hot_ids(other_ids, 1000))
        assert other.tag < 0 and other.tag != wire.tag
        rows[1, -1] = other.tag
        with pytest.raises(
            TokenMapError, match="the prefill node's token map differs from this decode node's"
        ):
            wire.count_outside(rows, 2)
    # A top-k that fills the row leaves no tag slot: the last column is a position then.
    assert wire.count_outside(rows[:, :2], 2) == 3
