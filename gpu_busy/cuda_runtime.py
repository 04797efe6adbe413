"""The CUDA runtime calls the per-step machinery makes, behind one object that can be counted.

The step timer, the prefetcher, the memory peaks and the late reads ask ``runtime()`` for
events, streams and the allocator's peaks instead of calling ``torch.cuda`` themselves, and
take the CUDA route where ``runtime().takes_route(device)`` says so. ``python -m bench.host
--cuda-route`` puts a counting stand-in in its place and so runs the callbacks along their
CUDA route on a CPU: what they ask of CUDA per step is counted where no GPU is
(docs/ARCHITECTURE.md, "CUDA calls per step").

Example::

    cuda = runtime()
    if cuda.takes_route(device):
        stream = cuda.current_stream(device)   # once; not per step
        event = cuda.event(timing=True)
        event.record(stream)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class CudaRuntime:
    """``torch.cuda``, called late (a test's monkeypatch of ``torch.cuda`` still applies)."""

    def takes_route(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Work issued inside goes to ``stream`` (``torch.cuda.stream``)."""
        return torch.cuda.stream(stream)

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.cuda.device(device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def memory_peaks(self, device: torch.device) -> tuple[int, int] | None:
        """The allocator's peak allocated and reserved bytes since its last reset (host-side
        counters: no device call); None before CUDA has allocated anything."""
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        if not stats:
            return None
        return stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]

    def reset_memory_peaks(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)


_IN_FORCE: list[CudaRuntime] = [CudaRuntime()]


def runtime() -> CudaRuntime:
    """The runtime in force: ``torch.cuda``'s, or a stand-in ``replaced_by`` put there."""
    return _IN_FORCE[-1]


@contextlib.contextmanager
def replaced_by(stand_in: CudaRuntime) -> Iterator[CudaRuntime]:
    """``stand_in`` answers every call of the machinery made inside the block."""
    _IN_FORCE.append(stand_in)
    try:
        yield stand_in
    finally:
        _IN_FORCE.remove(stand_in)
