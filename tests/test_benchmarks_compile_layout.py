"""The conv template's statistic layout computed for all tiles at once (`emit.pallas.conv`:
`_tile_distinct`, `_Layout._check_distinct`), equal to the per-tile loops it replaced: the
VAE's 512x512 convs have thousands of tiles, and those loops were most of its Python emission."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from emit.pallas.conv import _Layout, _part_gaps, _tile_distinct


def distinct_per_tile(values, tiles):
    """The per-tile loop `_tile_distinct` replaced (`_local_ids` before issue 18's session 13)."""
    found = [np.unique(values[members]) for members in tiles]
    width = max(len(d) for d in found)
    distinct = np.zeros((len(found), width), np.int32)
    for tile, values_of_tile in enumerate(found):
        distinct[tile, :len(values_of_tile)] = values_of_tile
    return distinct, np.array([len(d) for d in found], np.int32)


def collides_per_pair(row_parts, row_used, col_parts, col_used) -> bool:
    """The per-(M tile, N tile) loop `_check_distinct` replaced."""
    for parts_m, count_m in zip(row_parts, row_used):
        for parts_n, count_n in zip(col_parts, col_used):
            sums = (parts_m[:count_m][:, None] + parts_n[:count_n][None, :]).ravel()
            if len(np.unique(sums)) != len(sums):
                return True
    return False


@st.composite
def values_and_tiles(draw):
    """Values with few distinct entries (repeats, constant runs), large offsets, negatives; tiles
    of uneven sizes (a short last tile, single entries), in any order over the values."""
    size = draw(st.integers(1, 200))
    spread = draw(st.sampled_from([1, 2, 3, 7, 40, 1 << 20]))
    offset = draw(st.sampled_from([0, -5, 1 << 28, -(1 << 28)]))
    values = offset + np.array(draw(st.lists(st.integers(0, spread - 1), min_size=size, max_size=size)), np.int64)
    order = np.array(draw(st.permutations(range(size))))
    block = draw(st.integers(1, size))
    tiles = [order[i:i + block] for i in range(0, size, block)]
    return values, tiles


@settings(max_examples=200, deadline=None)
@given(values_and_tiles())
def test_tile_distinct_equals_the_per_tile_loop(case):
    values, tiles = case
    got, counts = _tile_distinct(values, tiles)
    want, want_counts = distinct_per_tile(values, tiles)
    assert got.dtype == want.dtype == np.int32 and counts.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(counts, want_counts)


@st.composite
def parts(draw, max_width):
    """0-padded distinct parts per tile, ascending, as `_tile_distinct` gives them."""
    tiles = draw(st.integers(1, 6))
    rows, used = [], []
    for _ in range(tiles):
        chosen = sorted(draw(st.sets(st.integers(0, 60), min_size=0, max_size=max_width)))
        used.append(len(chosen))
        rows.append(chosen)
    width = max(used)
    table = np.zeros((tiles, width), np.int32)
    for i, chosen in enumerate(rows):
        table[i, :len(chosen)] = chosen
    return table, np.array(used, np.int32)


@settings(max_examples=300, deadline=None)
@given(parts(8), parts(6))
def test_check_distinct_equals_the_pairwise_loop(rows, cols):
    layout = _Layout(None, rows[0], rows[1], cols[0], cols[1])
    collides = collides_per_pair(*rows, *cols)
    try:
        layout._check_distinct()
        raised = False
    except NotImplementedError:
        raised = True
    assert raised == collides


def test_part_gaps_ignore_padding_and_repeats():
    parts_table = np.array([[3, 10, 0, 0], [5, 0, 0, 0], [0, 2, 7, 0]], np.int32)
    used = np.array([2, 1, 3], np.int32)
    np.testing.assert_array_equal(_part_gaps(parts_table, used), [2, 5, 7])  # 10-3, 2-0, 7-2, 7-0
    # A GroupNorm-like case: pixel parts 0 and 32 (two images) against channel parts 0..3 (groups).
    rows = (np.array([[0, 32]], np.int32), np.array([2], np.int32))
    _Layout(None, *rows, np.array([[0, 1, 2, 3]], np.int32), np.array([4], np.int32))._check_distinct()


@st.composite
def slot_tables(draw):
    """[pixels, channels] slot tables: split (pixel part + channel part) or not, full or broadcast
    along either axis (as `np.broadcast_to` leaves them), odd sizes, large offsets."""
    pixels, channels = draw(st.integers(1, 9)), draw(st.integers(1, 7))
    row = np.array(draw(st.lists(st.integers(-(1 << 28), 1 << 28), min_size=pixels, max_size=pixels)), np.int64)
    col = np.array(draw(st.lists(st.integers(0, 40), min_size=channels, max_size=channels)), np.int64)
    kind = draw(st.sampled_from(["split", "pixel only", "channel only", "perturbed"]))
    if kind == "pixel only":
        return np.broadcast_to(row[:, None], (pixels, channels))
    if kind == "channel only":
        return np.broadcast_to(col[None, :], (pixels, channels))
    table = row[:, None] + col[None, :]
    if kind == "perturbed":
        table = table.copy()
        table[draw(st.integers(0, pixels - 1)), draw(st.integers(0, channels - 1))] += draw(st.sampled_from([1, -3]))
    return table


@settings(max_examples=300, deadline=None)
@given(slot_tables())
def test_split_check_on_the_stored_part_equals_the_full_check(table):
    from emit.pallas.conv import _splits_into_parts

    full = np.ascontiguousarray(table)
    want = np.array_equal(full, (full[:, 0] - full[0, 0])[:, None] + full[0, :][None, :])
    assert _splits_into_parts(table) == _splits_into_parts(full) == want
