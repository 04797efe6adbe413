"""``self.log(..., prog_bar=True)`` under the template's bar: no read of a logged value in a
steady step, one copy at a logging step, and every logger, checkpoint and stopping rule
sees what Lightning alone would show it (``lightning_compat.prog_bar_numbers_when_read``)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from bench.logged_reads import LOGGED_VALUE_READERS, ThreeOnTheBar, counted_fit
from gpu_busy.callbacks import LoggingStepProgressBar, SyncPointDetector
from tests.conftest import DEBUG, DEFAULT, run_entry_point
from tests.helpers.logged_values import RecordLogged
from tests.helpers.trainers import quiet_trainer


class LogsEverything(BoringModel):
    """The ways people log: prog_bar values on the step, on the step and the epoch, an int,
    a torchmetrics object logged directly, a value for the epoch alone, validation."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        loss = out["loss"]
        self.log("pb/loss", loss, prog_bar=True)
        self.log("pb/both", loss * 2, prog_bar=True, on_step=True, on_epoch=True)
        self.log("pb/index", torch.tensor(batch_idx, device=self.device), prog_bar=True)
        self.log("plain/epoch", loss * 3, on_step=False, on_epoch=True)
        self.mean.update(loss.detach())
        self.log("pb/mean", self.mean, prog_bar=True)
        return out

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val/loss", loss, prog_bar=True)


def _fit(tmp_path, name: str, ours: bool, logger_class=pl.loggers.CSVLogger):
    pl.seed_everything(0)
    model = LogsEverything()
    record = RecordLogged(path=None)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / name / "ckpt", monitor="val/loss", save_top_k=2)
    stop = EarlyStopping(monitor="pb/both_epoch", patience=1, min_delta=1e9)  # stops early
    bar = [LoggingStepProgressBar()] if ours else []
    trainer = quiet_trainer(
        max_epochs=4, limit_train_batches=8, limit_val_batches=2, log_every_n_steps=3,
        logger=logger_class(tmp_path / name, name="", version=""), enable_checkpointing=True,
        enable_progress_bar=True, callbacks=[*bar, checkpoint, stop, record],
    )  # fmt: skip
    trainer.fit(model)
    return trainer, record, checkpoint, stop


def _scores(checkpoint: ModelCheckpoint) -> list[float]:
    return sorted(float(v) for v in checkpoint.best_k_models.values())


def test_every_logger_checkpoint_and_stop_sees_what_lightning_alone_shows(tmp_path):
    ours = _fit(tmp_path, "ours", ours=True)
    plain = _fit(tmp_path, "plain", ours=False)
    (t1, r1, c1, s1), (t2, r2, c2, s2) = ours, plain
    assert r1.handed == r2.handed and len(r1.handed) > 6  # the same values, steps and types
    assert [type(v) for _, m in r1.handed for v in m.values()] == [
        type(v) for _, m in r2.handed for v in m.values()
    ]
    assert r1.seen == r2.seen
    csv = [(tmp_path / n / "metrics.csv").read_text() for n in ("ours", "plain")]
    assert csv[0] == csv[1] and "pb/index" in csv[0]
    assert {k: float(v) for k, v in t1.callback_metrics.items()} == {
        k: float(v) for k, v in t2.callback_metrics.items()
    }
    # read after the fit: numbers, as Lightning gives them
    assert t1.progress_bar_metrics == t2.progress_bar_metrics
    assert all(not isinstance(v, torch.Tensor) for v in t1.progress_bar_metrics.values())
    assert float(c1.best_model_score) == float(c2.best_model_score) and _scores(c1) == _scores(c2)
    assert (s1.stopped_epoch, s1.wait_count, float(s1.best_score)) == (
        s2.stopped_epoch, s2.wait_count, float(s2.best_score),
    )  # fmt: skip
    assert s1.stopped_epoch > 0  # the stopping rule acted, at the same epoch


def test_tensorboard_is_handed_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(name: str) -> dict:
        events = EventAccumulator(str(tmp_path / name))
        events.Reload()
        return {
            tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
        }

    _fit(tmp_path, "ours", ours=True, logger_class=pl.loggers.TensorBoardLogger)
    _fit(tmp_path, "plain", ours=False, logger_class=pl.loggers.TensorBoardLogger)
    ours, plain = scalars("ours"), scalars("plain")
    assert ours == plain and "pb/loss" in ours


def test_prog_bar_values_are_read_never_in_a_steady_step_and_once_at_a_logging_step():
    count = counted_fit(32, lightning_converts=False)
    logged_value_readers = LOGGED_VALUE_READERS  # Lightning's and ours
    assert count.logging == {9, 19, 29}  # and the epoch's end after step 31, not checked
    # Lightning hands the loggers a logging step's values after its callbacks' batch end:
    # counted with the step after it
    handed = {s + 1 for s in count.logging}
    for step in set(range(1, 31)) - handed:
        assert not logged_value_readers & set(count.by_step[step]), (step, count.by_step[step])
    for step in handed:
        reads = {k: n for k, n in count.by_step[step].items() if k in logged_value_readers}
        assert reads == {"numbers_in_one_copy": 1}, (step, count.by_step[step])


