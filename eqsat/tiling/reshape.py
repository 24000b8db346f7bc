"""Which axes of a row-major reshape's input and output hold the same elements."""

from __future__ import annotations

from typing import Sequence


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up axes of `src` and `dst` (size-1 axes left out) into groups of equal element count."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [i for i, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(a[i]); pa *= src[a[i]]; i += 1
            else:
                gb.append(b[j]); pb *= dst[b[j]]; j += 1
        groups.append((ga, gb))
    return groups
