"""``assert_no_syncs``: fail a test, naming each line, when a call syncs, or when its
tensors were all on another device than the one checked (a check that checked nothing
must not pass).

Above both the detector and the site table (it uses each), so neither imports the other.

Example::

    assert_no_syncs(model.training_step, batch, 0)   # AssertionError listing each line
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpu_busy.syncs.attribution import describe, not_allowed
from gpu_busy.syncs.detector import detect_syncs
from gpu_busy.syncs.sites import github_annotations, in_github_actions

T = TypeVar("T")


def assert_no_syncs(fn: Callable[..., T], *args: Any, device_type: str = "cpu", **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` and fail with the offending lines if it syncs.

    Example::

        assert_no_syncs(model.training_step, batch, 0)   # AssertionError listing each line
    """
    with watched(device_type) as (rec, ran):
        result = fn(*args, **kwargs)
    if ran.missed():
        raise AssertionError(nothing_checked(device_type, ran))
    if unallowed := not_allowed(rec.events):
        if in_github_actions():  # on the pull request's diff, each on its own line
            print("", *github_annotations(unallowed), sep="\n", flush=True)
        name = getattr(fn, "__qualname__", repr(fn))
        raise AssertionError(f"{name} made {describe(unallowed)}")
    return result


class DeviceOps(TorchDispatchMode):
    """Which devices a block's operations used: ``any``, one on ``device_type``'s tensors;
    ``others``, the other devices' types seen before it (after it, nothing is looked at)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type, self.any, self.others = device_type, False, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.any:
            types = {t.device.type for t in tree_leaves((args, kwargs, out))
                     if isinstance(t, torch.Tensor)}  # fmt: skip
            self.any = self.device_type in types
            self.others |= types - {self.device_type}
        return out

    def missed(self) -> bool:
        """Whether the block worked on other devices' tensors and never on this one's: the
        check was aimed elsewhere (a CUDA check on a runner without a GPU). A block that
        ran no operation at all has made no sync; that is no miss."""
        return not self.any and bool(self.others)


@contextlib.contextmanager
def watched(device_type: str) -> Iterator[tuple[Any, DeviceOps]]:
    """The sync detector over a block, and which devices its operations used."""
    with detect_syncs(device_type=device_type) as rec, DeviceOps(device_type) as ran:
        yield rec, ran


def nothing_checked(device_type: str, ran: DeviceOps) -> str:
    """The line for a check whose block worked only on other devices' tensors."""
    hint = "" if device_type == "cpu" else ', or give device_type="cpu" to check it on the CPU'
    return (
        f"checked nothing: the block ran no operation on a {device_type} tensor, only on "
        f"{', '.join(sorted(ran.others))}; run it on {device_type}{hint}"
    )
