"""Counters summed over a window of steps, sent between ranks as one flat list of numbers.

Subclass it as a dataclass of int and float fields (all defaulting to zero); a field made
with ``largest()`` joins windows by its largest value instead of their sum (a peak):

Example::

    @dataclass
    class Waits(WindowSums):
        steps: int = 0
        wait_ms: float = 0.0
        longest_ms: float = largest()

    window = Waits(); window.steps += 1
    done = window.take()                       # a copy; the window starts again at zero
    total = Waits.from_list(gathered.sum(0).tolist())   # after an all-gather over ranks
    mean, most = mean_and_max([r.means() for r in per_rank])  # figures over ranks
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TypeVar

S = TypeVar("S", bound="WindowSums")


def largest() -> float:
    """A float field that joins windows by its largest value (a peak), not their sum."""
    return field(default=0.0, metadata={"join": max})


@dataclass
class WindowSums:
    def add(self, other: WindowSums) -> None:
        for f in fields(self):
            ours, theirs = getattr(self, f.name), getattr(other, f.name)
            join = f.metadata.get("join")
            setattr(self, f.name, join(ours, theirs) if join else ours + theirs)

    def take(self: S) -> S:
        """A copy of the sums; the sums start again from zero."""
        out = type(self)(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(0))
        return out

    def as_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls: type[S], values: Iterable[float]) -> S:
        """The inverse of ``as_list`` (int fields rounded back)."""
        names = [f.name for f in fields(cls)]
        return cls(
            **{
                name: (round(v) if isinstance(getattr(cls, name), int) else float(v))
                for name, v in zip(names, values, strict=True)
            }
        )


def mean_and_max(
    per_rank: list[dict[str, float | None]],
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Key by key over the ranks' figures: the mean, and the largest single rank's value
    (where a straggler shows). None where no rank has the figure."""
    mean: dict[str, float | None] = {}
    most: dict[str, float | None] = {}
    for key in per_rank[0] if per_rank else []:
        values = [r[key] for r in per_rank if r.get(key) is not None]
        mean[key] = sum(values) / len(values) if values else None
        most[key] = max(values) if values else None
    return mean, most
