"""Sets of ranks as ascending ranges: a rank class at any world size (1,048,576 ranks) in O(ranges) memory.

`describe` (models/training.py) groups ranks into classes of identical layout and records each class's ranks
(the metadata's `rank_class_ranges`); the mesh, tensor- and expert-parallel classes and the report read them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence


class RankRanges(Sequence):
    """A set of ranks as ascending, disjoint ranges [start, stop): a rank class at any world size in
    O(ranges) memory. A sequence of the ranks (len, iteration, indexing, `in`), equal to a list or tuple
    of the same ranks; `as_json` gives inclusive [first, last] pairs, `text` "0-1016,1018-1023"."""

    __slots__ = ("ranges", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, stop in sorted((a, b) for a, b in ranges if a < b):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        self.ranges = tuple((a, b) for a, b in merged)
        self._ends = list(itertools.accumulate(b - a for a, b in self.ranges))  # ranks up to each range's end

    @classmethod
    def of(cls, ranks: Iterable[int]) -> "RankRanges":
        """From ranks listed in any order (duplicates ignored)."""
        out: list[tuple[int, int]] = []
        for r in sorted(set(ranks)):
            if out and out[-1][1] == r:
                out[-1] = (out[-1][0], r + 1)
            else:
                out.append((r, r + 1))
        return cls(out)

    @classmethod
    def from_json(cls, pairs) -> "RankRanges":
        return cls((int(first), int(last) + 1) for first, last in pairs)

    def as_json(self) -> list[list[int]]:
        return [[a, b - 1] for a, b in self.ranges]

    def text(self) -> str:
        return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in self.ranges)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("rank index out of range")
        k = bisect.bisect_right(self._ends, i)
        return self.ranges[k][0] + i - (self._ends[k - 1] if k else 0)

    def __iter__(self):
        for a, b in self.ranges:
            yield from range(a, b)

    def __contains__(self, rank) -> bool:
        k = bisect.bisect_right(self.ranges, (rank, float("inf"))) - 1
        return k >= 0 and self.ranges[k][0] <= rank < self.ranges[k][1]

    def __eq__(self, other) -> bool:
        if isinstance(other, RankRanges):
            return self.ranges == other.ranges
        if isinstance(other, (list, tuple, range)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ranges)

    def __repr__(self) -> str:
        return f"RankRanges({self.text()!r})"
