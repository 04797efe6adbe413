"""The example LightningModule: a CIFAR ResNet trained with SGD, warm-up and cosine decay.

The training step reads nothing back to the host: loss and accuracy accumulate in
torchmetrics state on the device, and are reduced over ranks (one collective, on every
rank) only on the steps whose metrics Lightning writes, every ``log_every_n_steps``.

Example::

    model = ImageClassifier(num_classes=10, width=64)   # ResNet-18
    trainer.fit(model, datamodule=ImageDataModule())
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from gpu_busy import is_logging_step
from gpu_busy.errors import UserError
from template.models.resnet import cifar_resnet

# torch.compile's modes by name (its docstring): "default" fuses kernels; "reduce-overhead"
# adds CUDA graphs, one launch for the whole step; "max-autotune" also searches kernels.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _accuracy(num_classes: int) -> MulticlassAccuracy:
    # micro average + no validation: the update is a compare-and-sum on the device. The
    # defaults run argument checks and a bincount that read back to the host every step.
    return MulticlassAccuracy(num_classes, average="micro", validate_args=False)


def _mean() -> MeanMetric:
    # "disable": no NaN check, which would be an `if tensor.any()` (a host read) per update.
    return MeanMetric(nan_strategy="disable")


class ImageClassifier(pl.LightningModule):
    """Image classifier over :func:`cifar_resnet`.

    Args:
        num_classes: linked from the DataModule by the CLI.
        depth: 18 or 34; width: channels of the first stage (64 is the standard ResNet).
        lr: peak learning rate (after warm-up), for ``lr_batch_size`` images per step
            summed over ranks; scaled linearly to the actual global batch.
        channels_last: channels-last weights and inputs; ``None`` means on for CUDA, off
            under a sharding strategy (FSDP2 shards contiguous weights only).
        compile: wrap the network in ``torch.compile``: ``true`` (its default mode, which
            fuses kernels: for a step bound by the GPU's own work), or a mode by name,
            ``reduce-overhead`` (CUDA graphs: for a launch-bound step), ``max-autotune``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        depth: int = 18,
        width: int = 64,
        lr: float = 0.4,
        lr_batch_size: int = 256,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.0,
        warmup_fraction: float = 0.2,
        channels_last: bool | None = None,
        compile: bool | str = False,
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise UserError(f"model.lr must be greater than 0, got {lr}")
        if isinstance(compile, str) and compile not in COMPILE_MODES:
            raise UserError(
                f"model.compile must be true, false or one of {', '.join(COMPILE_MODES)}, "
                f"got {compile!r}"
            )
        for name, value, low, high in (
            ("momentum", momentum, 0.0, 1.0),
            ("weight_decay", weight_decay, 0.0, float("inf")),
            ("label_smoothing", label_smoothing, 0.0, 1.0),
        ):
            if not low <= value < high:
                raise UserError(f"model.{name} must be in [{low:g}, {high:g}), got {value}")
        if num_classes < 2:
            raise UserError(f"model.num_classes must be at least 2, got {num_classes}")
        if lr_batch_size < 1:
            raise UserError(
                f"model.lr_batch_size (the batch model.lr is given for) must be at least 1, "
                f"got {lr_batch_size}"
            )
        if not 0.0 < warmup_fraction < 1.0:
            raise UserError(f"model.warmup_fraction must be in (0, 1), got {warmup_fraction}")
        try:
            self.net = cifar_resnet(num_classes, depth=depth, width=width)
        except ValueError as e:
            raise UserError(f"model: {e}") from None
        self.save_hyperparameters()
        self.train_loss, self.train_acc = _mean(), _accuracy(num_classes)
        self.val_loss, self.val_acc = _mean(), _accuracy(num_classes)
        self._channels_last = False

    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by a sharding strategy (configs/fsdp.yaml), else None
        net = getattr(self.net, "_orig_mod", self.net)  # under torch.compile's wrapper
        if mesh is not None and not isinstance(net, FSDPModule):
            # FSDP2: each residual stage, then the rest, is one unit whose parameters are
            # all-gathered just before its forward (and backward) and freed after, so one
            # rank holds a stage's full weights at a time and a 1/N shard of the others,
            # of their gradients and of the optimizer's state.
            ranks = mesh["data_parallel"]
            for stage in net:
                if isinstance(stage, torch.nn.Sequential):
                    fully_shard(stage, mesh=ranks)
            fully_shard(net, mesh=ranks)
        mode = self.hparams.compile
        if mode and not isinstance(self.net, torch._dynamo.OptimizedModule):
            self.net = torch.compile(self.net, mode=None if mode is True else mode)

    def setup(self, stage: str) -> None:
        channels_last = self.hparams.channels_last
        sharded = self.device_mesh is not None  # FSDP2 shards contiguous parameters only
        if channels_last and sharded:
            raise UserError(
                "model.channels_last=true cannot be sharded (FSDP2 takes contiguous weights "
                "only): leave it null, which turns it off under a sharding strategy"
            )
        if channels_last is None:
            channels_last = self.trainer.strategy.root_device.type == "cuda" and not sharded
        self._channels_last = channels_last
        if channels_last:
            self.net.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self._channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), labels)
        if is_logging_step(self.trainer):
            # Mean over the steps since the last log, over all ranks: compute() all-gathers
            # on every rank; Lightning's logger then writes on rank zero. prog_bar=True
            # costs no sync under LoggingStepProgressBar (configs/default.yaml).
            self.log_dict(
                {"train/loss": self.train_loss.compute(), "train/acc": self.train_acc.compute()},
                prog_bar=True,
            )
            self.train_loss.reset()
            self.train_acc.reset()
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        # Per-sample losses: the mean is over images, with no weight to copy to the device
        # (a Python weight would be a blocking host-to-device copy per batch).
        self.val_loss.update(F.cross_entropy(logits, labels, reduction="none"))
        self.val_acc.update(logits, labels)

    # `python -m template.train test|predict --ckpt_path ...` of a trained checkpoint.
    def test_step(self, batch, batch_idx: int) -> None:
        images, labels = batch
        self.val_acc.update(self(images), labels)
        self.log("test/acc", self.val_acc)  # a metric object: computed at the epoch's end

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, _ = batch
        return self(images).argmax(dim=1)

    def on_validation_epoch_end(self) -> None:
        # Lightning calls compute() (reduced over ranks) and reset() on logged metric objects.
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def on_train_epoch_start(self) -> None:
        # Drop a partial interval left over from the last epoch so each logged mean is
        # over steps of one epoch.
        self.train_loss.reset()
        self.train_acc.reset()

    def configure_optimizers(self):
        hp = self.hparams
        global_batch = (
            self.trainer.world_size * self._batch_size() * self.trainer.accumulate_grad_batches
        )
        lr = hp.lr * global_batch / hp.lr_batch_size
        # No weight decay on BatchNorm and bias parameters (standard for ResNets).
        decay = [p for p in self.parameters() if p.ndim > 1]
        no_decay = [p for p in self.parameters() if p.ndim <= 1]
        optimizer = torch.optim.SGD(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay}],
            lr=lr,
            momentum=hp.momentum,
            nesterov=True,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up from lr/25, then a cosine decay to zero at the last step.

        The length is read from the trainer at every step, so a run resumed with a larger
        ``max_epochs`` stretches the schedule instead of failing past its end. A run with
        no end (``max_epochs=-1``, stopped by time or by hand) warms up over its first
        epoch, then keeps the peak rate.
        """
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            epoch = self.trainer.num_training_batches  # inf until the loader is built
            warmup = max(1, int(epoch)) if math.isfinite(epoch) else 1
            return 0.04 + 0.96 * step / warmup if step < warmup else 1.0
        total = max(1, int(total))
        warmup = max(1, int(total * self.hparams.warmup_fraction))
        if step < warmup:
            return 0.04 + 0.96 * step / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def _batch_size(self) -> int:
        datamodule = self.trainer.datamodule
        return getattr(datamodule, "batch_size", self.hparams.lr_batch_size)
