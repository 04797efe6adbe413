"""The end-of-fit prefetch report: ``prefetch.json``'s contents and the lines printed.

Example::

    report, lines = end_of_fit(total)   # PrefetchStats summed over ranks
"""

from __future__ import annotations

from gpu_busy.prefetch import PrefetchStats
from gpu_busy.report import figure
from gpu_busy.report.files import PrefetchReport


def end_of_fit(total: PrefetchStats) -> tuple[PrefetchReport, list[str]]:
    m = total.means()
    report: PrefetchReport = {**m, **total.counts()}  # type: ignore[typeddict-item]
    if not total.batches:
        return report, []
    lines = [
        f"prefetch: {total.batches} batches; copy {figure(m['copy_ms'], ' ms')}/batch, "
        f"{figure(m['exposed_copy_ms'], ' ms')} exposed, {figure(m['hidden_copy_pct'], '%')} "
        "hidden"
    ]
    if total.pageable_batches:
        lines.append(f"prefetch: {total.pageable_batches} batches arrived unpinned")
    if total.unmoved_batches:
        lines.append(
            f"prefetch: off for {total.unmoved_batches} of {total.batches} batches: they "
            "hold an object whose .to() takes no non_blocking, so Lightning copied them on "
            "the compute stream"
        )
    return report, lines
