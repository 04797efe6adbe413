"""Exact idle time, now and then: ``torch.profiler`` windows over a few steps, analysed.

A window opens at a step boundary (every ``every_n_steps``, on ``request()``, or once
``trigger`` was touched), warms up for a step, records ``steps`` steps, exports
``rank<R>-step<S>.pt.trace.json`` and keeps ``analyze_trace``'s result; ``stop()`` drops
a window cut short.

Example::

    windows = ProfilerWindows(every_n_steps=500, folder=Path("runs/x/traces"))
    for step in range(n_steps):
        train_step()
        windows.after_step(step + 1)          # steps ended so far
    windows.stop()
    print(windows.results, windows.profiled(7))   # was step 7 under a profiler?
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_busy.idle.trace import analyze_trace


def torch_profiler(steps: int, cuda: bool) -> Callable[[Callable[[Any], None]], Any]:
    """Makes a ``torch.profiler.profile`` that warms up one step and records ``steps``; a
    partial of a module function, so that a callback holding it pickles (``ddp_spawn``)."""
    return functools.partial(_profile, steps=steps, cuda=cuda)


def _profile(on_trace_ready: Callable[[Any], None], steps: int, cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile, schedule

    return profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=on_trace_ready,
    )


@dataclass
class _Window:
    profiler: Any
    opened_at: int  # steps ended when it opened: the first step it slows down
    exported: bool = False


class ProfilerWindows:
    """Opens, closes, saves and analyses profiler windows at step boundaries.

    Args:
        every_n_steps: open a window every this many steps (0: only on request or trigger).
        steps: recorded steps per window, after one warm-up step.
        folder: where traces are kept; None: analysed from a temporary file, not kept.
        trigger: a file whose modification starts a window (``touch <run dir>/TRACE``).
        rank: names the trace files.
        make_profiler: ``make_profiler(on_trace_ready)`` returns an object with
            ``start()``, ``step()``, ``stop()``, ``export_chrome_trace(path)`` and a
            settable ``on_trace_ready``; by default ``torch_profiler(steps, cuda=False)``.
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        steps: int = 4,
        folder: Path | None = None,
        trigger: Path | None = None,
        rank: int = 0,
        make_profiler: Callable[[Callable[[Any], None]], Any] | None = None,
    ) -> None:
        self.every_n_steps = every_n_steps
        self._requested = False
        self.set_up(folder, trigger, rank, make_profiler or torch_profiler(steps, cuda=False))

    def set_up(self, folder: Path | None, trigger: Path | None, rank: int, make_profiler):
        """Start afresh (a new fit): where traces go, what triggers one, how to profile."""
        self.folder, self.trigger, self.rank = folder, trigger, rank
        self.make_profiler = make_profiler
        self.results: list[dict] = []
        self.seconds = 0.0  # host time spent starting, exporting and analysing windows
        self._window: _Window | None = None
        self._spans: list[tuple[int, int]] = []  # closed windows: first, last step slowed
        self._trigger_mtime = self._trigger_time()

    def request(self) -> None:
        """Open a window at the next step boundary."""
        self._requested = True

    def look_for_trigger(self) -> None:
        """Request a window if the trigger file changed since the last look."""
        mtime = self._trigger_time()
        if mtime is not None and mtime != self._trigger_mtime:
            self._trigger_mtime = mtime
            self.request()

    def profiled(self, step: int) -> bool:
        """Whether ``step`` (counted from 0) ran under a profiler."""
        if self._window is not None and step >= self._window.opened_at:
            return True
        return any(first <= step <= last for first, last in self._spans)

    def after_step(self, steps_ended: int) -> bool:
        """Call after every step. Returns True when a window closed here: the time until
        the next step holds its export, not the GPU's idle."""
        window = self._window
        if window is not None:
            window.profiler.step()  # runs _export once the window's steps are recorded
            if window.exported:
                self._close(steps_ended, keep=True)
                return True
            return False
        every = self.every_n_steps
        if self._requested or (every and steps_ended % every == 0):
            self._requested = False
            self._open(steps_ended)
        return False

    def stop(self, steps_ended: int | None = None) -> bool:
        """Drop an open window (its steps were cut); True if one was open."""
        if self._window is None:
            return False
        last = self._window.opened_at if steps_ended is None else steps_ended
        self._close(last, keep=False)
        return True

    # -- internals --------------------------------------------------------------------

    def _open(self, steps_ended: int) -> None:
        t0 = time.perf_counter()
        try:
            profiler = self.make_profiler(self._export)
            profiler.start()
        except RuntimeError as err:  # e.g. CUPTI missing or held by another profiler
            self.every_n_steps = 0
            raise ProfilerUnavailable(str(err)) from err
        finally:
            self.seconds += time.perf_counter() - t0
        self._window = _Window(profiler, opened_at=steps_ended)

    def _export(self, profiler: Any) -> None:
        t0 = time.perf_counter()
        window = self._window
        first = window.opened_at + 1  # after the warm-up step
        keep = self.folder is not None
        folder = self.folder if keep else Path(tempfile.mkdtemp(prefix="idle-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}-step{first}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        result = analyze_trace(path).as_dict()
        result.pop("steps")
        result.update(path=str(path) if keep else None, first_step=first, rank=self.rank)
        if not keep:
            path.unlink(missing_ok=True)
            folder.rmdir()
        self.results.append(result)
        window.exported = True  # closed once step() returns: the profiler is inside it here
        self.seconds += time.perf_counter() - t0

    def _close(self, steps_ended: int, keep: bool) -> None:
        t0 = time.perf_counter()
        window, self._window = self._window, None
        if not keep:
            window.profiler.on_trace_ready = None  # an interrupted window is not saved
        window.profiler.stop()
        self._spans.append((window.opened_at, max(window.opened_at, steps_ended - 1)))
        self.seconds += time.perf_counter() - t0

    def _trigger_time(self) -> float | None:
        if self.trigger is None:
            return None
        try:
            return self.trigger.stat().st_mtime
        except OSError:
            return None


class ProfilerUnavailable(RuntimeError):
    """The profiler could not start; windows are off from here on."""
