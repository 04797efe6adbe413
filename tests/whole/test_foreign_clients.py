"""``strict`` and the callbacks on code in the styles people write
(tests/helpers/foreign_clients.py): each test names the headline it reads (syncs per
watched batch, batches moved, warnings, exit codes) and the GPU truth it holds that figure to."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import pytest
import torch

from gpu_busy.callbacks import BestCheckpoint, StreamPrefetcher, SyncPointDetector
from gpu_busy.syncs.rules import DDP_USED_MAP
from tests.conftest import DEBUG, DEFAULT, HANG_S, run_entry_point
from tests.helpers import foreign_clients as clients
from tests.helpers.trainers import quiet_trainer


def _fit(tmp_path, model, callbacks, ckpt_path=None, **trainer_args):
    settings = dict(max_epochs=2, default_root_dir=tmp_path)
    trainer = quiet_trainer(callbacks=callbacks, **{**settings, **trainer_args})
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _per_batch(detector: SyncPointDetector) -> float:
    return detector.totals.syncs / detector.totals.watched


def test_a_sync_free_module_logging_every_step_passes_strict_for_two_epochs(tmp_path):
    # Headline 0.00 syncs/batch; GPU truth 0 (the metric resets at each epoch copy device
    # to device). Every batch of both epochs is watched, each epoch after a validation.
    detector = SyncPointDetector(first_steps=1000, strict=True, log_stats=False)
    _fit(tmp_path, clients.LogsEveryStep(), [detector])
    assert detector.totals.watched == 16 and detector.totals.syncs == 0


def test_a_gan_moving_host_noise_with_type_as_reports_four_per_batch(tmp_path):
    # Headline 4.00 syncs/batch; GPU truth 4 blocking host-to-device copies.
    detector = SyncPointDetector(first_steps=1000, log_stats=False)
    _fit(tmp_path, clients.NoiseByTypeAs(), [detector], max_epochs=1)
    assert _per_batch(detector) == 4.0
    assert {s.op for s in detector.table.sites.values()} == {
        "Tensor.type_as (a blocking copy between host and device)"
    }


def test_a_resumed_adam_module_passes_strict(tmp_path):
    # Headline 0.00 syncs/batch after the resume; GPU truth 0 (Adam's loaded step counters
    # are host tensors: its .item() reads them on the host).
    first = _fit(tmp_path, clients.LogsEveryStep(), [], max_epochs=1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    detector = SyncPointDetector(first_steps=1000, strict=True, log_stats=False)
    _fit(tmp_path, clients.LogsEveryStep(), [detector], ckpt_path=tmp_path / "epoch1.ckpt")
    assert detector.totals.watched == 8 and detector.totals.syncs == 0


def test_a_metric_logged_in_validation_only_raises_no_warning(tmp_path, caplog):
    # Truth: val/acc is logged by every validation, so a best checkpoint is kept, silently.
    best = BestCheckpoint(dirpath=tmp_path / "best", monitor="val/acc", mode="max")
    with caplog.at_level(logging.WARNING):
        _fit(tmp_path, clients.LogsEveryStep(), [best], enable_checkpointing=True)
    assert "never logged" not in caplog.text
    assert best.best_model_path and Path(best.best_model_path).is_file()


def test_every_batch_of_an_iterable_dataset_is_moved(tmp_path):
    # Headline: batches 12, unmoved 0; truth 6 batches a pass, two passes.
    prefetcher = StreamPrefetcher(log_stats=False)
    _fit(tmp_path, clients.FromAStream(), [prefetcher], limit_val_batches=0)
    assert prefetcher.report["batches"] == 12 and prefetcher.report["unmoved_batches"] == 0


def test_a_pytorch_lightning_module_is_refused_in_one_line():
    # The older package's LightningModule is another class (not installed here: a class of
    # that name and module stands in for it).
    older = type("LightningModule", (torch.nn.Module,), {"__module__": "pytorch_lightning.core"})
    model = type("Tutorial", (older,), {})()
    trainer = types.SimpleNamespace(datamodule=None)
    with pytest.raises(TypeError, match=r"needs lightning\.pytorch objects") as caught:
        StreamPrefetcher().setup(trainer, model, "fit")
    message = str(caught.value)
    assert "\n" not in message and "a pytorch_lightning LightningModule" in message


@pytest.mark.slow
def test_a_numpy_schedule_saves_a_checkpoint_that_resumes(tmp_path):
    # Truth: --ckpt_path last continues the run (exit 0), its learning rates as saved.
    args = ["fit", "--config", DEFAULT, "--config", DEBUG, "--data=null",
            "--model.class_path=tests.helpers.foreign_clients.NumpyCosine",
            "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"]  # fmt: skip
    first = run_entry_point([*args, "--trainer.max_epochs=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_entry_point([*args, "--trainer.max_epochs=2", "--ckpt_path=last"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "objects other than tensors" not in resumed.stderr


@pytest.mark.slow
def test_ddp_with_find_unused_parameters_reports_the_reducers_one_copy_per_backward(tmp_path):
    # Headline: DDP's reducer, 1.00 per batch; GPU truth: one blocking copy of the
    # used-parameter map per backward, and host reads of it (no sync).
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--data=null",
         "--model.class_path=tests.helpers.foreign_clients.UnusedBranch",
         "--trainer.accelerator=cpu", "--trainer.devices=2",
         "--trainer.strategy=ddp_find_unused_parameters_true",
         "--trainer.callbacks+=gpu_busy.callbacks.SyncPointDetector",
         "--trainer.callbacks.first_steps=1000"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("runs/*/version_0/syncs.json")).read_text())
    watched = report["summary"]["watched_batches"]  # per rank; a site's count sums ranks
    backward = {s["op"]: s["count"] for s in report["sites"] if s["phase"] == "backward"}
    assert watched >= 4 and backward == {DDP_USED_MAP[0]: 2 * watched}, (watched, backward)
    (site,) = [s for s in report["sites"] if s["op"] == DDP_USED_MAP[0]]
    assert "find_unused_parameters=False" in site["hint"]
