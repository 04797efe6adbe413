"""The default config's callbacks over code this project did not write: Lightning's own
demo modules, a module in the common template style (Adam, torchmetrics, prog_bar=True,
a scheduler), dict and custom-class batches, gradient accumulation, a validation loop,
and 2-process DDP through the entry point. Each fit must complete, print its reports and
write their files, leave the prefetcher in the state its batches allow, and report the
syncs the module really makes."""

from __future__ import annotations

import json
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import (
    BoringModel,
    ManualOptimBoringModel,
    RandomIterableDataset,
)
from lightning.pytorch.demos.lstm import LightningLSTM
from torch.utils.data import DataLoader, Dataset

from gpu_busy.callbacks import StreamPrefetcher, SyncPointDetector
from gpu_busy.idle.causes import thresholds
from gpu_busy.report.compare import main as compare_main
from tests.conftest import DEFAULT, ROOT, run_entry_point
from tests.helpers.foreign_modules import BlobClassifier, BlobData, SyntheticTransformer, tokens
from tests.helpers.trainers import default_callbacks, quiet_trainer


def fit(tmp_path, model, data=None, caplog=None, **trainer_args):
    callbacks = default_callbacks()
    settings = dict(
        max_epochs=1, limit_train_batches=8, limit_val_batches=2, log_every_n_steps=4,
        enable_progress_bar=True,  # the default config's bar is among the callbacks
        logger=pl.loggers.CSVLogger(tmp_path),
    )  # fmt: skip
    trainer = quiet_trainer(callbacks=callbacks, **{**settings, **trainer_args})
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)
    run = tmp_path / "lightning_logs" / "version_0"
    for line in ("verdict: bound by", "sync points:", "idle time:", "fit done in"):
        assert caplog.text.count(line) == 1, line
    for name in ("idle.json", "syncs.json", "prefetch.json", "run.json"):
        assert (run / name).is_file(), name
    # The verdict is one of the rule's causes, and the files it came from compare cleanly.
    assert json.loads((run / "run.json").read_text())["verdict"]["cause"] in {
        *thresholds(), "device"}  # fmt: skip
    assert compare_main([str(run), str(run), "--picture", ""]) == 0
    detector = next(c for c in callbacks if isinstance(c, SyncPointDetector))
    prefetcher = next(c for c in callbacks if isinstance(c, StreamPrefetcher))
    return detector, prefetcher, run


def steady_sites(detector: SyncPointDetector) -> list:
    return [s for s in detector.table.sites.values() if s.steady_count and not s.allowed]


# -- Lightning's own demos ------------------------------------------------------------


def test_boring_model_is_sync_free(tmp_path, caplog, accelerator):
    detector, prefetcher, _ = fit(tmp_path, BoringModel(), caplog=caplog, accelerator=accelerator)
    assert steady_sites(detector) == [] and prefetcher.report["batches"] == 8


def test_manual_optimisation(tmp_path, caplog, accelerator):
    detector, prefetcher, _ = fit(
        tmp_path, ManualOptimBoringModel(), caplog=caplog, accelerator=accelerator
    )
    assert steady_sites(detector) == [] and prefetcher.report["batches"] == 8


class IterableBoring(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomIterableDataset(32, 8), batch_size=None)


def test_an_iterable_dataset_without_a_length(tmp_path, caplog, accelerator):
    detector, prefetcher, _ = fit(
        tmp_path, IterableBoring(), caplog=caplog, accelerator=accelerator
    )
    assert steady_sites(detector) == [] and prefetcher.report["batches"] == 8


def test_the_transformer_demo_copies_its_mask_to_the_device_every_step(
    tmp_path, caplog, accelerator
):
    detector, _, _ = fit(tmp_path, SyntheticTransformer(), caplog=caplog, accelerator=accelerator)
    sites = {(s.op.split(" ")[0], s.code) for s in steady_sites(detector)}
    # Its forward builds the causal mask on the host and copies it over, blocking, and
    # nn.Transformer checks whether that mask is causal with bool(tensor).
    assert (
        "Tensor.to",
        "mask = self.generate_square_subsequent_mask(t).to(inputs.device)",
    ) in sites
    assert any(op == "bool(tensor)" for op, _ in sites)
    assert all(s.location.startswith("lightning/pytorch/demos/") for s in steady_sites(detector))
    (causal_check,) = [s for s in steady_sites(detector) if s.op.startswith("bool(tensor)")]
    assert "is_causal=True" in causal_check.hint, causal_check.hint  # the fix, not "log it"


class LSTM(LightningLSTM):
    def __init__(self) -> None:
        super().__init__(vocab_size=100)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return tokens(1)


