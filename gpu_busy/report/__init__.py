"""The report layer: what a fit's figures become once the callbacks have gathered them.

``files`` (the run files' layout and reader), ``idle``, ``syncs``, ``prefetch`` and ``run``
(each report's contents and text), ``picture``, ``verdict`` and ``compare``. It imports the
mechanisms and nothing from the callbacks. The two ways a figure is written in text are
here, so that every report writes a missing one the same way: ``n/a``.

Example::

    figure(2.164, " ms")    # "2.16 ms"
    figure(None, "%")       # "n/a"
    rounded(2410.3)         # "2,410"
    site_location(site)     # "model.py:42": where a syncs.json site is, as printed
"""

from __future__ import annotations


def figure(value: float | None, unit: str = "") -> str:
    """Two decimals and the unit; ``n/a`` where there is no value."""
    return "n/a" if value is None else f"{value:.2f}{unit}"


def site_location(site: dict) -> str:
    """Where a ``syncs.json`` site is, as the report printed it (relative, or inside
    site-packages); its file and line for a report older than the ``location`` key."""
    return site.get("location") or f"{site.get('filename')}:{site.get('lineno')}"


def rounded(value: float | None, unit: str = "") -> str:
    """As ``figure``, but whole and grouped from 100 on (throughputs, long steps)."""
    if value is None or abs(value) < 100:
        return figure(value, unit)
    return f"{value:,.0f}{unit}"
