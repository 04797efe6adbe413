"""Figures from every rank, written once: the gathers and rank-zero writes the callbacks share.

The gathers are collectives: every rank calls them at the same point; only rank zero
writes. A figure over ranks is the mean of the ranks' values, and its ``_rank_max``
twin the largest single rank's value (the straggler), for every figure alike.

Example::

    per_rank = [IdleStats.from_list(r) for r in gather_rows(trainer, window.as_list())]
    log_metrics(trainer, over_ranks([s.means(cuda) for s in per_rank], prefix="idle/"))
    publish(trainer, "idle", report, lines, run_dir(trainer))   # log lines + idle.json
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch

from gpu_busy import lightning_compat as compat
from gpu_busy.log import get_logger
from gpu_busy.report.files import write_report
from gpu_busy.report.held import HeldReports
from gpu_busy.syncs import allow_syncs
from gpu_busy.window_sums import mean_and_max

log = get_logger(__name__)


def gather_rows(trainer: pl.Trainer, row: list[float]) -> list[list[float]]:
    """Every rank's ``row`` (all of one length), in rank order, on every rank."""
    if trainer.world_size == 1:
        return [row]
    with allow_syncs("gpu_busy gathers its figures over ranks at logging steps"):
        t = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
        return trainer.strategy.all_gather(t).reshape(trainer.world_size, -1).cpu().tolist()


def gather_objects(trainer: pl.Trainer, obj: Any) -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank (for end-of-fit tables)."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [obj]
    out: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def group_store(trainer: pl.Trainer, prefix: str, timeout: float) -> Any:
    """A client of the store the process group already runs (MASTER_ADDR:MASTER_PORT), under
    ``prefix``: no second listening port, so nothing new to reach, and nothing to
    authenticate beyond what the group exposes. Talking to it is no collective: a rank can
    use it where the others may not be listening. Raises where that store is out of reach."""
    environment = trainer.strategy.cluster_environment
    client = torch.distributed.TCPStore(
        environment.main_address, environment.main_port, is_master=False,
        timeout=timedelta(seconds=timeout),
    )  # fmt: skip
    return torch.distributed.PrefixStore(prefix, client)


def leave_at_once(trainer: pl.Trainer | None) -> NoReturn:
    """End this process now, and the ranks it started (Lightning's launcher starts a node's
    others from local rank zero): from any thread, even while the main thread waits in a
    collective that will never complete. SIGKILL ends a stopped rank too."""
    sys.stdout.flush()
    for proc in compat.started_ranks(trainer) if trainer is not None else []:
        if proc.poll() is None:
            proc.kill()
    os._exit(1)


def over_ranks(per_rank: list[dict[str, float | None]], prefix: str) -> dict[str, float | None]:
    """The metrics of per-rank figures: ``<prefix><key>``, the mean over ranks, and under
    DDP ``<prefix><key>_rank_max``, the largest single rank's value."""
    mean, most = mean_and_max(per_rank)
    out = {f"{prefix}{k}": v for k, v in mean.items()}
    if len(per_rank) > 1:
        out.update({f"{prefix}{k}_rank_max": v for k, v in most.items()})
    return out


def log_metrics(
    trainer: pl.Trainer, metrics: dict[str, float | None], step: int | None = None, epoch=None
):
    """Rank zero sends the figures that are not None to every logger, at Lightning's step
    (or ``step``, of ``epoch``)."""
    metrics = {k: v for k, v in metrics.items() if v is not None}
    if not (metrics and trainer.is_global_zero and trainer.loggers):
        return
    metrics["epoch"] = trainer.current_epoch if epoch is None else epoch  # as Lightning's rows
    step = compat.logger_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def run_dir(trainer: pl.Trainer) -> Path | None:
    """The run's directory, as Lightning names it (``Trainer.log_dir``: the first logger's
    folder, and without a logger ``default_root_dir``, where Lightning puts the run's
    checkpoints); None where a logger has no folder (the reports are printed only).

    ``trainer.log_dir`` is a broadcast under DDP: call this on every rank, at one point.
    """
    log_dir = trainer.log_dir
    return Path(log_dir) if log_dir else None


def publish(
    trainer: pl.Trainer, name: str, report: dict, lines: list[str], folder: Path | None = None
) -> Path | None:
    """Rank zero writes ``report`` to ``<folder>/<name>.json`` and logs ``lines``, or hands
    them to a callback's ``held_reports`` that is holding them (``RunSummary``).

    ``folder`` is the run directory, asked for earlier on every rank (``run_dir``); None
    writes no file. Returns the file written.
    """
    if not trainer.is_global_zero:
        return None
    path = write_report(folder, name, report) if folder is not None else None
    holders = [c.held_reports for c in trainer.callbacks if hasattr(c, "held_reports")]
    if not any(isinstance(h, HeldReports) and h.hold(name, report, lines) for h in holders):
        for line in lines:
            log.info("%s", line)
    return path
