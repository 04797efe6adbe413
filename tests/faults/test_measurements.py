"""A measurement never ends a fit: each measuring callback of the default config, made to
fail inside, costs one warning and an "n/a", and the fit trains to its last step."""

from __future__ import annotations

import json
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from bench.host import default_config_parts
from gpu_busy.callbacks import SyncPointDetector
from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.idle import IdleStats, StepTimer
from gpu_busy.prefetch import PrefetchStats
from gpu_busy.report import run as run_report
from gpu_busy.syncs.watched_steps import WatchedSteps
from gpu_busy.throughput import ThroughputStats
from tests.helpers.trainers import quiet_trainer


def _broken(*args, **kwargs):
    raise ValueError("a bug in the measurement")


# (what breaks, the measurement's label, the n/a line its report leaves, if it has one)
BREAKS = {
    "idle": (IdleStats, "add_step", "idle time", "idle: n/a"),
    "throughput": (ThroughputStats, "add_step", "throughput", "throughput: n/a"),
    "syncs": (WatchedSteps, "step_ends", "sync detection", "syncs: n/a"),
    "prefetch": (PrefetchStats, "means", "prefetch figures", "prefetch: n/a"),
    "clock": (StepTimer, "poll", "the step clock", None),
    "summary": (run_report, "summary", "the run summary", None),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_failing_measurement_is_one_warning_and_the_fit_trains_on(
    name, tmp_path, monkeypatch, caplog
):
    owner, attr, label, na_line = BREAKS[name]
    monkeypatch.setattr(owner, attr, _broken)
    callbacks, plugins = default_config_parts()
    trainer = quiet_trainer(
        max_steps=12, log_every_n_steps=4, callbacks=callbacks, plugins=plugins,
        logger=CSVLogger(tmp_path), enable_checkpointing=True, enable_progress_bar=True,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="gpu_busy"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 12  # every step trained
    warned = [r.getMessage() for r in caplog.records if "stopped measuring" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(label), warned
    assert "ValueError" in warned[0] and "training goes on" in warned[0]
    if na_line:
        assert any(r.getMessage().startswith(na_line) for r in caplog.records), caplog.text


def test_under_strict_the_detector_fails_the_fit_as_a_check_must(tmp_path, monkeypatch):
    monkeypatch.setattr(WatchedSteps, "step_ends", _broken)
    trainer = quiet_trainer(max_steps=4, callbacks=[SyncPointDetector(strict=True)])
    with pytest.raises(ValueError, match="a bug in the measurement"):
        trainer.fit(BoringModel())
    assert not isinstance(torch.Tensor.item, type(_broken))  # its patches were undone


class _FailsAt(pl.Callback):
    """The user's code failing at step ``step`` (after its batch end)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("the user's bug")


@pytest.mark.parametrize("stop", ["SIGINT", "an error"])
def test_a_fit_cut_short_writes_the_reports_of_the_steps_it_ran(tmp_path, stop):
    """Ctrl+C (StopOnSignal saves and stops) or an error in one process: the run directory
    still gets run.json, syncs.json, idle.json and throughput.json for the steps it ran."""
    from tests.helpers.faults_probe import SignalAt

    callbacks, plugins = default_config_parts()
    cut = SignalAt(step=5, signal="SIGINT") if stop == "SIGINT" else _FailsAt(step=6)
    trainer = quiet_trainer(
        max_steps=40, log_every_n_steps=4, callbacks=[*callbacks, cut], plugins=plugins,
        logger=CSVLogger(tmp_path), enable_checkpointing=True, enable_progress_bar=True,
        default_root_dir=tmp_path,
    )  # fmt: skip
    raised = TrainingStopped if stop == "SIGINT" else RuntimeError
    with pytest.raises(raised):
        trainer.fit(BoringModel())
    run = tmp_path / "lightning_logs" / "version_0"
    for name in ("run", "syncs", "idle", "throughput"):
        assert (run / f"{name}.json").exists(), (name, sorted(p.name for p in run.iterdir()))
    summary = json.loads((run / "run.json").read_text())
    assert summary["steps"] == trainer.global_step < 40  # the steps it ran, not the plan
    idle = json.loads((run / "idle.json").read_text())
    assert idle["steps"] >= 1
    bar = next(c for c in callbacks if type(c).__name__ == "LoggingStepProgressBar")
    assert bar.train_progress_bar.disable  # closed: what follows starts on a line of its own


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "rank", "step", "na_line"),
    [
        ("idle", 1, 0, "idle: n/a (on rank 1: ValueError"),  # before the first window
        ("throughput", 0, 5, "throughput: n/a (ValueError"),  # mid-run, on rank zero
        ("idle", 1, 7, "idle: n/a (on rank 1: ValueError"),  # after the last window
    ],
)
def test_under_ddp_one_rank_s_failing_measurement_is_dropped_on_every_rank_and_the_fit_ends(
    tmp_path, name, rank, step, na_line
):
    """Two gloo ranks, 8 steps, a window every 4: the failure travels in the window's
    gather (or the end of training's), every rank drops the measurement together, rank
    zero warns once, the report is n/a, and every step trains."""
    from tests.conftest import DEBUG, DEFAULT, HANG_S, run_entry_point

    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
         "--trainer.devices=2", "--trainer.limit_train_batches=8",
         "--trainer.log_every_n_steps=4",
         "--trainer.callbacks+=tests.helpers.faults_probe.BreakMeasurement",
         f"--trainer.callbacks.init_args.name={name}", f"--trainer.callbacks.init_args.rank={rank}",
         f"--trainer.callbacks.init_args.step={step}"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    warned = [line for line in output.splitlines() if "stopped measuring" in line]
    assert len(warned) == 1, warned
    assert f"stopped measuring on rank {rank} (ValueError" in warned[0]
    assert "n/a on every rank, and training goes on" in warned[0]
    assert any(na_line in line for line in output.splitlines()), output[-3000:]
    assert "8 steps over 2 process(es)" in output  # every step trained, on both ranks
