"""``strict=True`` on the shapes tutorials give a training loop: sync-free ones pass over
several epochs, with the scheduler, callbacks and batches they use; syncing ones fail at
their own line, with a fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from gpu_busy.callbacks import SyncPointDetector
from gpu_busy.syncs import SyncError
from tests.helpers.trainers import quiet_trainer


class Tutorial(pl.LightningModule):
    """Adam, ``self.log`` every step (no prog_bar), a scheduler as asked."""

    def __init__(self, schedule: str = "none") -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)
        self.schedule = schedule

    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.cross_entropy(self.layer(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        if self.schedule == "one-cycle":
            steps = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                              "interval": "step"}}  # fmt: skip
        if self.schedule == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}  # fmt: skip
        return optimizer


class LerpEma(Tutorial):
    """An EMA of the weights kept with ``lerp_`` in the module's own hook: no read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", self.layer.weight.detach().clone())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.lerp_(self.layer.weight.detach(), 0.01)


class AveragedEma(Tutorial):
    """torch's AveragedModel: ``update_parameters`` asks ``bool(n_averaged == 0)`` of a
    device buffer, a sync at every step on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.average = torch.optim.swa_utils.AveragedModel(self.layer)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.average.update_parameters(self.layer)  # the EMA's read


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(48):
            yield torch.randn(8, generator=g), torch.randint(0, 2, (), generator=g)


def _pairs() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 2, (48,), generator=g))


def _dicts(items):
    xs, ys = zip(*items, strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


def _fit(tmp_path, model, train, val=None, callbacks=(), **settings):
    detector = SyncPointDetector(strict=True, first_steps=1000)
    trainer = quiet_trainer(max_epochs=3, log_every_n_steps=5, default_root_dir=tmp_path,
                            callbacks=[detector, *callbacks], **settings)  # fmt: skip
    trainer.fit(model, train, val)
    return detector


CASES = {
    "adam": lambda: (Tutorial(), {}),
    "accumulation": lambda: (Tutorial(), {"accumulate_grad_batches": 2}),
    "one-cycle every step": lambda: (Tutorial("one-cycle"), {}),
    "plateau every epoch": lambda: (Tutorial("plateau"), {}),
    "SWA callback": lambda: (Tutorial(), {"callbacks": [
        StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)]}),
    "lerp EMA in the module's hook": lambda: (LerpEma(), {}),
    "a checkpoint every 2 steps, an LR monitor": lambda: (Tutorial("one-cycle"), {
        "callbacks": [ModelCheckpoint(every_n_train_steps=2, save_top_k=-1),
                      LearningRateMonitor()], "enable_checkpointing": True, "logger": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_free_tutorial_loop_passes_strict(tmp_path, case, accelerator):
    model, settings = CASES[case]()
    loader = DataLoader(_pairs(), batch_size=4)
    val = DataLoader(_pairs(), batch_size=4)
    detector = _fit(tmp_path, model, loader, val, accelerator=accelerator, **settings)
    assert detector.report["watched_batches"] == 36
    if accelerator == "gpu" and "checkpoint" in case:
        # Saving copies the weights to the host: real syncs, in ModelCheckpoint's hook
        # (outside strict's reach), at the checkpoint steps only (seen on a GPU machine).
        sites = [s for s in detector.table.sites.values() if s.steady_count]
        assert sites and all(step % 2 == 0 for s in sites for step in s.steps), sites
    else:
        assert detector.report["steady_syncs_per_batch"] == 0


def test_dict_batches_and_an_iterable_dataset_pass_strict(tmp_path, accelerator):
    pairs = list(zip(*_pairs().tensors, strict=True))
    dict_batches = DataLoader(pairs, batch_size=4, collate_fn=_dicts)
    dicts = _fit(tmp_path / "dicts", Tutorial(), dict_batches, accelerator=accelerator)
    stream = _fit(
        tmp_path / "stream", Tutorial(), DataLoader(Stream(), batch_size=4), accelerator=accelerator
    )
    for detector in (dicts, stream):  # every batch watched, none of them syncing
        assert detector.report["watched_batches"] == 36
        assert detector.report["steady_syncs_per_batch"] == 0


def test_an_averaged_model_ema_fails_strict_at_its_own_line(tmp_path, accelerator):
    with pytest.raises(SyncError, match=r"in on_train_batch_end: .*# the EMA's read; fix: "):
        _fit(tmp_path, AveragedEma(), DataLoader(_pairs(), batch_size=4), accelerator=accelerator)
