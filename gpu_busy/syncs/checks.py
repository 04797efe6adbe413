"""``assert_no_syncs``: fail a test, naming each line, when a call syncs.

Above both the detector and the site table (it uses each), so neither imports the other.

Example::

    assert_no_syncs(model.training_step, batch, 0)   # AssertionError listing each line
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gpu_busy.syncs.attribution import describe, not_allowed
from gpu_busy.syncs.detector import detect_syncs
from gpu_busy.syncs.sites import github_annotations, in_github_actions

T = TypeVar("T")


def assert_no_syncs(fn: Callable[..., T], *args: Any, device_type: str = "cpu", **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` and fail with the offending lines if it syncs.

    Example::

        assert_no_syncs(model.training_step, batch, 0)   # AssertionError listing each line
    """
    with detect_syncs(device_type=device_type) as rec:
        result = fn(*args, **kwargs)
    if unallowed := not_allowed(rec.events):
        if in_github_actions():  # on the pull request's diff, each on its own line
            print("", *github_annotations(unallowed), sep="\n", flush=True)
        name = getattr(fn, "__qualname__", repr(fn))
        raise AssertionError(f"{name} made {describe(unallowed)}")
    return result