def test_the_lstm_demo_logs_its_prog_bar_loss_without_a_sync_under_the_template(
    tmp_path, caplog, accelerator
):
    detector, _, _ = fit(tmp_path, LSTM(), caplog=caplog, accelerator=accelerator)
    # self.log("train_loss", loss, prog_bar=True): Lightning alone converts it after every
    # step; under the template's bar it is converted only when read, and nothing reads it
    # in a steady step. (On a GPU machine cuDNN's LSTM reads back once, at the fit's first
    # step, which is set-up, not steady.)
    assert steady_sites(detector) == []
    assert detector.report["watched_batches"] >= 3


# -- modules in the common template style --------------------------------------------


class TemplateStyle(BlobClassifier):
    """Adam, torchmetrics called as functions, prog_bar=True, ReduceLROnPlateau."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val/loss", torch.nn.functional.cross_entropy(self.net(batch["x"]), batch["y"]))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"},
        }


def test_a_template_style_module_with_dict_batches_and_validation(tmp_path, caplog, accelerator):
    detector, prefetcher, run = fit(
        tmp_path, TemplateStyle(num_classes=5), BlobData(), caplog, accelerator=accelerator
    )
    # Adam's step counter is host memory: no sync. What syncs every step is torchmetrics'
    # bincount in its update; its prog_bar values are free under the template's bar.
    ops = {s.op for s in steady_sites(detector)}
    assert "Tensor.item()" not in ops and any(op.startswith("bincount") for op in ops), ops
    assert not any("adam" in (s.via or "") for s in steady_sites(detector))
    assert prefetcher.report["batches"] == 8 and prefetcher.report["unmoved_batches"] == 0
    assert json.loads((run / "syncs.json").read_text())["summary"]["steady_syncs_per_batch"] > 0


class Pair:
    """A batch class that moves itself, as Lightning documents for custom batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device, non_blocking: bool = False) -> Pair:
        return Pair(self.x.to(device, non_blocking=non_blocking), self.y.to(device))


class _Points(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randint(0, 5, (64,), generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _pairs(items) -> Pair:
    return Pair(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


class PairModule(BlobClassifier):
    """Sync-free: metrics logged without prog_bar, as a metric object."""

    def training_step(self, batch: Pair, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch.x), batch.y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Pair, batch_idx):
        self.val_acc.update(self.net(batch.x), batch.y)
        self.log("val/acc", self.val_acc)

    def train_dataloader(self):
        return DataLoader(_Points(), batch_size=8, collate_fn=_pairs)

    val_dataloader = train_dataloader


def test_a_custom_batch_class_with_gradient_accumulation(tmp_path, caplog, accelerator):
    detector, prefetcher, _ = fit(
        tmp_path,
        PairModule(num_classes=5),
        caplog=caplog,
        accumulate_grad_batches=2,
        accelerator=accelerator,
    )
    # Its .to takes non_blocking: the prefetcher moves it with it, on the side stream.
    assert prefetcher.report["unmoved_batches"] == 0 and prefetcher.report["batches"] == 8
    assert prefetcher.report["copy_ms"] is not None
    # y's copy ignores non_blocking, so it blocks: on a GPU machine a wait per batch, and
    # the simulation finds it at the same line.
    (site,) = steady_sites(detector)
    assert site.op.startswith("Tensor.to") and site.code.startswith("return Pair("), site
    # Batches and optimizer steps told apart: 8 batches made 4 steps.
    assert "8 of 8 training batches watched (4 optimizer steps)" in caplog.text
    assert "8 training batches" in caplog.text and "4 steps" in caplog.text


# -- 2-process DDP through the entry point ---------------------------------------------


@pytest.mark.slow
def test_a_foreign_module_under_two_process_ddp_with_one_slow_rank(tmp_path):
    # The foreign module, with rank 1 made 40 ms slower per step (tests.helpers.bound_runs): every
    # report is written once from both ranks' figures, and the verdict names that rank.
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", str(ROOT / "configs" / "debug.yaml"),
         "--model.class_path=tests.helpers.bound_runs.SlowRankClassifier",
         "--data.class_path=tests.helpers.foreign_modules.BlobData",
         "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=3",
         "--trainer.limit_train_batches=null"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stderr
    for line in ("verdict:", "sync points:", "idle time:", "prefetch:", "fit done in"):
        assert out.count(line) == 1, line  # once, by rank zero, from both ranks' figures
    assert "over 2 process(es)" in out
    (verdict,) = [x for x in out.splitlines() if "verdict:" in x]
    assert "one slow rank: rank 1" in verdict, verdict
    run = tmp_path / "runs" / "debug" / "version_0"
    assert json.loads((run / "idle.json").read_text())["world_size"] == 2
    summary = json.loads((run / "run.json").read_text())
    assert summary["verdict"]["cause"] == "slow_rank" and summary["world_size"] == 2
