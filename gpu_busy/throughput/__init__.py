"""Throughput, FLOPs, MFU and memory, measured without a sync: the mechanisms (no Lightning).

``ThroughputStats`` sums the step timer's periods, samples and FLOPs; ``FlopCount`` counts
one real batch's FLOPs with PyTorch's ``FlopCounterMode``, ``FlopCounts`` keeps a fit's
counts, made again where ``WhatTrains`` changes; ``peak_flops`` looks a device's peak
up in a table of datasheet figures; ``MemoryPeaks`` reads the caching allocator's per-step
peaks. ``gpu_busy.callbacks.ThroughputMonitor`` hooks them into a fit.

Example::

    memory = MemoryPeaks("cuda")
    peak = peak_flops(torch.cuda.get_device_name(), "bf16")
"""

from gpu_busy.throughput.flops import FlopCount, FlopCounts, FlopSegment, WhatTrains
from gpu_busy.throughput.memory import MemoryPeaks, MemoryStats, expandable_segments_on
from gpu_busy.throughput.meter import ThroughputStats
from gpu_busy.throughput.peaks import PRECISIONS, TABLE, Peak, find_device, peak_flops

__all__ = [
    "PRECISIONS",
    "TABLE",
    "FlopCount",
    "FlopCounts",
    "FlopSegment",
    "MemoryPeaks",
    "MemoryStats",
    "Peak",
    "ThroughputStats",
    "WhatTrains",
    "expandable_segments_on",
    "find_device",
    "peak_flops",
]