def test_strict_passes_a_module_with_three_prog_bar_values_under_the_template(tmp_path):
    from bench.host import default_config_parts

    callbacks, plugins = default_config_parts()
    callbacks = [c for c in callbacks if not isinstance(c, SyncPointDetector)]
    detector = SyncPointDetector(first_steps=100, strict=True)
    trainer = quiet_trainer(
        max_steps=25, log_every_n_steps=10, callbacks=[*callbacks, detector], plugins=plugins,
        logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=True,
        enable_progress_bar=True, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(ThreeOnTheBar())  # strict: a sync in a steady step would raise
    assert detector.report["steady_syncs_per_batch"] == 0
    sites = list(detector.table.sites.values())
    assert not [s for s in sites if "prog_bar=True" in s.code], sites
    # at each logging step, one copy of everything logged, named as Lightning's logging
    logged = [s for s in sites if s.function == "log_metrics"]
    assert [s.count for s in logged] == [2], sites  # steps 10 and 20 (the first is set-up)


class ReadsTheBarEveryBatch(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shown = trainer.progress_bar_metrics  # the reader the report must name


def test_a_callback_that_reads_progress_bar_metrics_every_batch_is_named_as_the_reader(
    tmp_path,
):
    detector = SyncPointDetector(first_steps=100)
    trainer = quiet_trainer(
        max_steps=8, log_every_n_steps=50, enable_progress_bar=True, default_root_dir=tmp_path,
        callbacks=[LoggingStepProgressBar(), ReadsTheBarEveryBatch(), detector],
    )  # fmt: skip
    trainer.fit(ThreeOnTheBar())
    (site,) = [s for s in detector.table.sites.values() if s.steady_count]
    assert site.filename == __file__ and "trainer.progress_bar_metrics" in site.code, site
    assert site.hint.startswith("reading trainer.progress_bar_metrics"), site.hint
    assert site.count == trainer.global_step  # one copy a step for three values


def test_every_row_the_set_logs_has_a_step_no_lower_than_the_last_logged(tmp_path):
    """Weights & Biases drops a row whose step is below the last one logged: the sync
    detector's counts of a window's earlier watched steps go before the others' rows."""
    import gpu_busy
    from template.models import ImageClassifier
    from tests.helpers.logged_values import RecordLogged
    from tests.syncs.test_sync_point_detector import _fit

    record = RecordLogged(path=None)
    _fit(tmp_path, ImageClassifier(width=4), [record, *gpu_busy.defaults()["callbacks"]],
         limit_train_batches=12, log_every_n_steps=4)  # fmt: skip
    steps = [step for step, _ in record.handed]
    assert any("syncs/count" in m for _, m in record.handed), record.handed
    assert steps == sorted(steps), steps


@pytest.mark.slow
def test_values_logged_with_sync_dist_reach_the_loggers_as_lightning_alone_hands_them(tmp_path):
    """prog_bar=True values reduced over two ranks: the template (its bar, which converts
    them when read and hands the loggers one copy) against Lightning's own callbacks only."""
    common = [
        "fit", "--config", DEFAULT, "--config", DEBUG,
        "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--model=tests.helpers.logged_values.SyncDistLogs",
        "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
        "--trainer.limit_train_batches=6", "--trainer.max_epochs=2",
        "--trainer.log_every_n_steps=2",
    ]  # fmt: skip
    record = "tests.helpers.logged_values.RecordLogged"
    runs = {
        "template": [*common, f"--trainer.callbacks+={record}"],
        "lightning": [*common, f"--trainer.callbacks=[{{class_path: {record}}}]"],
    }
    seen = {}
    for name, args in runs.items():
        (tmp_path / name).mkdir()
        result = run_entry_point(args, cwd=tmp_path / name)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        saved = json.loads((tmp_path / name / "logged.json").read_text())
        ours = ("pb/", "val/")  # the module's values, not the template's own figures
        seen[name] = (
            [[step, {k: v for k, v in m.items() if k.startswith(ours) or k == "epoch"}]
             for step, m in saved["handed"] if any(k.startswith(ours) for k in m)],
            {k: v for k, v in saved["callback_metrics"].items() if k.startswith(ours)},
        )  # fmt: skip
    assert seen["template"] == seen["lightning"]
    handed, end = seen["template"]
    assert len(handed) >= 6 and all(m["pb/rank"] == 0.5 for _, m in handed if "pb/rank" in m)
    assert {"pb/both_epoch", "val/loss"} <= end.keys()
