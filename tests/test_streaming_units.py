"""The expert cache's parts on their own: budgets, pin files, slot allocation, byte
ranges and positioned reads (runtime/experts_cache.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from turboquant.runtime.experts_cache import (
    Blob,
    ExpertBudgetError,
    Group,
    Layout,
    Part,
    _preadv_full,
    allocate_slots,
    minimum_budget,
    parse_budget,
    read_pins,
    segments_of,
)


@pytest.mark.parametrize("value,want", [
    (12345, 12345), ("2GB", 2 * 10**9), ("2", 2 * 10**9), ("1.5GiB", 3 * 2**29),
    ("500MB", 5 * 10**8), ("64 KiB", 65536), ("25%", 250), ("100%", 1000), ("0.5%", 5),
    ("300b", 300),
])
def test_budgets_in_bytes_sizes_and_percentages(value, want):
    assert parse_budget(value, total_bytes=1000) == want


@pytest.mark.parametrize("value", ["lots", "-1GB", "0", "0%", "150%", "%", True, 0, "2 GBs"])
def test_bad_budgets_say_what_is_accepted(value):
    with pytest.raises(ExpertBudgetError):
        parse_budget(value, total_bytes=1000)


def test_pins_from_a_file_a_dict_or_a_list(tmp_path):
    f = tmp_path / "pins.json"
    f.write_text(json.dumps([[0, 3], [2, 1]]))
    assert read_pins(f) == [(0, 3), (2, 1)]
    f.write_text(json.dumps({"experts": [[1, 1]]}))
    assert read_pins(str(f)) == [(1, 1)]
    assert read_pins([(4, 5)]) == [(4, 5)]
    assert read_pins(None) == []
    f.write_text("[[1, 2, 3]]")
    with pytest.raises(ExpertBudgetError, match=r"\[\[layer, expert\]"):
        read_pins(f)
    f.write_text("{not json")
    with pytest.raises(ExpertBudgetError, match="not valid JSON"):
        read_pins(f)


def _layout(n: int) -> Layout:
    return Layout(((("up_proj", "codes"), (n // 4,), "uint32"),))  # n bytes


def _group(layout, experts, top_k=2):
    return Group("g", layout, [Blob(0, e, ()) for e in range(experts)], top_k)


def test_slots_go_to_each_layout_by_its_share_of_the_bytes():
    big, small = _layout(1000), _layout(100)
    groups = [_group(big, 10), _group(big, 10), _group(small, 10)]
    assert minimum_budget(groups) == 2 * 1000 + 2 * 100
    slots = allocate_slots(groups, 2200)
    assert slots == {big: 2, small: 2}
    slots = allocate_slots(groups, 11000)
    assert slots[big] * 1000 + slots[small] * 100 <= 11000
    assert slots[big] >= 10 and slots[small] >= 5
    assert allocate_slots(groups, 10**9) == {big: 20, small: 10}  # never more than exist
    with pytest.raises(ExpertBudgetError, match=r"minimum is .*\(2200 bytes"):
        allocate_slots(groups, 2199)


def test_tensors_close_on_disk_are_read_as_one_range():
    parts = [("a", Part(("up", "codes"), 100, 200)), ("a", Part(("up", "scales"), 210, 250)),
             ("a", Part(("down", "codes"), 10**8, 10**8 + 50)),
             ("b", Part(("gate", "codes"), 0, 10))]
    segs = segments_of(parts)
    assert [(s.shard, s.start, s.end, len(s.parts)) for s in segs] == [
        ("a", 100, 250, 2), ("a", 10**8, 10**8 + 50, 1), ("b", 0, 10, 1)]


def test_positioned_reads_scatter_and_stop_at_the_end_of_the_file(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(bytes(range(256)) * 4)
    fd = os.open(f, os.O_RDONLY)
    try:
        a, gap, b = np.zeros(10, np.uint8), bytearray(6), np.zeros(4, np.uint32)
        assert _preadv_full(fd, [a, gap, b.view(np.uint8)], 100) == 32
        assert a.tolist() == list(range(100, 110))
        assert b.view(np.uint8).tolist() == list(range(116, 132))
        tail = np.zeros(64, np.uint8)
        assert _preadv_full(fd, [tail], 1000) == 24  # short: the caller reports truncation
    finally:
        os.close(fd)
