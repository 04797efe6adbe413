"""The example DataModule: uint8 images on the host, augmentation on the device.

Three sources behind one interface (``dataset=``):

- ``synthetic`` (default): shapes drawn from a seed, embedded, no download (``synthetic.py``);
- ``cifar10``: real CIFAR-10, downloaded into ``data_dir`` when online;
- ``folder``: your own images in ``data_dir/train/<class>/...`` and ``data_dir/val/<class>/...``.

Example::

    dm = ImageDataModule(dataset="cifar10", data_dir="data", batch_size=256)
    trainer.fit(model, datamodule=dm)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from gpu_busy.errors import UserError
from gpu_busy.faults.worker_signals import ignore_stop_signals
from gpu_busy.log import get_logger
from gpu_busy.resumable_data import ResumableData, shuffle_seed
from template.data.augment import CIFAR10_MEAN, CIFAR10_STD, DeviceAugment
from template.data.sources import FolderImages, InMemoryImages, load_cifar10
from template.data.synthetic import CLASSES as SYNTHETIC_CLASSES
from template.data.synthetic import make_shapes

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
# Per-channel statistics of ImageNet, a reasonable default for arbitrary photos.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

log = get_logger(__name__)


def default_num_workers(processes_per_node: int = 1, cap: int = 8) -> int:
    """Loader workers per training process: the cores this process may use, less one for it.

    Counted from the CPU affinity mask (what a container or ``taskset`` allows), not the
    machine's total, and shared between the training processes on the node.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(cap, cores // max(1, processes_per_node) - 1))


