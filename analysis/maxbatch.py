"""The largest micro-batch that fits a budget, by exponential then binary search over exact ints.

`peak_of(b)` is the peak for micro-batch b (b = 0 means the fixed state alone: parameters, master
weights, gradients, optimizer states). The answer is the largest b with peak_of(b) <= budget,
0 when only the fixed state fits, and -1 when even the fixed state does not. The peak is assumed
non-decreasing in b. Python ints never overflow, so limits near 2^63 and beyond are fine.
"""

from __future__ import annotations

from typing import Callable


def max_fitting(peak_of: Callable[[int], int], budget: int, limit: int = 2**64) -> int:
    if peak_of(0) > budget:
        return -1
    if peak_of(1) > budget:
        return 0
    lo, hi = 1, 2  # peak_of(lo) fits; find hi that does not (or reaches limit)
    while hi <= limit and peak_of(hi) <= budget:
        lo, hi = hi, hi * 2
    if hi > limit:
        if peak_of(limit) <= budget:
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak_of(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo
