"""SyncPointDetector and the sync-free default step, in real fits on the CPU."""

from __future__ import annotations

import csv
import json
import logging
import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from gpu_busy.callbacks import LoggingStepProgressBar, SyncPointDetector
from gpu_busy.syncs import SyncError, assert_no_syncs
from gpu_busy.syncs.rules import LIGHTNING_READS
from gpu_busy.syncs.sampling import WatchSchedule
from template.data import ImageDataModule
from template.models import ImageClassifier, classifier
from tests.conftest import DEBUG, DEFAULT, ROOT, cli_main
from tests.helpers.trainers import quiet_trainer


def _fit(tmp_path, model, callbacks, lightnings_bar=False, **trainer_args):
    """A fit under the template's bar, or Lightning's (it reads prog_bar metrics after every
    step: a sync to see)."""
    defaults = dict(
        max_epochs=1,
        limit_train_batches=12,
        limit_val_batches=1,
        log_every_n_steps=5,
        enable_progress_bar=True,
        logger=pl.loggers.CSVLogger(tmp_path),
        default_root_dir=tmp_path,
    )
    has_bar = lightnings_bar or any(isinstance(c, LoggingStepProgressBar) for c in callbacks)
    bar = [] if has_bar else [LoggingStepProgressBar()]
    trainer = quiet_trainer(callbacks=[*bar, *callbacks], **{**defaults, **trainer_args})
    data = ImageDataModule(
        batch_size=8, synthetic_train_size=128, synthetic_val_size=16, num_workers=0
    )
    trainer.fit(model, data)
    return trainer


class ItemInStep(ImageClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()  # the user's sync
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        batch[1].sum().item()  # in validation: not a training step, not watched


def test_reports_the_users_line_with_a_fix_once(tmp_path, caplog):
    detector = SyncPointDetector(first_steps=100)  # watch every step
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path, ItemInStep(width=4), [detector], max_epochs=2)
    sites = [s for s in detector.table.sites.values() if s.function == "training_step"]
    user = [s for s in sites if "self.last_loss = loss.item()" in s.code]
    assert len(user) == 1
    (site,) = user
    assert site.filename == __file__ and site.op == "Tensor.item()"
    assert site.count == 24  # every step of both epochs, once
    # not steady: the fit's first step (set-up), logging steps 4, 9, 14, 19 and the windows
    # right after them (Lightning writes then)
    assert site.steady_count == 24 - 1 - 8
    assert "self.log" in site.hint
    assert not [s for s in detector.table.sites.values() if "batch[1]" in s.code]
    report = [r.getMessage() for r in caplog.records if "sync points:" in r.getMessage()]
    assert len(report) == 1 and "24 of 24 training batches watched" in report[0]
    assert any("self.last_loss = loss.item()" in r.getMessage() for r in caplog.records)
    saved = json.loads((tmp_path / "lightning_logs" / "version_0" / "syncs.json").read_text())
    assert saved["summary"]["watched_batches"] == 24
    codes = [s["code"] for s in saved["sites"]]
    assert "self.last_loss = loss.item()  # the user's sync" in codes
    with (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("syncs/count")]
    assert len(rows) == 20  # the watched steps up to the last logging step
    assert all(float(r["syncs/count"]) >= 1 for r in rows)
    assert trainer.global_step == 24


def test_strict_stops_at_the_first_sync_naming_the_line(tmp_path):
    with pytest.raises(SyncError, match=r"Tensor\.item\(\) at .*test_sync_point_detector.py"):
        _fit(tmp_path, ItemInStep(width=4), [SyncPointDetector(strict=True)])


def test_default_sampling_stays_within_budget_and_watches_the_first_steps(tmp_path):
    detector = SyncPointDetector(first_steps=3)
    _fit(tmp_path, ImageClassifier(width=4), [detector], limit_train_batches=16, max_epochs=2)
    report = detector.report
    assert report["batches"] == 32
    assert 3 <= report["watched_batches"] < 32
    assert report["interval"] is not None and report["interval"] >= 2
    # measured, or (a loaded machine) a watched batch within the others' spread: said so
    assert report["watched_batch_overhead"] is not None or report["overhead_within_spread"]


def test_a_short_fit_watches_one_batch_and_says_so_up_front(tmp_path, caplog):
    detector = SyncPointDetector()  # 3 first batches, fewer where the budget needs it
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, ImageClassifier(width=4), [detector], limit_train_batches=16)
    assert "a fit of 16 batches is too short to keep even one watched batch" in caplog.text
    # One always-watched batch, the second; how many more the measured cost allows
    # depends on the machine's load (a loaded one can measure a watched batch as free).
    assert (detector.schedule.first_at, detector.schedule.first) == (1, 1)
    assert detector.report["watched_batches"] >= 1


@pytest.mark.slow  # about 5 s on 2 cores: a fit of many batches
def test_the_default_config_step_is_sync_free_in_steady_state(tmp_path, monkeypatch):
    """Every sync the CPU simulation sees outside logging steps is a simulation artefact."""
    from gpu_busy.callbacks import sync_point_detector

    main = cli_main()

    # Watch every step (the configured budget would watch only the first few here).
    class WatchAll(sync_point_detector.WatchSchedule):
        def __init__(self, budget, first):
            super().__init__(budget=budget, first=1000)

        def plan_fit(self, steps):
            return True

    monkeypatch.setattr(sync_point_detector, "WatchSchedule", WatchAll)
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "fit", "--config", DEFAULT, "--config", DEBUG,
            "--trainer.limit_train_batches=12", "--trainer.max_epochs=2",
            "--trainer.log_every_n_steps=5", "--data.num_workers=2",
        ]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((tmp_path / "runs" / "debug" / "version_0" / "syncs.json").read_text())
    assert saved["summary"]["watched_batches"] == 24
    # The template's step is sync-free in steady state, in the CPU simulation too: the batch
    # transfer is a move to the device, not a read.
    assert not [s for s in saved["sites"] if s["steady_count"]], saved["sites"]
    assert saved["summary"]["steady_syncs_per_batch"] == 0
    # Logging steps do read back (the model's metrics, Lightning's logger conversion).
    assert [s for s in saved["sites"] if not s["steady_count"]]
    # This package's callbacks read nothing back at logging steps either: the NaN flag and
    # the bar's values reach the host in copies nothing waits for (LateRead).
    ours = [s for s in saved["sites"] if "gpu_busy/" in s["filename"]]
    assert not ours, ours


def test_the_example_training_step_is_sync_free(no_syncs, monkeypatch):
    """Augmentation, forward, loss, metrics, backward and optimizer step: no host reads."""
    model = ImageClassifier(num_classes=10, width=4)
    # A step between logging steps (at a logging step the metrics are read, by design).
    monkeypatch.setattr(classifier, "is_logging_step", lambda trainer: False)
    monkeypatch.setattr(ImageClassifier, "trainer", property(lambda self: None))
    data = ImageDataModule(batch_size=8)
    data.trainer = types.SimpleNamespace(training=True)  # random crop and flip on
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    batch = (images, torch.randint(0, 10, (8,)))

    def step():
        augmented = data.on_after_batch_transfer(batch, 0)
        loss = model.training_step(augmented, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    loss = assert_no_syncs(step)
    with no_syncs(device_type="cpu"):
        step()
    # the accumulated metrics are right once read
    assert model.train_loss.update_count == 2 and torch.isfinite(loss)


def test_progress_bar_sends_metrics_after_logging_steps_and_reads_only_at_the_epoch_end(tmp_path):
    reads, sends = [], []

    class CountingBar(LoggingStepProgressBar):
        def _read(self, trainer):
            reads.append((trainer.training, trainer.global_step))
            return super()._read(trainer)

        def _send(self, trainer, metrics):
            sends.append(trainer.global_step)
            return super()._send(trainer, metrics)

    bar = CountingBar(refresh_rate=1, min_interval=0)
    _fit(tmp_path, ImageClassifier(width=4), [bar], limit_val_batches=0)
    # the step after each logging step (every 5th; global_step has moved on by then) sends
    # the logged values on their way; only the epoch's end reads, where the loop waits anyway
    assert sends == [6, 11], sends
    assert sorted({step for training, step in reads if training}) == [12], reads
    assert "train/loss" in bar._shown


def test_a_second_fit_reports_its_own_sites_only(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    for run in ("first", "second"):
        _fit(tmp_path / run, ItemInStep(width=4), [detector])
        (site,) = [s for s in detector.table.sites.values() if "self.last_loss" in s.code]
        assert site.count == 12 and detector.report["watched_batches"] == 12


class LogsEveryStep(pl.LightningModule):
    """Sync-free, in the plain style: self.log of the loss at every step, no prog_bar."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LogsAndReads(LogsEveryStep):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen = loss.item()
        return loss


def test_strict_passes_a_sync_free_module_that_logs_every_step(tmp_path):
    detector = SyncPointDetector(strict=True, first_steps=100)
    trainer = quiet_trainer(
        max_epochs=1,
        log_every_n_steps=5,
        callbacks=[detector],
        logger=pl.loggers.CSVLogger(tmp_path),
    )
    trainer.fit(LogsEveryStep())
    assert detector.report["watched_batches"] == 12
    # Neither Lightning's batch transfer nor self.log's state moves are reads; only the
    # logging steps read back (Lightning writing the metrics), and strict allows those.
    assert detector.report["steady_syncs_per_batch"] == 0
    assert all(not s.steady_count for s in detector.table.sites.values())


def test_strict_fails_a_module_that_reads_a_value_every_step(tmp_path):
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=5, callbacks=[SyncPointDetector(strict=True)]
    )
    with pytest.raises(SyncError, match=r"self\.seen = loss\.item\(\)"):
        trainer.fit(LogsAndReads())


class BinaryMetricOnProbabilities(LogsEveryStep):
    """A binary torchmetrics metric fed probabilities: on a CPU tensor it tests them with an
    if (a read), on a CUDA one with torch.where (none)."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import BinaryAccuracy

        self.accuracy = BinaryAccuracy(validate_args=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.accuracy(self.net(x).softmax(-1)[:, 1], y)
        return super().training_step(batch, batch_idx)


def test_a_strict_fit_with_a_cpu_only_read_passes_and_the_report_lists_it_apart(tmp_path, caplog):
    detector = SyncPointDetector(strict=True, first_steps=100)
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=5, callbacks=[detector], default_root_dir=tmp_path,
        logger=pl.loggers.CSVLogger(tmp_path),
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        trainer.fit(BinaryMetricOnProbabilities())
    assert detector.report["steady_syncs_per_batch"] == 0
    assert detector.report["cpu_only_sites"] == 1
    (site,) = detector.table.cpu_only()
    assert site.count == 12 and site.filename == __file__
    assert site.branch.startswith("CPU only: no sync on a GPU (torchmetrics/utilities/compute")
    assert site not in detector.table.ranked()
    lines = "\n".join(r.getMessage() for r in caplog.records)
    assert "seen only because this run is on the CPU (not counted above):" in lines
    saved = json.loads((tmp_path / "lightning_logs" / "version_0" / "syncs.json").read_text())
    assert [s["cpu_only"] for s in saved["cpu_only"]] == [True]
    assert not any(s["cpu_only"] for s in saved["sites"])


class SetsUpOnItsFirstForward(LogsEveryStep):
    """A layer that initialises on its first call and reads a value back then, once, as
    cuDNN's LSTM does on a GPU machine (its first forward: one scalar read)."""

    def training_step(self, batch, batch_idx):
        if not hasattr(self, "scale"):
            self.scale = float(batch[0].abs().max())  # once: the lazy set-up's read
        return super().training_step(batch, batch_idx)


def test_strict_passes_a_read_made_once_at_the_fits_first_step_and_reports_it(tmp_path):
    detector = SyncPointDetector(strict=True, first_steps=100)
    quiet_trainer(max_epochs=2, log_every_n_steps=5, callbacks=[detector]).fit(
        SetsUpOnItsFirstForward()
    )
    (site,) = [s for s in detector.table.sites.values() if s.filename == __file__]
    assert site.count == 1 and site.steps == [0] and site.steady_count == 0
    assert detector.report["steady_syncs_per_batch"] == 0


def test_strict_still_fails_a_read_every_step_at_the_second(tmp_path):
    detector = SyncPointDetector(strict=True, first_steps=100)
    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=5, callbacks=[detector])
    with pytest.raises(SyncError, match=r"self\.seen = loss\.item\(\)"):
        trainer.fit(LogsAndReads())
    assert trainer.global_step == 1  # step 0 set up; step 1 read again and stopped


class ReadsAroundTheTransfer(LogsEveryStep):
    """Reads the batch before its transfer (host memory on a GPU: no sync) and after it
    (device memory: a sync), as a GPU run has it."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.largest = float(batch[0].abs().max())  # on the host: free
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.smallest = float(batch[0].abs().min())  # on the device: a sync
        return batch


def test_a_batch_is_host_memory_until_lightning_moves_it(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    quiet_trainer(max_epochs=1, log_every_n_steps=5, callbacks=[detector]).fit(
        ReadsAroundTheTransfer()
    )
    sites = [s for s in detector.table.sites.values() if s.filename == __file__]
    assert [s.code for s in sites] == [
        "self.smallest = float(batch[0].abs().min())  # on the device: a sync"
    ], sites
    assert sites[0].steady_count > 0


def test_lightnings_own_reads_are_named_at_lightnings_line_not_where_fit_was_called(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    _fit(tmp_path, ImageClassifier(width=4), [detector])
    (site,) = detector.table.sites.values()
    # The logger connector's conversion at logging steps, one copy: no user frame asked for
    # it (the template's bar: the prog_bar values are not converted after each step).
    where = "lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py"
    assert site.location.startswith(where) and site.function == "log_metrics", site
    assert site.steady_count == 0 and "log_every_n_steps" in site.hint
    assert not [s for s in detector.table.sites.values() if s.filename == __file__]


def test_under_github_actions_the_users_sync_lines_are_annotated(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.chdir(ROOT)
    _fit(tmp_path, ItemInStep(width=4), [SyncPointDetector(first_steps=100)])
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("::")]
    # The user's own line only: not Lightning's reads, not this package's allowed ones.
    assert len(out) == 1 and out[0].startswith(
        "::warning file=tests/syncs/test_sync_point_detector.py"
    )
    assert "Tensor.item()" in out[0]


class ReadsAtBatchEnd(pl.Callback):
    """A user's callback, listed before the detector, reading the loss after the step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = outputs["loss"].item()  # after the optimizer step


def test_a_read_after_the_optimizer_step_is_not_labelled_the_step(tmp_path):
    detector = SyncPointDetector(overhead_budget=1.0)  # every step watched
    _fit(tmp_path, ImageClassifier(width=4), [ReadsAtBatchEnd(), detector])
    phases = {s.phase for s in detector.table.sites.values() if "outputs" in s.code}
    assert phases == {"after optimizer step"}, detector.table.sites


class ProgBarLoss(ImageClassifier):
    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self(images), labels)
        self.log("train/loss_pb", loss, prog_bar=True)  # the line Lightning's read stands for
        return loss


def test_a_prog_bar_metric_is_reported_at_its_self_log_line_on_a_short_fit(tmp_path, caplog):
    """Lightning converts it after the step, in its own loop; the report names the line that
    logged it. A 40-batch fit can afford one watched batch: a whole one, which sees it."""
    detector = SyncPointDetector()
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, ProgBarLoss(width=4), [detector], limit_train_batches=40,
             log_every_n_steps=50, lightnings_bar=True)  # fmt: skip
    assert detector.report["watched_batches"] == 1
    sites = [s for s in detector.table.sites.values() if s.steady_count]
    for site in sites:
        assert site.filename == __file__ and "prog_bar=True)  # the line" in site.code
        assert site.function == "training_step" and site.count == 1
    # Two conversions a step, each named by who asked for it (its via), with its own fix:
    # the progress bar's refresh, and Lightning's loop after the step.
    by_reader = {s.via.split(":")[0]: s.hint for s in sites}
    assert by_reader.keys() == {
        "lightning/pytorch/callbacks/progress/progress_bar.py",
        "lightning/pytorch/loops/training_epoch_loop.py",
    }, by_reader
    assert (
        "LoggingStepProgressBar"
        in by_reader["lightning/pytorch/callbacks/progress/progress_bar.py"]
    )
    assert by_reader["lightning/pytorch/loops/training_epoch_loop.py"].startswith("drop prog_bar")
    assert detector.report["steady_syncs_per_batch"] == 2


def test_strict_fails_at_the_self_log_line_of_a_prog_bar_metric(tmp_path):
    """One site, one fix: the strict error's is the report's, and it fits a line that
    already logs with self.log."""
    with pytest.raises(
        SyncError, match=r"at .*test_sync_point_detector.py:\d+ in training_step"
    ) as raised:
        _fit(tmp_path, ProgBarLoss(width=4), [SyncPointDetector(strict=True)], lightnings_bar=True)
    fix = str(raised.value).split("; fix: ")[1]
    assert fix.startswith("drop prog_bar=True from this self.log") and "log the tensor" not in fix
    (reported,) = [h for marker, h in LIGHTNING_READS if marker == "in on_batch_end"]
    assert fix == reported
    assert pl.LightningModule.log.__module__ == "lightning.pytorch.core.module"  # unwrapped


class ReadsInItsHooks(ImageClassifier):
    """A per-step read in the module's own hooks around the step: the step's sync too."""

    hook = "on_train_batch_end"

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.hook == "on_train_batch_end":
            self.last = outputs["loss"].item()  # the hook's read

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.hook == "on_before_batch_transfer" and self.trainer.training:
            self.seen = self.net[0].weight.sum().item()  # the transfer hook's read
        return batch


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_before_batch_transfer"])
def test_strict_fails_a_read_in_the_modules_own_hooks_between_steps(tmp_path, hook):
    model = ReadsInItsHooks(width=4)
    model.hook = hook
    with pytest.raises(SyncError, match=r"the hook's read|the transfer hook's read"):
        _fit(tmp_path, model, [SyncPointDetector(strict=True)])


class ReadsParameters(pl.Callback):
    """A callback's own per-step read, in any of its batch hooks."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = float(next(pl_module.parameters()).sum())

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.during = float(next(pl_module.parameters()).sum())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after = float(next(pl_module.parameters()).sum())


def test_strict_never_fails_a_callbacks_hooks_wherever_it_sits_in_the_list(tmp_path):
    """Callbacks before and after the detector, and a checkpoint every 2 steps: their
    reads are counted in the report, never a failure of the step."""
    save = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    detector = SyncPointDetector(strict=True, first_steps=100)
    callbacks = [ReadsParameters(), detector, ReadsParameters(), save]
    _fit(tmp_path, ImageClassifier(width=4), callbacks, enable_checkpointing=True)
    assert detector.report["watched_batches"] == 12
    assert any("ReadsParameters" in (s.code or "") or "float(" in (s.code or "")
               for s in detector.table.sites.values())  # fmt: skip


def test_a_cpu_fit_moves_as_to_cuda_only_while_it_runs(tmp_path):
    from lightning.fabric.utilities import apply_func

    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.append(apply_func._BLOCKING_DEVICE_TYPES)

    before = apply_func._BLOCKING_DEVICE_TYPES
    trainer = quiet_trainer(max_steps=3, callbacks=[SyncPointDetector(), Spy()])
    trainer.fit(LogsEveryStep())
    assert seen and all("cpu" not in blocking for blocking in seen), seen
    assert apply_func._BLOCKING_DEVICE_TYPES == before == ("cpu", "mps")


def test_under_ddp_the_report_says_which_figures_are_per_rank_and_which_are_summed():
    # A 2-rank report once printed "96 of 96 training batches watched" over site counts of
    # 192x, with nothing to say the first is one rank's and the second both ranks'.
    from gpu_busy.report.syncs import end_of_fit
    from gpu_busy.syncs.attribution import SyncEvent
    from gpu_busy.syncs.sampling import WatchedSums
    from gpu_busy.syncs.sites import SyncSiteTable

    tables = []
    for _rank in range(2):
        table = SyncSiteTable()
        for step in range(96):
            table.add_all([SyncEvent(".item()", "model.py", 12)], step=step, logging=False)
        tables.append(table)
    tables[0].merge(tables[1].rows())
    totals = WatchedSums(watched=192, syncs=192, steady_watched=192, steady_syncs=192)
    _, lines = end_of_fit(
        tables[0], totals, world_size=2, batches=96, optimizer_steps=96,
        costs=(None, None), budget=0.01, interval=1, fit_seconds=10.0,
    )  # fmt: skip
    assert "96 of 96 training batches watched per rank;" in lines[0]
    assert "1.00 syncs/batch" in lines[0]
    assert "  counts below are summed over the 2 ranks" in lines
    assert any(line.strip().startswith("192x  model.py:12") for line in lines), lines
    _, one = end_of_fit(
        tables[1], WatchedSums(96, 96, 96, 96), world_size=1, batches=96, optimizer_steps=96,
        costs=(None, None), budget=0.01, interval=1, fit_seconds=10.0,
    )  # fmt: skip
    assert "96 of 96 training batches watched;" in one[0]
    assert not any("summed over" in line for line in one)


def test_a_strict_fit_that_watched_no_steady_step_fails_saying_it_checked_nothing(tmp_path):
    # A CI test fitting one batch under strict=True once passed whatever that batch synced:
    # the first step is set-up, and strict leaves it out. A gate that checked nothing fails.
    model = ItemInStep(width=4)
    with pytest.raises(SyncError, match=r"strict=True\) checked no step: .*first_steps="):
        _fit(tmp_path, model, [SyncPointDetector(strict=True)], limit_train_batches=1)
    detector = SyncPointDetector(strict=True)  # one that checks a step and finds none passes
    _fit(tmp_path, ImageClassifier(width=4), [detector], limit_train_batches=3)
    assert detector.report["steady_watched_batches"] >= 1, detector.report


class ReplayBuffer(ImageClassifier):
    """A replay buffer of host tensors made in __init__, as the UvA energy-based model keeps
    one: Module.to moves parameters and buffers, not a list, so on a GPU each step copies
    the samples over, blocking."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.examples = [torch.rand(2, 3, 32, 32) for _ in range(4)]
        self.unused_metric_copy = torch.zeros(1)

    def replay(self) -> torch.Tensor:
        return torch.cat(self.examples).to(self.device)  # the blocking copy

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.0 * self(self.replay()).sum()


