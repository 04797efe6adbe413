from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_busy.errors import UserError
from template.data import ImageDataModule
from template.data.augment import DeviceAugment
from template.data.datamodule import default_num_workers
from template.data.sources import FolderImages, load_cifar10
from template.data.synthetic import CLASSES, make_shapes


def test_synthetic_is_deterministic_balanced_uint8():
    a_images, a_labels = make_shapes(200, seed=3)
    b_images, b_labels = make_shapes(200, seed=3)
    c_images, _ = make_shapes(200, seed=4)
    assert a_images.dtype == torch.uint8 and a_images.shape == (200, 3, 32, 32)
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert not torch.equal(a_images, c_images)
    assert torch.bincount(a_labels, minlength=len(CLASSES)).tolist() == [20] * len(CLASSES)


def test_synthetic_classes_differ_by_shape_not_colour():
    images, labels = make_shapes(2000, seed=0)
    # Mean colour per class is nearly the same: colour alone cannot tell classes apart.
    means = torch.stack([images[labels == c].float().mean((0, 2, 3)) for c in range(10)])
    assert (means.max(0).values - means.min(0).values).max() < 40
    # But a shape statistic does: the fraction of edge pixels differs between disks and stripes.
    grey = images.float().mean(1)
    edges = (grey[:, :, 1:] - grey[:, :, :-1]).abs().gt(40).float().mean((1, 2))
    assert edges[labels == CLASSES.index("v-stripes")].mean() > 3 * edges[labels == 0].mean()


def test_cifar10_reader_reads_own_format_offline(cifar_root):
    root, written = cifar_root
    images, labels = load_cifar10(root, train=True, download=False)
    assert images.shape == (100, 3, 32, 32) and images.dtype == torch.uint8
    first_data, first_labels = written["data_batch_1"]
    # Row-major 3072 bytes are channel planes: R (1024), G, B.
    assert torch.equal(images[0, 1].flatten(), torch.from_numpy(first_data[0, 1024:2048]))
    assert labels[:20].tolist() == first_labels
    last_data, _ = written["data_batch_5"]
    assert torch.equal(images[-1].flatten(), torch.from_numpy(last_data[-1]))
    test_images, test_labels = load_cifar10(root, train=False, download=False)
    assert len(test_images) == len(test_labels) == 20


def test_cifar10_missing_offline_says_where_and_how(tmp_path):
    with pytest.raises(UserError) as e:
        load_cifar10(tmp_path / "none", train=True, download=False)
    message = str(e.value)
    assert str(tmp_path / "none" / "cifar-10-batches-py") in message
    assert "cifar-10-python.tar.gz" in message and "\n" not in message


def test_cifar10_failed_download_is_a_user_error(tmp_path, monkeypatch):
    import torchvision.datasets

    class Offline:
        def __init__(self, *args, **kwargs):
            raise OSError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", Offline)
    with pytest.raises(UserError, match="download failed"):
        load_cifar10(tmp_path, train=True, download=True)


def test_cifar10_corrupt_file_is_a_user_error(cifar_root):
    root, _ = cifar_root
    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="data_batch_3 is not a CIFAR-10 batch"):
        load_cifar10(root, train=True, download=False)


def test_image_folder_yields_fixed_size_uint8(image_folder):
    ds = FolderImages(image_folder / "train", image_size=16)
    assert ds.classes == ["cats", "dogs", "owls"] and len(ds) == 18
    image, label = ds[7]
    assert image.shape == (3, 16, 16) and image.dtype == torch.uint8 and label == 1


def test_image_folder_skips_hidden_folders_and_links_that_leave_or_loop(image_folder, caplog):
    import logging
    import os

    train = image_folder / "train"
    (train / ".ipynb_checkpoints").mkdir()  # a notebook's leftovers: not a class
    os.symlink(train, train / "cats" / "loop")  # back into the tree: would count forever
    outside = image_folder.parent / "elsewhere"
    outside.mkdir()
    (train / "dogs" / "0.png").rename(outside / "0.png")
    os.symlink(outside / "0.png", train / "dogs" / "0.png")  # a file link out of the tree
    with caplog.at_level(logging.WARNING):
        ds = FolderImages(train, image_size=16)
    assert ds.classes == ["cats", "dogs", "owls"]
    assert len(ds) == 17  # 6 + 5 + 6: the loop and the outside file are not followed
    assert "2 symbolic link(s)" in caplog.text


def test_an_empty_class_folder_is_a_user_error(image_folder):
    (image_folder / "train" / "lynx").mkdir()
    with pytest.raises(UserError, match="lynx holds no images"):
        FolderImages(image_folder / "train", image_size=16)


def test_image_folder_missing_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ImageDataModule(dataset="folder", data_dir=str(tmp_path / "nothing"))


def test_datamodule_folder_reads_classes_and_batches_and_says_what_it_found(image_folder, caplog):
    dm = ImageDataModule(dataset="folder", data_dir=str(image_folder), batch_size=4, image_size=8)
    assert dm.num_classes == 3
    with caplog.at_level("INFO"):
        dm.setup("fit")
    assert (
        f"image folder {image_folder}: 3 classes (cats, dogs, owls); 18 training and 6 "
        "validation images"
    ) in caplog.text
    images, labels = next(iter(dm.val_dataloader()))
    assert labels.tolist() == [0, 0, 1, 1]
    assert images.shape == (4, 3, 8, 8) and images.dtype == torch.uint8