class ImageDataModule(ResumableData, pl.LightningDataModule):
    """Image classification data with device-side augmentation.

    Args:
        dataset: ``synthetic``, ``cifar10`` or ``folder``.
        data_dir: where CIFAR-10 lives (or is downloaded to), or the root of your image folder.
        batch_size: images per device per step.
        num_workers: DataLoader workers per process; ``None`` derives it from the CPU cores.
        pin_memory: pin host batches; ``None`` means on when training on a GPU.
        augment: random crop (``crop_padding``) and horizontal flip on training batches.
        download: allow downloading CIFAR-10 when it is not in ``data_dir``.
        synthetic_train_size: training images of ``synthetic``; ``None``: as many as
            ``synthetic_steps_per_epoch`` optimizer steps of the global batch take.
        synthetic_steps_per_epoch: the synthetic data is drawn, not stored, so its epoch can
            be a number of optimizer steps (ranks x batch x accumulation images each): a
            larger batch or more ranks keep the steps a schedule needs.
        synthetic_val_size: validation images of ``synthetic``.
        image_size: side of the square images for ``folder`` (resized, centre-cropped).
        seed: seed of the synthetic data (the same on every rank and every run).
    """

    def __init__(
        self,
        dataset: Literal["synthetic", "cifar10", "folder"] = "synthetic",
        data_dir: str = "data",
        batch_size: int = 256,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        augment: bool = True,
        crop_padding: int = 4,
        download: bool = True,
        synthetic_train_size: int | None = None,
        synthetic_steps_per_epoch: int = 48,
        synthetic_val_size: int = 2_000,
        image_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise UserError(f"data.batch_size must be at least 1, got {batch_size}")
        if synthetic_steps_per_epoch < 1:
            raise UserError(
                "data.synthetic_steps_per_epoch must be at least 1, got "
                f"{synthetic_steps_per_epoch}"
            )
        if image_size < 1:
            raise UserError(f"data.image_size must be at least 1 (pixels), got {image_size}")
        if num_workers is not None and num_workers < 0:
            raise UserError(
                f"data.num_workers must be >= 0 (or null for automatic), got {num_workers}"
            )
        self.save_hyperparameters()
        self.dataset = dataset
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.download = download
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

        if dataset == "folder":
            train_dir = self.data_dir / "train"
            self.classes = tuple(FolderImages(train_dir, image_size).classes)
            mean, std = IMAGENET_MEAN, IMAGENET_STD
        else:
            self.classes = SYNTHETIC_CLASSES if dataset == "synthetic" else CIFAR10_CLASSES
            mean, std = CIFAR10_MEAN, CIFAR10_STD
        self.device_augment = DeviceAugment(
            mean, std, padding=crop_padding if augment else 0, flip=augment
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def prepare_data(self) -> None:
        # Runs on one process per node before setup(): the only place that downloads.
        if self.dataset == "cifar10":
            for train in (True, False):
                load_cifar10(self.data_dir, train=train, download=self.download)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        if self.dataset == "synthetic":
            # Different seeds for the two splits: validation images are never trained on.
            size = hp.synthetic_train_size
            if size is None:
                size = self._images_for(hp.synthetic_steps_per_epoch)
            self.train_set = InMemoryImages(*make_shapes(size, hp.seed))
            self.val_set = InMemoryImages(*make_shapes(hp.synthetic_val_size, hp.seed + 1))
        elif self.dataset == "cifar10":
            self.train_set = InMemoryImages(*load_cifar10(self.data_dir, True, download=False))
            self.val_set = InMemoryImages(*load_cifar10(self.data_dir, False, download=False))
        else:
            self.train_set = FolderImages(self.data_dir / "train", hp.image_size)
            self.val_set = FolderImages(self.data_dir / "val", hp.image_size, list(self.classes))
            log.info(
                "image folder %s: %d classes (%s); %d training and %d validation images",
                self.data_dir,
                len(self.classes),
                ", ".join(self.classes),
                len(self.train_set),
                len(self.val_set),
            )
        self._check_batches()

    def _images_for(self, steps: int) -> int:
        """Images in ``steps`` optimizer steps of the global batch."""
        trainer = self.trainer
        ranks, accumulate = (
            (trainer.world_size, trainer.accumulate_grad_batches) if trainer else (1, 1)
        )
        return steps * self.batch_size * ranks * accumulate

    def _check_batches(self) -> None:
        """Training keeps full batches only (drop_last), so a training set smaller than one
        batch per rank would train 0 steps and end "successfully"."""
        world = self.trainer.world_size if self.trainer is not None else 1
        per_rank = len(self.train_set) // world
        if per_rank < self.batch_size:
            raise UserError(
                f"the training set has {len(self.train_set)} images, {per_rank} per rank: "
                f"fewer than one batch of data.batch_size={self.batch_size}; lower "
                "data.batch_size or add images"
            )
        # Said once: the partial batch is left out of every epoch (a different one each
        # epoch, the order being shuffled), which on a small dataset is a large share.
        sampled = -(-len(self.train_set) // world)  # DistributedSampler pads to equal shares
        left = sampled % self.batch_size
        if left:
            share = left / sampled
            (log.warning if share >= 0.1 else log.info)(
                "data: each epoch trains %d batch(es) of %d per rank and leaves out %d of its "
                "%d images (%.0f%%; full batches only, for BatchNorm and torch.compile; a "
                "different %d each epoch); a data.batch_size that divides %d uses them all",
                sampled // self.batch_size, self.batch_size, left, sampled, 100 * share, left,
                sampled,
            )  # fmt: skip

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        trainer = self.trainer
        processes = trainer.num_devices if trainer is not None else 1
        workers = self.num_workers
        if workers is None:
            workers = default_num_workers(processes)
        pin = self.pin_memory
        if pin is None:
            pin = trainer is not None and trainer.strategy.root_device.type == "cuda"
        seed = shuffle_seed()
        # The order is fixed by (seed, epoch), not by the global generator, so a resumed run
        # sees the same batches as one that never stopped (gpu_busy.resumable_data).
        sampler = self.resumable_sampler(dataset, self.batch_size) if train else None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            # Full batches only while training: static shapes for BatchNorm and torch.compile.
            drop_last=train,
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0,
            # Workers fill this many batches each ahead of the training loop.
            prefetch_factor=4 if workers > 0 else None,
            # Worker seeds come from this generator, not the global one: what the model's
            # random ops draw does not depend on how often a loader was started.
            generator=torch.Generator().manual_seed(seed),
            # A cluster signals the whole process group: the workers leave it to the main
            # process, which saves before it stops.
            worker_init_fn=ignore_stop_signals() if workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    # No separate test split: `test` and `predict` of a checkpoint run on the validation set.
    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # Runs on the device, on the compute stream, after the copy: the host moved uint8.
        images, labels = batch
        if self.device_augment.scale.device != images.device:
            self.device_augment.to(images.device)  # once: the DataModule is not moved by Lightning
            # Channels-last on CUDA, as the example model runs: the normalising multiply-add
            # writes that layout at no cost, so the model's conversion finds nothing to do.
            self.device_augment.channels_last = images.is_cuda
        training = self.trainer is not None and self.trainer.training
        return self.device_augment(images, train=training), labels
