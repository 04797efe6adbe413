"""Interval arithmetic, shared by both idle methods.

Intervals are ``(start, end)`` pairs on one clock, in any unit; an empty or negative
interval counts as nothing.

Example::

    union_length([(0, 4), (2, 6), (8, 9)])      # 7: (0, 6) and (8, 9)
    overlap_length((3, 10), [(0, 4), (8, 12)])  # 3: (3, 4) and (8, 10)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import pairwise

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly what ``intervals`` cover."""
    merged: list[list[float]] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def union_length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merge(intervals))


def overlap_length(window: Interval, intervals: Sequence[Interval]) -> float:
    """How much of ``window`` the union of ``intervals`` covers."""
    lo, hi = window
    if len(intervals) == 1:  # the usual case, one DataLoader read in a gap: no merge
        s, e = intervals[0]
        return max(0.0, min(hi, e) - max(lo, s))
    return union_length((max(lo, s), min(hi, e)) for s, e in intervals)


def gaps(merged: list[Interval]) -> list[Interval]:
    """The holes between consecutive intervals of an already merged list."""
    return [(a[1], b[0]) for a, b in pairwise(merged) if b[0] > a[1]]
