"""Aggregate recorded syncs by call site, with a one-line fix per site, and print them.

Example::

    table = SyncSiteTable()
    with detect_syncs(device_type="cpu") as rec:
        step()
    table.add_all(rec.take(), step=0, logging=False)
    print("\\n".join(table.render()))
    # on a GPU: ranked by the GPU idle each site caused per watched batch
    print("\\n".join(table.render(watched=1, step_ms=12.0)))

Tables from several processes merge with ``merge(rows)``: rows are plain dicts, so they
travel through ``all_gather_object``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from gpu_busy.syncs.attribution import SyncEvent, fix_for, is_library


def fix_hint(event: SyncEvent, chain_hints: tuple[tuple[str, str], ...] = ()) -> str:
    """One line saying how to avoid this sync (``detector.fix_for``; Lightning's own reads
    in ``chain_hints``, from ``rules.LIGHTNING_READS``)."""
    fix = fix_for(event.chain, event.hint, chain_hints)
    return fix or "find what reads device memory on the host here; defer it to logging steps"


def site_key(x: SyncEvent | SyncSite) -> tuple[str, int, str, str, str | None]:
    """Which site a ``SyncEvent`` belongs to, and a ``SyncSite``'s own key: by who asked too,
    so one prog_bar line read by the loop and by a progress bar is two sites, each with its
    reader named."""
    return (x.filename, x.lineno, x.op, x.phase, x.via)


@dataclass
class SyncSite:
    """One (file, line, op, phase) with how often it synced."""

    filename: str
    lineno: int
    op: str
    phase: str
    function: str = ""
    code: str = ""
    via: str | None = None
    hint: str = ""
    allowed: str | None = None  # the reason given to allow_syncs, if one covered it
    branch: str = ""  # what the line's device branch means on a GPU (SyncEvent.branch)
    cpu_only: bool = False  # a read the CPU simulation sees and a GPU does not make
    count: int = 0  # all watched steps
    steady_count: int = 0  # watched steady steps (see WatchedSteps)
    first_count: int = 0  # at the fit's first step (set-up)
    steps: list[int] = field(default_factory=list)  # first few steps it was seen in
    # what it cost, summed over the events where it was measured (gpu_busy.syncs.costs)
    host_ms: float = 0.0
    host_timed: int = 0
    idle_after_ms: float = 0.0
    idle_timed: int = 0

    @property
    def key(self) -> tuple[str, int, str, str, str | None]:
        return site_key(self)

    @property
    def location(self) -> str:
        return SyncEvent(self.op, self.filename, self.lineno).location

    def idle_per_batch(self, watched: int) -> float | None:
        """GPU idle it caused per watched batch (ms), over the events it was measured for."""
        return self.idle_after_ms / watched if self.idle_timed and watched else None

    def host_per_batch(self, watched: int) -> float | None:
        return self.host_ms / watched if self.host_timed and watched else None


class SyncSiteTable:
    """Call sites and counts over a run; ``render()`` gives the report lines.

    ``chain_hints``: fixes for reads a library makes, by a function in its chain.
    ``costs``: keep what each sync cost (False in the CPU simulation: there no queue drains,
    so the host-clock figures are not GPU time).
    """

    def __init__(self, chain_hints: tuple[tuple[str, str], ...] = (), costs: bool = True) -> None:
        self.sites: dict[tuple, SyncSite] = {}  # by SyncSite.key
        self.chain_hints = chain_hints
        self.costs = costs

    def add_all(
        self, events: list[SyncEvent], step: int, logging: bool, first: bool = False
    ) -> None:
        """One watched step's events: ``logging`` for any step not steady (a logging step,
        the one after it, the fit's first), ``first`` for the fit's first."""
        for e in events:
            key = site_key(e)
            site = self.sites.get(key)
            if site is None:
                hint = fix_hint(e, self.chain_hints)
                site = self.sites[key] = SyncSite(
                    e.filename, e.lineno, e.op, e.phase, e.function, e.code, e.via, hint,
                    e.allowed, e.branch, e.cpu_only,
                )  # fmt: skip
            site.count += 1
            site.steady_count += 0 if logging else 1
            site.first_count += int(first)
            if len(site.steps) < 5 and step not in site.steps:
                site.steps.append(step)
            if self.costs and e.host_ms is not None:
                site.host_ms += e.host_ms
                site.host_timed += 1
            if self.costs and e.idle_after_ms is not None:
                site.idle_after_ms += e.idle_after_ms
                site.idle_timed += 1

    def rows(self) -> list[dict]:
        return [asdict(s) for s in self.sites.values()]

    def merge(self, rows: list[dict]) -> None:
        """Add another table's ``rows()`` (another rank's)."""
        for row in rows:
            other = SyncSite(**row)
            site = self.sites.get(other.key)
            if site is None:
                self.sites[other.key] = other
            else:
                for name in ("count", "steady_count", "first_count", "host_ms", "host_timed",
                             "idle_after_ms", "idle_timed"):  # fmt: skip
                    setattr(site, name, getattr(site, name) + getattr(other, name))
                site.steps = sorted(set(site.steps) | set(other.steps))[:5]

    def ranked(self, watched: int | None = None) -> list[SyncSite]:
        """The sites a GPU syncs at, by the GPU idle they caused per batch when ``watched``
        (the watched batches, summed over ranks) is given and costs were measured, then by
        count."""

        def key(s: SyncSite) -> tuple:
            idle = s.idle_per_batch(watched) if watched else None
            return (-(idle or 0.0), -s.steady_count, -s.count, s.location)

        return sorted((s for s in self.sites.values() if not s.cpu_only), key=key)

    def cpu_only(self) -> list[SyncSite]:
        """The reads only the CPU simulation makes (``SyncEvent.cpu_only``), by count."""
        return sorted((s for s in self.sites.values() if s.cpu_only), key=lambda s: -s.count)

    def render(
        self, limit: int = 20, watched: int | None = None, step_ms: float | None = None
    ) -> list[str]:
        """Sites ranked (``ranked``), each with its fix and, given ``watched``, its cost per
        batch and as a share of a step of ``step_ms``. Empty when nothing synced."""
        ordered = self.ranked(watched)
        lines = []
        for s in ordered[:limit]:
            when = _when(s)
            via = f" via {s.via}" if s.via else ""
            steps = ", ".join(map(str, s.steps)) + (", ..." if s.count > len(s.steps) else "")
            lines.append(f"  {s.count:6d}x  {s.location}  [{s.phase}]  {s.op}{when}{via}")
            if watched:
                lines.append(f"           cost {_cost_text(s, watched, step_ms)}")
            lines.append(f"           steps {steps}")
            if s.code:
                lines.append(f"           {s.code}")
            if s.branch:
                lines.append(f"           {s.branch}")
            lines.append(
                f"           allowed: {s.allowed}" if s.allowed else f"           fix: {s.hint}"
            )
        if len(ordered) > limit:
            lines.append(f"  ... and {len(ordered) - limit} more site(s)")
        cpu_only = self.cpu_only()
        if cpu_only:
            lines.append("  seen only because this run is on the CPU (not counted above):")
        for s in cpu_only[:limit]:
            lines.append(f"  {s.count:6d}x  {s.location}  [{s.phase}]  {s.op}")
            lines.append(f"           {s.branch}")
        return lines


def _when(site: SyncSite) -> str:
    """When a site synced, from what was recorded: at steady steps (said by nothing), or
    only where a fit reads anyway."""
    if site.steady_count:
        return ""
    if site.first_count == site.count:
        return " (the fit's first step only)"
    return (
        " (the first step and logging steps only)" if site.first_count else " (logging steps only)"
    )


def _cost_text(site: SyncSite, watched: int, step_ms: float | None) -> str:
    idle, host = site.idle_per_batch(watched), site.host_per_batch(watched)
    if idle is None and host is None:
        return "not measured (seen only after it returned, or at a window's end)"
    idle_text = host_text = "n/a"
    if idle is not None:
        idle_text = f"{idle:.3f} ms/batch"
        if step_ms:
            idle_text += f" ({100 * idle / step_ms:.1f}% of a step)"
        if site.idle_timed < site.count:
            idle_text += f", measured {site.idle_timed} of {site.count} times"
    if host is not None:
        host_text = f"{host:.3f} ms/batch"
    return f"GPU idle after it {idle_text}; host waited in it {host_text}"


def github_annotations(items: list[SyncSite] | list[SyncEvent]) -> list[str]:
    """GitHub Actions ``::warning`` lines for sync sites or events in the user's own files
    (not libraries, not allowed ones), so that they show on the pull request's diff."""
    lines = []
    for item in items:
        if (
            item.allowed
            or item.cpu_only
            or item.filename.startswith("<")
            or is_library(item.filename)
        ):
            continue
        count = f"{item.count}x " if isinstance(item, SyncSite) else ""
        path = item.location.rsplit(":", 1)[0]  # relative to the working directory
        message = f"host-device sync: {count}{item.op}. {item.hint}".rstrip(". ")
        lines.append(f"::warning file={path},line={item.lineno}::{message}")
    return lines


def in_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"