def test_tensors_made_in_init_outside_parameters_are_host_memory_in_the_simulation(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    _fit(tmp_path, ReplayBuffer(width=4), [detector], limit_train_batches=6)
    (site,) = [s for s in detector.table.sites.values() if "torch.cat(self.examples)" in s.code]
    assert site.count == 6 and "copy" in site.op.lower(), site.op
    # torchmetrics' states are moved by its own _apply: still device memory, no sync
    from gpu_busy.syncs.memory import held_outside_parameters

    held = held_outside_parameters(ReplayBuffer(width=4))
    assert len(held) == 5  # the four examples and the plain tensor; no metric state


class _Sampler:
    """A helper object of the user's own holding a replay buffer (the UvA energy-based
    model's ``self.sampler.examples``)."""

    def __init__(self) -> None:
        self.examples = [torch.rand(2, 3, 32, 32) for _ in range(3)]


class HelperReplay(ReplayBuffer):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        del self.examples
        self.sampler = _Sampler()
        self.data = torch.utils.data.TensorDataset(torch.zeros(4))  # a framework's object

    def replay(self) -> torch.Tensor:
        return torch.cat(self.sampler.examples).to(self.device)  # the blocking copy


def test_tensors_a_helper_object_holds_are_host_memory_as_the_modules_own_are(tmp_path):
    from gpu_busy.syncs.memory import held_outside_parameters

    held = held_outside_parameters(HelperReplay(width=4))
    assert len(held) == 4  # the helper's three examples and the plain tensor, no dataset's
    detector = SyncPointDetector(first_steps=100)
    _fit(tmp_path, HelperReplay(width=4), [detector], limit_train_batches=4)
    (site,) = [s for s in detector.table.sites.values() if "sampler.examples" in s.code]
    assert site.count == 4 and "copy" in site.op.lower(), site.op


class _RefillingSampler:
    """The UvA energy-based model's sampler: each step takes old examples from its host
    buffer, copies them to the device, and puts the new ones back on the host (a no-op on
    a CPU, a device-to-host copy on a GPU), here through a device it keeps."""

    def __init__(self) -> None:
        self.examples = [torch.rand(2, 3, 32, 32) for _ in range(3)]
        self.host = torch.device("cpu")

    def sample(self, device: torch.device) -> torch.Tensor:
        fresh = torch.rand(2, 3, 32, 32)
        images = torch.cat([fresh, *self.examples[:2]]).to(device)  # blocking, every step
        self.examples = [*images.to(self.host).chunk(3), *self.examples][:3]
        return images


class RefillsItsBuffer(HelperReplay):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sampler = _RefillingSampler()

    def replay(self) -> torch.Tensor:
        return self.sampler.sample(self.device)


@pytest.mark.parametrize("watched", [range(6), (0, 3, 5)])
def test_a_buffer_a_helper_refills_every_step_is_host_memory_at_every_watched_step(
    tmp_path, watched
):
    """The energy-based model's two copies a step, to the device and back, in every watched
    step: those the buffer was refilled in, and those after unwatched refills."""
    detector = SyncPointDetector(first_steps=1)
    detector.schedule.should_watch = lambda step: step in watched
    _fit(tmp_path, RefillsItsBuffer(width=4), [detector], limit_train_batches=6)
    copies = [s for s in detector.table.sites.values() if "copy" in s.op.lower()]
    assert sorted(s.op for s in copies) == [
        "Tensor.to (a blocking copy to the device)", "Tensor.to (a blocking copy to the host)"
    ]  # fmt: skip
    assert [s.count for s in copies] == [len(watched)] * 2


class _Graph:
    """One whole graph, moved by its own ``.to`` with no ``non_blocking``: Lightning's
    transfer copies each field blocking (PyTorch Geometric's node-level training)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device):
        return _Graph(self.x.to(device), self.y.to(device))


class WholeGraph(pl.LightningModule):
    """One batch an epoch, as whole-graph training has: each step is an epoch's first."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.layer(batch.x), batch.y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        graph = _Graph(torch.randn(10, 4, generator=g), torch.randint(0, 2, (10,), generator=g))
        return torch.utils.data.DataLoader([graph], batch_size=None)


def test_an_epochs_first_batch_transfer_is_watched_as_whole_graph_training_needs(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    trainer = quiet_trainer(
        max_epochs=6, callbacks=[detector], logger=False, default_root_dir=tmp_path
    )
    trainer.fit(WholeGraph())
    copies = [s for s in detector.table.sites.values() if s.op.startswith("Tensor.to")]
    # x and y, blocking, at every step but the fit's first (set-up, not steady)
    assert sum(s.steady_count for s in copies) == 2 * 5, [(s.op, s.code) for s in copies]


class _Box:
    """A batch class whose .to takes non_blocking: the prefetcher moves it."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device, non_blocking: bool = False) -> _Box:
        return _Box(self.x.to(device, non_blocking=non_blocking))


class BoxedBoring(BoringModel):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch.x, batch_idx)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.randn(64, 32), batch_size=4, collate_fn=lambda rows: _Box(torch.stack(rows))
        )


def test_a_prefetched_batch_object_moved_again_by_lightning_is_no_sync(tmp_path):
    """On a GPU, Lightning's .to(device) of an object the prefetcher already moved is a no-op;
    the simulation must not count it (it did while every read was marked host memory)."""
    from bench.host import default_config_parts

    callbacks, plugins = default_config_parts()
    trainer = quiet_trainer(
        max_steps=24, log_every_n_steps=8, callbacks=callbacks, plugins=plugins,
        logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=True,
        enable_progress_bar=True, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoxedBoring())
    detector = next(c for c in callbacks if isinstance(c, SyncPointDetector))
    prefetcher = next(c for c in callbacks if type(c).__name__ == "StreamPrefetcher")
    assert prefetcher.report["unmoved_batches"] == 0 and detector.report["watched_batches"]
    assert detector.report["steady_syncs_per_batch"] == 0, list(detector.table.sites.values())


class _EveryOtherStep(WatchSchedule):
    """Watches odd steps only: each watched step's batch was read ahead by Lightning's
    fetcher in the unwatched step before it."""

    def should_watch(self, step: int) -> bool:
        return step % 2 == 1


class _Graphs(torch.utils.data.IterableDataset):
    """Eight graphs, from a loader without a length: Lightning's fetcher reads one ahead."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(8):
            yield _Graph(torch.randn(10, 4, generator=g), torch.randint(0, 2, (10,), generator=g))


class GraphBatches(WholeGraph):
    """Batches of a class whose .to takes no non_blocking: Lightning copies each field
    blocking (2 a step), whenever the DataLoader collated the batch."""

    def __init__(self, sized: bool) -> None:
        super().__init__()
        self.sized = sized

    def train_dataloader(self):
        graphs = list(_Graphs()) if self.sized else _Graphs()
        return torch.utils.data.DataLoader(graphs, batch_size=None)


@pytest.mark.parametrize(
    "read_ahead_by", ["prefetcher", "lightning"], ids=["prefetcher-leaves-it", "unsized-loader"]
)
def test_a_batch_read_ahead_outside_a_watched_step_is_host_memory_until_moved(
    tmp_path, read_ahead_by
):
    from gpu_busy.callbacks import StreamPrefetcher

    detector = SyncPointDetector()
    detector.schedule = _EveryOtherStep()
    prefetching = read_ahead_by == "prefetcher"
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=100, logger=False, default_root_dir=tmp_path,
        callbacks=[detector, *([StreamPrefetcher()] if prefetching else [])],
    )  # fmt: skip
    trainer.fit(GraphBatches(sized=prefetching))
    copies = [s for s in detector.table.sites.values() if s.op.startswith("Tensor.to")]
    # steps 1, 3, 5, 7 watched; each moves x and y, read in the step before
    assert sum(s.count for s in copies) == 2 * 4, [(s.op, s.code, s.count) for s in copies]


def test_strict_from_the_command_line_fails_the_entry_points_fit_at_the_users_line(
    in_tmp, monkeypatch, capsys
):
    """``GPU_BUSY_STRICT_SYNCS=1 make train``: strict without editing the callback list."""
    from tests.conftest import DEBUG, DEFAULT, cli_main

    main = cli_main()
    args = ["fit", "--config", DEFAULT, "--config", DEBUG, "--data.num_workers=0",
            "--trainer.limit_train_batches=6", "--trainer.log_every_n_steps=50",
            "--model.class_path=tests.helpers.bound_runs.ItemImageClassifier"]  # fmt: skip
    monkeypatch.setenv("GPU_BUSY_STRICT_SYNCS", "1")
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: strict sync check failed: host-device sync: Tensor.item()")
    assert "bound_runs.py:117" in err and "fix: log the tensor with self.log" in err, err
    monkeypatch.setenv("GPU_BUSY_STRICT_SYNCS", "maybe")
    assert main(args) != 0
    assert "GPU_BUSY_STRICT_SYNCS='maybe': give 1" in capsys.readouterr().err


def test_strict_from_the_command_line_on_a_fit_too_short_to_check_a_step_exits_1(
    in_tmp, monkeypatch, capsys
):
    """The issue's CI job: ``GPU_BUSY_STRICT_SYNCS=1 make train`` on a one-batch fit exited
    0 whatever the step did. Now a fit that checked no step fails in one line saying how
    to check one, whether its model syncs or not (the test above: over enough batches a
    sync is caught at its line); a fit that checked a step and found no sync passes."""
    main = cli_main()
    args = ["fit", "--config", DEFAULT, "--config", DEBUG, "--data.num_workers=0",
            "--trainer.log_every_n_steps=50"]  # fmt: skip
    item = "--model.class_path=tests.helpers.bound_runs.ItemImageClassifier"
    monkeypatch.setenv("GPU_BUSY_STRICT_SYNCS", "1")
    for extra, says in (
        (["--trainer.max_steps=1"], "checked no step: "),
        ([item, "--trainer.max_steps=1"], "checked no step: "),
    ):
        assert main([*args, *extra]) == 1
        errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], errors
    assert main([*args, "--trainer.limit_train_batches=8"]) == 0