def test_augment_eval_only_normalises():
    mean, std = (0.5, 0.25, 0.75), (0.2, 0.5, 0.1)
    augment = DeviceAugment(mean, std)
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    out = augment(images, train=False)
    expected = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std
    ).view(1, 3, 1, 1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_augment_train_crops_a_window_of_the_padded_image():
    torch.manual_seed(0)
    augment = DeviceAugment(mean=(0, 0, 0), std=(1 / 255,) * 3, padding=2, flip=False)
    images = torch.randint(1, 256, (16, 3, 6, 6), dtype=torch.uint8)
    out = augment(images, train=True)  # scale 1: values equal the uint8 input
    padded = F.pad(images, (2, 2, 2, 2)).float()
    shifts = set()
    for i in range(16):
        matches = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(out[i], padded[i, :, dy : dy + 6, dx : dx + 6])
        ]
        assert len(matches) == 1, f"image {i} is not one window of its padded input"
        shifts.add(matches[0])
    assert len(shifts) > 1, "every image got the same crop: the offsets are not per image"


def test_augment_flips_about_half_horizontally():
    torch.manual_seed(0)
    augment = DeviceAugment(mean=(0, 0, 0), std=(1 / 255,) * 3, padding=0, flip=True)
    images = torch.randint(0, 256, (200, 3, 4, 4), dtype=torch.uint8)
    out = augment(images, train=True)
    pairs = list(zip(out, images.float(), strict=True))
    same = torch.tensor([torch.equal(o, i) for o, i in pairs])
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in pairs])
    assert bool((same | flipped).all())
    assert 60 < int(flipped.sum()) < 140


def test_augment_rejects_float_input():
    with pytest.raises(TypeError, match="uint8"):
        DeviceAugment()(torch.zeros(2, 3, 4, 4), train=False)


def test_worker_count_follows_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_num_workers(1) == 8  # capped
    assert default_num_workers(4) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert default_num_workers(1) == 1
    assert default_num_workers(2) == 0


def test_resumable_sampler_order_is_fixed_by_seed_and_epoch_and_resumes_mid_epoch():
    from gpu_busy.resume.sampler import ResumableSampler

    data = list(range(40))
    sampler = ResumableSampler(data, seed=3)
    first = list(sampler)
    assert sorted(first) == data and first == list(ResumableSampler(data, seed=3))
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second) == data

    resumed = ResumableSampler(data, seed=3)
    resumed.set_epoch(1)
    resumed.resume_at(epoch=1, batches=3, batch_size=4)
    assert list(resumed) == second[12:]
    assert list(resumed) == second[12:]  # started again within the epoch: still resumed
    assert len(resumed) == 40  # the loop counts the skipped batches as done
    resumed.set_epoch(2)
    assert len(list(resumed)) == 40  # the next epoch is whole

    shards = [list(ResumableSampler(data, num_replicas=2, rank=r, seed=3)) for r in (0, 1)]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) == 20


def test_rng_state_round_trips_every_generator():
    import random

    import numpy as np

    from gpu_busy.resume.rng_state import capture_rng_state, restore_rng_state

    random.gauss(0, 1)  # leaves a cached value in Python's generator
    saved = capture_rng_state()
    drawn = (torch.rand(4), np.random.rand(3), random.random(), random.gauss(0, 1))
    restore_rng_state(saved)
    again = (torch.rand(4), np.random.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1])
    assert drawn[2:] == again[2:]
    assert saved.dtype == torch.int64 and saved.dim() == 1
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state(saved[:100])


def test_the_images_a_partial_batch_leaves_out_are_said_once(caplog):
    """180 images in batches of 128: 52 are left out of every epoch (full batches only)."""
    small = ImageDataModule(synthetic_train_size=180, synthetic_val_size=16, batch_size=128)
    with caplog.at_level("INFO"):
        small.setup("fit")
        small.setup("validate")  # set up once: said once
    (record,) = [r for r in caplog.records if "leaves out" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert "1 batch(es) of 128 per rank and leaves out 52 of its 180 images (29%" in (
        record.getMessage()
    )
    caplog.clear()
    with caplog.at_level("INFO"):
        ImageDataModule(synthetic_train_size=256, batch_size=128).setup("fit")
    assert "leaves out" not in caplog.text


@pytest.mark.parametrize(
    ("ranks", "batch", "accumulate"), [(1, 16, 1), (1, 32, 1), (2, 16, 1), (2, 16, 2)]
)
def test_a_synthetic_epoch_is_its_optimizer_steps_whatever_the_global_batch(
    ranks, batch, accumulate
):
    """A larger batch, more ranks or accumulation draw more images, not fewer steps: the
    schedule's steps (and so its accuracy, docs/BENCHMARKS.md) stay those of the config."""
    from types import SimpleNamespace

    data = ImageDataModule(batch_size=batch, synthetic_steps_per_epoch=3, synthetic_val_size=8)
    data.trainer = SimpleNamespace(world_size=ranks, accumulate_grad_batches=accumulate)
    data.setup("fit")
    per_rank_batches = len(data.train_set) // ranks // batch
    assert len(data.train_set) == 3 * ranks * batch * accumulate
    assert per_rank_batches // accumulate == 3
    fixed = ImageDataModule(batch_size=batch, synthetic_train_size=96, synthetic_val_size=8)
    fixed.trainer = data.trainer
    fixed.setup("fit")
    assert len(fixed.train_set) == 96  # a size given is the size
    with pytest.raises(UserError, match="synthetic_steps_per_epoch must be at least 1"):
        ImageDataModule(synthetic_steps_per_epoch=0)
