"""Reports held back to be printed together, under the verdict, at the end of a fit.

The callback that prints them (``RunSummary``) owns one ``HeldReports`` as its
``held_reports`` attribute; ``gpu_busy.callbacks.ranks.publish`` finds it among the
trainer's callbacks, so no state lives outside the trainer.

Example::

    held = HeldReports()
    held.start()
    held.hold("idle", report, lines)       # True: kept; False when not started
    for name, report, lines in held.take():
        ...
"""

from __future__ import annotations


class HeldReports:
    def __init__(self) -> None:
        self._reports: list[tuple[str, dict, list[str]]] | None = None

    def start(self) -> None:
        self._reports = []

    def hold(self, name: str, report: dict, lines: list[str]) -> bool:
        if self._reports is None:
            return False
        self._reports.append((name, report, lines))
        return True

    def take(self) -> list[tuple[str, dict, list[str]]]:
        """The reports held since ``start``; holding stops."""
        reports, self._reports = self._reports or [], None
        return reports
