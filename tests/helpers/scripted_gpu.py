"""A scripted GPU for the timers' CUDA logic on the CPU: events whose device times the test
sets, complete once the scripted clock passes them, from a bounded pool.

Example::

    gpu = ScriptedGPU(capacity=8)
    gpu.times = [0.0, 5.0]          # the device times the next two records get (ms)
    timer = StepTimer(torch.device("cuda", 0), pool=gpu)
    gpu.now = 5.0                   # the device has run up to here
"""

from __future__ import annotations


class ScriptedEvent:
    """A CUDA event whose device time is set by the test; complete once the clock passes it."""

    def __init__(self, gpu) -> None:
        self.gpu = gpu
        self.t = None

    def record(self, stream=None):
        self.t = self.gpu.next_time()

    def query(self):
        self.gpu.queries += 1
        return self.done()

    def done(self):
        return self.t is not None and self.t <= self.gpu.now

    def synchronize(self):
        self.gpu.now = max(self.gpu.now, self.t)

    def elapsed_time(self, end):
        assert self.done() and end.done(), "elapsed_time on an unfinished event"
        return end.t - self.t


class ScriptedGPU:
    """Hands out events (a bounded pool) and the device times the next records get."""

    def __init__(self, capacity=16) -> None:
        self.capacity, self.free, self.made = capacity, [], 0
        self.times: list[float] = []
        self.now = 0.0
        self.queries = 0  # query() calls, of every event

    def next_time(self):
        return self.times.pop(0)

    def acquire(self):
        if self.free:
            return self.free.pop()
        if self.made >= self.capacity:
            return None
        self.made += 1
        return ScriptedEvent(self)

    def release(self, *events):
        self.free.extend(e for e in events if e is not None)

    @property
    def in_use(self):
        return self.made - len(self.free)
