"""How the merges of a hosted statistic's per-tile partials are blocked: a reader's merge
(`emit.expr.merge_partials_at`) and the `finalize` kernel (`emit.pallas.partials.finalize`)."""

from __future__ import annotations

from dataclasses import dataclass

# Elements (tiles of a block x lanes) a reader's merge of per-tile partials loads at once.
MERGE_BLOCK_ELEMENTS = 4096
FINALIZE_BLOCK_TILES = 1024  # tiles a `finalize` program loads per merge step (its merge's budget)
FINALIZE_WARPS = 4  # warps of a `finalize` program: 1024 tiles / 128 threads = 8 tiles per thread


def merge_block_tiles(tiles: int, lanes: int, budget: int = MERGE_BLOCK_ELEMENTS) -> int:
    """TB, the tiles `merge_partials_at` loads per step for a point of `lanes` elements: the largest
    power of two with TB * lanes <= `budget` (at least 1), no more than `tiles` rounded up to one."""
    cap = max(1, budget // max(1, lanes))
    cap = 1 << (cap.bit_length() - 1)
    return max(1, min(1 << max(0, (tiles - 1).bit_length()), cap))


@dataclass(frozen=True)
class FinalizeConfig:
    """How `finalize` runs a statistic of `slots` outputs over `tiles` partial rows: one program per
    slot, `block_tiles` tiles per serial step on `num_warps` warps (the cost model's
    `eqsat.cost.merges.finalize_cost` prices exactly this)."""

    tiles: int
    slots: int
    fields: int
    block_tiles: int
    num_warps: int = FINALIZE_WARPS

    @classmethod
    def of(cls, tiles: int, fields: int, slots: int) -> "FinalizeConfig":
        return cls(tiles, slots, fields, merge_block_tiles(tiles, 1, FINALIZE_BLOCK_TILES))

    @property
    def programs(self) -> int:
        return self.slots

    @property
    def steps(self) -> int:
        """Serial merge steps of a program."""
        return -(-self.tiles // self.block_tiles)

    @property
    def loads_per_thread(self) -> int:
        """Partial values one thread loads over all its steps (each step: its share of the block's
        tiles, every field)."""
        threads = 32 * self.num_warps
        return self.steps * self.fields * -(-self.block_tiles // threads)
