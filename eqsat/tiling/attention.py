"""The attention template's tiles (`emit.pallas.attention`): query and key blocks, head pieces."""

from __future__ import annotations

import dataclasses

from eqsat.tiling import MIN_DOT_BLOCK, SHARED_MEMORY_BYTES, dot_itemsize, next_pow2  # noqa: F401


def head_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """`(offset, width)` pieces of the head dim, powers of two >= 16 covering it (rounded up to 16):
    40 -> 32+16, 80 -> 64+16, 160 -> 128+32, 64 -> 64. The dots and the accumulator run per piece,
    so a head of 160 multiplies and holds 160 lanes, not 256."""
    total = -(-head_dim // MIN_DOT_BLOCK) * MIN_DOT_BLOCK
    pieces, offset = [], 0
    for width in sorted((1 << bit for bit in range(total.bit_length()) if total >> bit & 1), reverse=True):
        pieces.append((offset, width))
        offset += width
    return tuple(pieces)


def key_loop_trips(kv_len: int, block_k: int) -> int:
    """Key blocks the kernel's loop runs: the full ones (a partial last block runs once after it)."""
    return kv_len // block_k


# The most the attention template's Triton kernel was measured to ask per byte of its q block and k/v block,
# read from XLA's thunk sequence of the deviceless sm_90 compile (blocks q x k x head lanes):
# fp16 64 x 32 x 512: 98,304 B (1.0x); fp32 64 x 32 x 512: 327,680 (1.67x), 32 x 32 x 512: 200,704
# (1.53x), 32 x 16 x 512: 133,120 (1.35x), 64 x 16 x 512 and 256 x 64 x 128: 229,376 (1.4x),
# 64 x 64 x 256: 262,144 (2.0x).
SHARED_BYTES_PER_TILE_BYTE = 2.0


def fits_shared_memory(block_q: int, block_k: int, width: int, itemsize: int) -> bool:
    """Whether the attention kernel's q block and k/v block of `width` head lanes fit an H100's
    shared memory, at the most it was measured to ask per tile byte."""
    return SHARED_BYTES_PER_TILE_BYTE * (block_q + block_k) * width * itemsize <= SHARED_MEMORY_BYTES


def tail_width(kv_len: int, block_k: int) -> int:
    """Key slots of the partial last block: the leftover keys rounded up to a power of two >= 16
    (77 keys in blocks of 64: one block of 64 and a tail of 16 slots, not 128)."""
    return max(MIN_DOT_BLOCK, next_pow2(kv_len % block_k))


# Output lanes one program accumulates at most: a wider head (one power-of-two piece) splits its
# output lanes over several programs per query block (`AttentionBlocks.value_splits`), each
# computing the scores over the whole head. The VAE's 512-lane head in one program (64 x 32 blocks,
# 8 warps) held a [64, 512] fp32 accumulator, 128 of a thread's 255 registers, and spilled 504 B
# (1,304 B with vectorized k/v loads) in ptxas for sm_90a.
MAX_VALUE_LANES = 256


def value_splits(head_dim: int) -> int:
    """Programs per query block that share a head's output lanes: width / MAX_VALUE_LANES for a
    head of one power-of-two piece wider than that, else 1."""
    pieces = head_pieces(head_dim)
    width = sum(w for _, w in pieces)
    return width // MAX_VALUE_LANES if len(pieces) == 1 and width > MAX_VALUE_LANES else 1


def value_lanes(head_dim: int, splits: int) -> int:
    """Output lanes of each of `splits` programs of a query block."""
    return sum(w for _, w in head_pieces(head_dim)) // splits


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes (powers of two, >= 16) and launch parameters of one attention kernel;
    `value_splits` programs per query block share the output lanes (`value_splits`)."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    value_splits: int = 1

    @classmethod
    def get_default(cls, q_len: int, kv_len: int, head_dim: int, itemsize: int = 2) -> "AttentionBlocks":
        """Tiles read from the sm_90 PTX (`python -m benchmarks.attention_ptx --blocks ...`): 64 keys
        and a warpgroup (4 warps) per 64 query rows: 256 rows from 4096 queries (heads up to 128
        lanes: at 16 warps ptxas has 128 registers, and a 160-lane accumulator spills), 128 from
        1024 (the k/v loads per score shrink with the rows while the grid still fills the GPU),
        else 64; heads wider than 256 lanes (the VAE's 512): 64 x 32 on 8 warps, the output lanes
        split over `value_splits(head_dim)` programs. Shrunk to short sequences, then to an H100's
        shared memory (`fits_shared_memory`; `itemsize` is the dots' operand bytes)."""
        width = sum(w for _, w in head_pieces(head_dim))
        if width > 256:
            block_q, block_k, warps = 64, 32, 8
        else:
            block_q = 256 if q_len >= 4096 and width <= 128 else 128 if q_len >= 1024 else 64
            block_k, warps = 64, block_q // 16
        block_q = min(block_q, max(MIN_DOT_BLOCK, next_pow2(q_len)))
        block_k = min(block_k, max(MIN_DOT_BLOCK, next_pow2(kv_len)))
        while not fits_shared_memory(block_q, block_k, width, itemsize):
            if block_q > 32:
                block_q, warps = block_q // 2, max(4, warps // 2)
            elif block_k > MIN_DOT_BLOCK:
                block_k //= 2
            else:
                break  # the smallest tiles: a head this wide does not fit; Triton's compile says so
        return cls(block_q, block_k, num_warps=warps, value_splits=value_splits(head_dim))

    def validate(self) -> None:
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_BLOCK or value != next_pow2(value):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")
        if self.value_splits < 1 or self.value_splits != next_pow2(self.value_splits):
            raise ValueError(f"value_splits={self.value_splits} must be a power of two >= 1")
