"""A pytest fixture that fails a test on any host-device sync, listing the lines.

Installing ``gpu_busy`` registers it with pytest (a ``pytest11`` entry point): the fixture
is there in every test, with no ``pytest_plugins`` line.

It sees what runs inside its block; what Lightning does around a step (the read of a
``prog_bar=True`` metric after it) needs a fit under ``SyncPointDetector(strict=True)``
(README, "Your own model and data": a test file for your own model).

Example::

    def test_forward_and_backward_are_sync_free(no_syncs):
        model = ImageClassifier(width=8)
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        with no_syncs(device_type="cpu"):
            F.cross_entropy(model(images), labels).backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from gpu_busy.syncs.attribution import describe, not_allowed
from gpu_busy.syncs.checks import nothing_checked, watched


@pytest.fixture
def no_syncs():
    """``with no_syncs(device_type="cpu"): ...`` fails the test if the block syncs, or if
    its tensors were all on another device (``device_type="cuda"`` on a runner without a
    GPU would check nothing)."""

    @contextlib.contextmanager
    def watch(device_type: str = "cpu") -> Iterator[None]:
        with watched(device_type) as (rec, ran):
            yield
        if ran.missed():
            pytest.fail(f"no_syncs {nothing_checked(device_type, ran)}", pytrace=False)
        if unallowed := not_allowed(rec.events):
            pytest.fail(describe(unallowed), pytrace=False)

    return watch
