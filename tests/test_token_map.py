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
    positions = torch.arange(file_ids.numel())
    assert torch.equal(hot.ids[wire.from_wire(positions)], file_ids)  # every position, repeats too
    canonical = torch.arange(len(hot))
    assert torch.equal(file_ids[wire.to_wire(canonical)], hot.ids)
    assert wire.to_wire(canonical).tolist() == [0, 2, 3, 5, 7, 1]  # each id's first position
    assert wire.to_wire(torch.tensor([[5, 0], [3, 1]])).shape == (2, 2)


def test_wire_order_reads_positions_outside_the_map_as_its_first_id_and_refuses_another_maps_tag():
    file_ids = torch.tensor([2, 300, 5, 9, 5, 17, 2, 40])
    hot = canonical_hot_ids(file_ids, 1000)
    wire = HotWireOrder.of(file_ids, hot)
    # Positions of a longer map (8, 9) and a corrupt one (-3): the file's first id, in range.
    received = torch.tensor([[9, 1], [8, -3], [7, 0]])
    assert hot.ids[wire.from_wire(received)].tolist() == [[2, 300], [2, 2], [40, 2]]
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
