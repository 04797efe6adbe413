"""Where a tensor lives follows how it was made, whichever attribute or container holds it
later; a move of a host tensor to the device is a copy whatever names the device.

torchvision's ``AnchorGenerator`` makes its cell anchors on the host at construction and
moves them to the feature map's device in every forward (``anchor_utils.py``,
``set_cell_anchors``): a copy at the first step only. Lightning's
``reinforce_learn_Qnet.py`` returns ``torch.tensor(x).to(device)`` three times a step, the
device taken from the batch (a string, ``"cpu"``, where there is no GPU).
"""

from __future__ import annotations

import pytest
import torch

from gpu_busy.callbacks import SyncPointDetector
from template.models import ImageClassifier
from tests.syncs.test_sync_point_detector import _fit

torchvision = pytest.importorskip("torchvision")


class WithAnchors(ImageClassifier):
    """A classifier that also runs torchvision's own anchor generator on its features,
    as a detection head does (RetinaNet: 5 feature maps, 9 anchors each)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from torchvision.models.detection.anchor_utils import AnchorGenerator

        sizes = tuple((s, s * 2, s * 4) for s in (8, 16, 32, 64, 128))
        self.anchor_generator = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * 5)

    def training_step(self, batch, batch_idx):
        from torchvision.models.detection.image_list import ImageList

        loss = super().training_step(batch, batch_idx)
        images = batch[0].float()
        features = [images[:, :1, :: 2**k, :: 2**k] for k in range(1, 6)]
        image_list = ImageList(images, [tuple(images.shape[-2:])] * len(images))
        anchors = self.anchor_generator(image_list, features)
        return loss + 0.0 * anchors[0].sum()


def _anchor_moves(detector):
    return [s for s in detector.table.sites.values() if "anchor_generator(" in s.code]


def test_anchors_moved_to_the_device_are_copied_at_the_first_step_only(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    _fit(tmp_path, WithAnchors(width=4), [detector], limit_train_batches=6)
    (site,) = _anchor_moves(detector)
    assert site.count == 5 and site.steady_count == 0, (site.count, site.steady_count)


def test_anchors_moved_in_unwatched_steps_stay_device_memory_at_the_next_watched_one(tmp_path):
    """Steps 0, 3 and 6 watched, the forwards between them not: the list holds what the
    last watched step left there, device tensors, and new ones made unseen."""
    detector = SyncPointDetector(first_steps=1)
    detector.schedule.should_watch = lambda step: step in (0, 3, 6)
    _fit(tmp_path, WithAnchors(width=4), [detector], limit_train_batches=8)
    assert detector.report["watched_batches"] == 3, detector.report
    (site,) = _anchor_moves(detector)
    assert site.count == 5 and site.steady_count == 0, (site.count, site.steady_count)


class FreshHostTensors(ImageClassifier):
    """Lightning's reinforce_learn_Qnet.py, lines 353-355: three new host tensors moved
    to the batch's device every step."""

    total_reward = 1.5

    def get_device(self, batch) -> str:  # the example's own, as it is written there
        return batch[0].device.index if self.on_gpu else "cpu"

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        device = self.get_device(batch)
        reward = torch.tensor(self.total_reward).to(device)
        steps = torch.tensor(self.global_step).to(batch[0].device)
        named = torch.tensor(2.0).to(torch.device(device))
        return loss + 0.0 * (reward + steps + named)


def test_fresh_host_tensors_moved_to_the_device_are_a_copy_whatever_names_it(tmp_path):
    detector = SyncPointDetector(first_steps=100)
    _fit(tmp_path, FreshHostTensors(width=4), [detector], limit_train_batches=6)
    moves = {s.code: s for s in detector.table.sites.values() if "torch.tensor(" in s.code}
    assert len(moves) == 3, list(moves)
    for code, site in moves.items():
        assert site.count == 6 and "copy" in site.op.lower(), (code, site.count, site.op)


def test_a_move_to_a_cpu_device_the_line_or_the_module_names_is_none():
    """``.to("cpu")`` and ``.to(torch.device("cpu"))`` written on the line, and a
    ``torch.device("cpu")`` the program keeps (the energy-based model's sampler), mean the
    host: reading the result there is no sync."""
    from gpu_busy.syncs import detect_syncs

    host = torch.device("cpu")
    with detect_syncs(device_type="cpu") as rec:
        rec.memory.devices_on_the_host(host)
        on_device = torch.ones(3, device=torch.ones(1).device)
        a = on_device.to("cpu")
        b = on_device.to(torch.device("cpu"))
        c = on_device.to(host)
        a.tolist(), b.tolist(), c.tolist()  # host reads: no sync
    assert [e.op for e in rec.events if "to" in e.op] and all(
        "to the host" in e.op for e in rec.events
    ), [str(e) for e in rec.events]
