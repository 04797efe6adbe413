"""A CPU stand-in for the route CUDA's sync warnings travel, for tests that must fail on
what only a GPU run would otherwise show.

On CUDA, ``warn_or_error_on_sync`` (c10/cuda/CUDAFunctions.cpp) is a C++ ``TORCH_WARN``
raised inside the kernel (``memcpy_and_sync``, ``stream_synchronize``). It is buffered by
the nearest Python binding's ``PyWarningHandler`` and issued when that binding returns
(torch/csrc/Exceptions.cpp); an ``OpOverload`` called from ``__torch_dispatch__`` has no
handler of its own; warnings raised in ``backward()`` are replayed when it returns. Under
"error" the kernel raises instead.

``install()`` makes the CPU travel that route:

- ``gpu_busy.cuda_sync_warnings.DEBUG_MODE`` becomes a mode for device type "cpu" whose
  warning is ATen's "An output with one or more elements was resized" and whose switch is
  a Python int; every ``set`` is kept in ``StandIn.sets`` for tests that spy on arming;
- the CPU kernels of ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``...)
  and ``nonzero`` (and what calls it in C++: ``x[mask]``, ``torch.where(c)``, ``argwhere``)
  are replaced by ones that, under "warn", raise that C++ warning from inside the kernel
  (``aten::add.out`` into a non-empty output of the wrong size: ATen's ``resize_output``
  warns) and, under "error", raise;
- ``StandInStream().synchronize()`` does the same through a binding of its own, as
  ``torch.cuda.Stream.synchronize`` does, and the detector wraps it as it wraps that one.

Example::

    with install() as standin:
        with detect_syncs(device_type="cpu") as rec:
            torch.nonzero(x)        # one event: the rule's, CUDA's warning heard after it
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from gpu_busy import cuda_sync_warnings

MESSAGE = "An output with one or more elements was resized"


@dataclass
class StandIn:
    mode: int = 0
    sets: list[int] = field(default_factory=list)  # every mode set, in order
    kernel_syncs: int = 0  # warnings raised inside kernels
    # Which tensors a GPU run would hold on the device: a read of the others is no sync
    # (the CPU simulation's host tensors; SyncDetector.memory.on_device answers it).
    on_device: Callable[[torch.Tensor], bool] = lambda t: True

    def set(self, mode: int | str) -> None:
        value = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)
        self.mode = int(value)
        self.sets.append(self.mode)

    def debug_mode(self) -> cuda_sync_warnings.SyncDebugMode:
        return cuda_sync_warnings.SyncDebugMode(
            "cpu", MESSAGE, ready=lambda: True, get=lambda: self.mode, set=self.set
        )

    def sync_in_kernel(self) -> None:
        """What ``warn_or_error_on_sync`` does, from C++, with no Python handler of its own."""
        if self.mode == 2:
            raise RuntimeError(f"{MESSAGE} (stand-in for CUDA's sync debug 'error')")
        if self.mode == 1:
            self.kernel_syncs += 1
            one = torch.zeros(1)
            torch.ops.aten.add.out(one, one, out=torch.zeros(3))


_current: StandIn | None = None


def _local_scalar_dense(t: torch.Tensor):
    if _current.on_device(t):
        _current.sync_in_kernel()
    with torch._C.DisableTorchFunction():
        return t.reshape(()).tolist()  # tolist reads memory without _local_scalar_dense


def _nonzero(t: torch.Tensor) -> torch.Tensor:
    if _current.on_device(t):
        _current.sync_in_kernel()
    with torch._C.DisableTorchFunction():
        found = np.argwhere(t.ne(0).numpy())
    return torch.from_numpy(np.ascontiguousarray(found, dtype=np.int64))


class StandInStream:
    """``torch.cuda.Stream`` for the stand-in: ``synchronize()`` syncs inside a binding."""

    def synchronize(self) -> None:
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            torch.ones(1).item()  # the binding's handler issues the kernel's warning here


@contextlib.contextmanager
def install() -> Iterator[StandIn]:
    global _current
    standin = StandIn()
    _current = standin
    saved_mode = cuda_sync_warnings.DEBUG_MODE
    saved_calls = cuda_sync_warnings.synchronize_calls
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_local_scalar_dense", _local_scalar_dense, "CPU")
        lib.impl("nonzero", _nonzero, "CPU")
        cuda_sync_warnings.DEBUG_MODE = standin.debug_mode()

        def calls():
            stream = (StandInStream, "synchronize", "Stream.synchronize()", "cpu", True)
            return [*saved_calls(), stream]

        cuda_sync_warnings.synchronize_calls = calls
        yield standin
    finally:
        cuda_sync_warnings.synchronize_calls = saved_calls
        cuda_sync_warnings.DEBUG_MODE = saved_mode
        lib._destroy()
        _current = None
