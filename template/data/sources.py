"""Where images come from: tensors in memory, CIFAR-10 on disk, or a folder of the user's own.

Every source yields ``(uint8 CHW tensor, int label)``: the host only moves bytes, and
augmentation and normalisation happen on the device (see ``augment.py``).

Example::

    train = InMemoryImages(*load_cifar10("data", train=True, download=True))
    folder = FolderImages("~/pets/train", image_size=64)
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from gpu_busy.errors import UserError
from gpu_busy.log import get_logger

log = get_logger(__name__)

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch",)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


class InMemoryImages(Dataset):
    """A dataset over a uint8 ``[N, C, H, W]`` tensor and its int64 labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(labels):
            raise ValueError(
                f"expected uint8 [N, C, H, W] images and N labels, got {images.dtype} "
                f"{tuple(images.shape)} and {tuple(labels.shape)}"
            )
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class _ArraysOnly(pickle.Unpickler):
    """Unpickles plain data and numpy arrays, nothing else: a pickle names any callable to
    run when loaded, so a planted batch file could otherwise run code."""

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),  # how numpy 1.x pickled arrays
        ("numpy._core.multiarray", "_reconstruct"),  # numpy 2
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused {module}.{name}: not plain data")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, list[int]]:
    # CIFAR-10's own format: a pickled dict with b"data" (N x 3072 uint8, channel-major)
    # and b"labels".
    with path.open("rb") as f:
        entry = _ArraysOnly(f, encoding="bytes").load()
    return entry[b"data"], entry[b"labels"]


def load_cifar10(
    root: str | Path, train: bool, download: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read CIFAR-10 from ``root/cifar-10-batches-py`` into uint8 ``[N, 3, 32, 32]``, labels.

    If the files are missing and ``download`` is true, torchvision downloads and verifies
    the archive first. Offline with no local copy, raises a :class:`UserError` that says
    where it looked and how to get the data.
    """
    root = Path(root).expanduser().absolute()  # the message says exactly where it looked
    folder = root / CIFAR10_DIR
    names = CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES
    missing = [n for n in names if not (folder / n).is_file()]
    if missing and download:
        from torchvision.datasets import CIFAR10

        try:
            CIFAR10(str(root), train=train, download=True)
        except OSError as e:  # URLError and socket errors are OSErrors
            raise UserError(
                f"CIFAR-10 is not in {folder} and the download failed ({e}); download "
                f"{CIFAR10_URL} and extract it into {root}, or use --data.dataset=synthetic"
            ) from None
        missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise UserError(
            f"CIFAR-10 is not in {folder} (missing {', '.join(missing)}); run once online with "
            f"--data.download=true, or download {CIFAR10_URL} and extract it into {root}"
        )
    chunks, labels = [], []
    for name in names:
        try:
            data, batch_labels = _read_cifar_batch(folder / name)
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
            raise UserError(
                f"{folder / name} is not a CIFAR-10 batch file ({' '.join(str(e).split())[:120]}"
                f" [{type(e).__name__}]); it was not loaded. Delete {folder} and download it again"
            ) from None
        chunks.append(np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(batch_labels)
    images = torch.from_numpy(np.concatenate(chunks))
    return images, torch.tensor(labels, dtype=torch.int64)


def _images_under(root: Path, folder: Path) -> tuple[list[Path], int]:
    """The image files under ``folder``, sorted, and the links not followed: a folder link
    is never followed (it could lead out of ``root`` or loop back into it), a file link
    only where it resolves inside ``root``; hidden folders and files are left out."""
    if folder.is_symlink():
        return [], 1
    found, skipped = [], 0
    for top, dirs, names in os.walk(folder, followlinks=False):
        here = Path(top)
        skipped += sum(1 for d in dirs if (here / d).is_symlink())
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (here / d).is_symlink())
        for name in sorted(names):
            path = here / name
            if name.startswith(".") or not name.lower().endswith(IMAGE_SUFFIXES):
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                skipped += 1
                continue
            if path.is_file():
                found.append(path)
    return found, skipped


def _decode(path: str, size: int) -> torch.Tensor:
    from PIL import Image
    from torchvision.transforms.v2.functional import center_crop, pil_to_tensor, resize

    # A file that does not decode stops the run naming it, rather than being skipped: a
    # skipped image silently changes the dataset and the class balance.
    try:
        with Image.open(path) as image:
            # Resize the short side, then crop the centre: a square uint8 image of fixed
            # size, so batches stack without padding.
            image = center_crop(resize(image.convert("RGB"), [size], antialias=True), [size, size])
            return pil_to_tensor(image)
    except Image.DecompressionBombError as e:  # larger than PIL's limit: an attack or a slip
        raise UserError(
            f"image {path} is too large to decode safely ({' '.join(str(e).split())[:120]}); "
            "remove it or resize it"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:  # what PIL raises for damaged files
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise UserError(f"cannot read image {path} ({reason}); remove or replace it") from None


class FolderImages(Dataset):
    """``root/<class name>/<image>`` as ``(uint8 [3, size, size], label)``, decoded on access.

    Decoding runs in the DataLoader workers; labels are the class folders in sorted order,
    as in ``torchvision.datasets.ImageFolder``.
    """

    def __init__(self, root: str | Path, image_size: int, classes: list[str] | None = None):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise UserError(
                f"image folder {root} does not exist; point --data.data_dir at a folder "
                "with train/ and val/ inside, each holding one sub-folder per class"
            )
        root = root.resolve()
        if classes is None:
            # Hidden folders (.ipynb_checkpoints, .git) are not classes, and a linked folder
            # is not followed (see _images_under).
            classes = sorted(
                d.name
                for d in root.iterdir()
                if d.is_dir() and not d.is_symlink() and not d.name.startswith(".")
            )
        if not classes:
            raise UserError(
                f"{root} has no class sub-folders; put each class's images in root/<class>/"
            )
        self.classes = classes
        self.samples: list[tuple[str, int]] = []
        skipped = 0
        for label, name in enumerate(classes):
            files, links = _images_under(root, root / name)
            skipped += links
            if not files:
                raise UserError(
                    f"class folder {root / name} holds no images ({', '.join(IMAGE_SUFFIXES)}); "
                    "add some, or remove the folder (every class folder is a label)"
                )
            self.samples += [(str(f), label) for f in files]
        if skipped:
            log.warning(
                "%s: %d symbolic link(s) leading out of the folder or back into it were not "
                "followed; copy the images in to use them",
                root,
                skipped,
            )
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return _decode(path, self.image_size), label
