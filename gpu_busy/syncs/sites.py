"""Aggregate recorded syncs by call site, with a one-line fix per site, and print them.

Example::

    table = SyncSiteTable()
    with detect_syncs(device_type="cpu") as rec:
        step()
    table.add_all(rec.take(), step=0, logging=False)
    print("\\n".join(table.render()))

Tables from several processes merge with ``merge(rows)``: rows are plain dicts, so they
travel through ``all_gather_object``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpu_busy.syncs.detector import SyncEvent

# Lightning's own reads, recognised by a function in the library chain (first match wins).
_CHAIN_HINTS = (
    (
        "_broadcast_sigterm_tensor",
        "Lightning's per-step DDP SIGTERM check: add gpu_busy.callbacks.StopOnSignal "
        "(on in the default config), which checks every N steps instead",
    ),
    (
        "in on_batch_end",
        "Lightning converts prog_bar=True metrics after every step (an .item() each): log "
        "without prog_bar and show them with gpu_busy.callbacks.LoggingStepProgressBar",
    ),
    (
        "progress_bar_metrics",
        "the progress bar reads prog_bar metrics when it refreshes: use "
        "gpu_busy.callbacks.LoggingStepProgressBar",
    ),
    (
        "update_train_step_metrics",
        "Lightning writes the logged metrics to the loggers (logging steps only): expected; "
        "a larger log_every_n_steps does it less often",
    ),
    (
        "callback_metrics",
        "trainer.callback_metrics converts logged tensors to numbers: read it at logging "
        "steps or at epoch end",
    ),
)

# First matching fragment of the op name wins.
_OP_HINTS = (
    (
        "backward of x[mask]",
        "index with precomputed integer indices (index_select) or use torch.where(mask, x, 0)",
    ),
    ("x[mask] =", "use torch.where(mask, value, x) or masked_fill with a Python scalar"),
    ("x[mask]", "use torch.where(mask, x, 0) / masked_fill, or nonzero_static(size=...)"),
    ("masked_select", "use torch.where(mask, x, 0), or nonzero_static(size=...) + gather"),
    ("nonzero", "use torch.nonzero_static(x, size=...) or three-argument torch.where"),
    ("masked_fill", "pass the fill value as a Python number, or use torch.where"),
    ("unique", "pass a known size, or compute it in the DataLoader (host side)"),
    ("repeat_interleave", "pass output_size= (the total length, known on the host)"),
    ("bincount", "use zeros(n).scatter_add_(0, x, ones) with a known n"),
    ("histc", "pass min= and max= explicitly"),
    ("equal", "compare on the device (torch.isclose(a, b).all()) and read it at logging steps"),
    ("allclose", "compare on the device (torch.isclose(a, b).all()) and read it at logging steps"),
    ("multinomial", "sample on the device without checks: argmax(logits + Gumbel noise)"),
    ("linalg", "use the _ex forms (torch.linalg.inv_ex, cholesky_ex); check info at logging steps"),
    ("ctc_loss", "pass input and target lengths as host tensors or lists"),
    ("synchronize", "remove it; time with CUDA events read by query(), not synchronize()"),
    ("print/repr", "print at logging steps only, or log the tensor with self.log"),
    ("format(", "format at logging steps only, or log the tensor with self.log"),
    ("bool(tensor)", "branch on the device with torch.where, or decide every N steps"),
    (
        "Tensor.item",
        "log the tensor with self.log (Lightning reduces it every log_every_n_steps) or keep "
        "it in a torchmetrics metric",
    ),
    ("float(", "keep it a tensor: log it with self.log, or read it at logging steps"),
    ("int(", "keep it a tensor, or compute the number on the host (from shapes, not values)"),
    ("scalar read", "keep it a tensor: log it with self.log, or read it at logging steps"),
    ("index (__index__)", "index with the tensor itself (index_select/gather), not a number"),
    (".cpu()", "keep it on the device, or copy with non_blocking=True into pinned memory"),
    (".to('cpu')", "keep it on the device, or copy with non_blocking=True into pinned memory"),
    ("tolist", "keep it on the device, or read it at logging steps"),
    ("numpy", "keep it on the device, or read it at logging steps"),
    ("np.asarray", "keep it on the device, or read it at logging steps"),
    ("blocking copy", "copy with non_blocking=True from pinned memory, or create it on the device"),
)


def fix_hint(event: SyncEvent) -> str:
    """One line saying how to avoid this sync."""
    if event.simulated:
        return "none needed: only the CPU simulation counts it (a GPU run moves nothing here)"
    chain = " ".join(event.chain)
    for marker, hint in _CHAIN_HINTS:
        if marker in chain:
            return hint
    for marker, hint in _OP_HINTS:
        if marker in event.op:
            return hint
    return "find what reads device memory on the host here and defer it to logging steps"


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
    simulated: bool = False  # a sync only in the CPU simulation (see SyncEvent)
    count: int = 0  # all watched steps
    steady_count: int = 0  # watched steps that were not logging steps
    steps: list[int] = field(default_factory=list)  # first few steps it was seen in

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.filename, self.lineno, self.op, self.phase)

    @property
    def location(self) -> str:
        return SyncEvent(self.op, self.filename, self.lineno).location


class SyncSiteTable:
    """Call sites and counts over a run; ``render()`` gives the report lines."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, int, str, str], SyncSite] = {}

    def add_all(self, events: list[SyncEvent], step: int, logging: bool) -> None:
        for e in events:
            key = (e.filename, e.lineno, e.op, e.phase)
            site = self.sites.get(key)
            if site is None:
                site = self.sites[key] = SyncSite(
                    e.filename, e.lineno, e.op, e.phase, e.function, e.code, e.via, fix_hint(e),
                    e.simulated,
                )  # fmt: skip
            site.count += 1
            site.steady_count += 0 if logging else 1
            if len(site.steps) < 5 and step not in site.steps:
                site.steps.append(step)

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
                site.count += other.count
                site.steady_count += other.steady_count
                site.steps = sorted(set(site.steps) | set(other.steps))[:5]

    def render(self, limit: int = 20) -> list[str]:
        """Sites by count, each with its fix; then, apart and not counted, the ones only the
        CPU simulation sees. Empty when nothing synced."""
        ordered = sorted(
            self.sites.values(),
            key=lambda s: (s.simulated, -s.steady_count, -s.count, s.location),
        )
        lines = []
        for i, s in enumerate(ordered[:limit]):
            if s.simulated and (i == 0 or not ordered[i - 1].simulated):
                lines.append("  CPU simulation only (a GPU run does not wait here; not counted):")
            when = "" if s.steady_count else " (logging steps only)"
            via = f" via {s.via}" if s.via else ""
            steps = ", ".join(map(str, s.steps)) + (", ..." if s.count > len(s.steps) else "")
            lines.append(f"  {s.count:6d}x  {s.location}  [{s.phase}]  {s.op}{when}{via}")
            lines.append(f"           steps {steps}")
            if s.code:
                lines.append(f"           {s.code}")
            lines.append(f"           fix: {s.hint}")
        if len(ordered) > limit:
            lines.append(f"  ... and {len(ordered) - limit} more site(s)")
        return lines
