"""A pytest fixture that fails a test on any host-device sync, listing the lines.

Installing ``gpu_busy`` registers it with pytest (a ``pytest11`` entry point): the fixture
is there in every test, with no ``pytest_plugins`` line.

Example::

    def test_step_is_sync_free(no_syncs):
        with no_syncs(device_type="cpu"):
            loss = model.training_step(batch, 0)
            loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from gpu_busy.syncs.detector import describe, detect_syncs, not_allowed


@pytest.fixture
def no_syncs():
    """``with no_syncs(device_type="cpu"): ...`` fails the test if the block syncs."""

    @contextlib.contextmanager
    def watch(device_type: str = "cpu") -> Iterator[None]:
        with detect_syncs(device_type=device_type) as rec:
            yield
        if unallowed := not_allowed(rec.events):
            pytest.fail(describe(unallowed), pytrace=False)

    return watch
