"""StepClock: the fit's one step timer and its one logging window, shared by the callbacks.

One ``gpu_busy.idle.StepTimer`` times each training step and the gap before it; each
step's timing goes to every subscribed monitor. At a logging step the window closes: the
steps' events are read back (not per step: docs/ARCHITECTURE.md, "CUDA calls per step")
and every member's window row (figures, counts, flags) goes over ranks in one gather,
with a flag a member for whether it failed on that rank: every rank drops a member that
failed on any, at the same step (``Measurement``; again at the end of training). Two
marks at the ends of the callback list bracket the step, so the other callbacks' work falls
between steps, where the GPU really waits for it.

Example::

    class MyMonitor(Callback):
        def on_train_start(self, trainer, pl_module):
            StepClock.subscribe(trainer, self)
        def window_row(self) -> list[float]: ...        # at a logging step, this rank's
        def log_window(self, trainer, rows): ...        # every rank's rows, in rank order
        # optional: take(timings), each step's StepTiming once read back (at the window);
        # step_started() right before the step, step_ended(samples) right after;
        # logs_earlier_steps = True: it logs at the window's earlier steps, so first
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.data import extract_batch_size

from gpu_busy import batch_routing
from gpu_busy import lightning_compat as compat
from gpu_busy.callbacks.measurement import Measurement
from gpu_busy.callbacks.ranks import gather_objects, gather_rows
from gpu_busy.cuda_sync_warnings import debug_mode
from gpu_busy.idle import StepTimer, SyncMarks, TimedReads
from gpu_busy.syncs.memory import held_tensors

_BACKWARD = ("on_before_backward", "on_after_backward")
_CLOCKS: weakref.WeakKeyDictionary[pl.Trainer, StepClock] = weakref.WeakKeyDictionary()


class StepClock:
    """The step timer of one fit and the monitors that read it."""

    def __init__(self, trainer: pl.Trainer) -> None:
        # Read back once per logging window: room for two windows' marks (4 a step)
        window = max(1, trainer.log_every_n_steps) * max(1, trainer.accumulate_grad_batches)
        self.timer = StepTimer(trainer.strategy.root_device, capacity=8 * window + 64)
        self.marks: SyncMarks | None = None
        self.subscribers: list[Any] = []
        self._sizes: dict[int, int] = {}  # id(member) -> its row's length, under DDP
        self._takers: list[Any] = []  # subscribers with take()
        self._at_start: list[Any] = []  # with step_started(), step_ended()
        self._at_end: list[Any] = []
        self._tokens: Any = None  # a subscriber's tokens(batch), where one counts them
        self.samples = 0  # every step's, timed or not (None: a batch had no size)
        # A batch's samples: the module's own count where it gives one, else the first
        # tensor's first dimension, as Lightning counts them for self.log
        own = getattr(trainer.lightning_module, "samples_in_batch", None)
        self._size = own if callable(own) else _batch_size
        self.samples_counted = (
            "the module's samples_in_batch(batch)" if callable(own)
            else "the first dimension of the batch's first tensor, as Lightning's self.log"
        )  # fmt: skip
        self.samples_note: str | None = None  # where that guess may be wrong (first batch)
        self._first_batch = not callable(own)
        self.window_batch: Any = None  # the logging step's batch, during _log_window
        self.started = time.perf_counter()  # training's start, for the fit's monitors
        self._layer = batch_routing.Layer(f"clock-{id(self):x}", position=0)
        self._edges = (_StepEnd(self), _StepStart(self))
        # The host's time in backward() holds a slower rank's wait under DDP: timed there only
        compat.skip_hooks(self._edges[1], _BACKWARD, skip=trainer.world_size == 1)
        # A new list, not an insert: Lightning is iterating the old one to call a hook.
        trainer.callbacks = [self._edges[0], *trainer.callbacks, self._edges[1]]
        # Every callback of the fit (Lightning's ModelCheckpoint, a user's): Lightning skips
        # the per-batch hooks each leaves empty, and its no-op profiling of each hook
        self._undo_dispatch = compat.lighter_dispatch(trainer)
        self.route(trainer)

    @classmethod
    def subscribe(cls, trainer: pl.Trainer, monitor: Any, sync_marks: bool = False) -> StepClock:
        """The fit's clock (placed now if no monitor has yet), with ``monitor`` in its logging
        window; ``sync_marks``: on CUDA, tell a sync stall apart with CUDA's sync debug mode."""
        clock = _CLOCKS.get(trainer)
        if clock is None or not clock._edges:
            clock = _CLOCKS[trainer] = cls(trainer)
        if monitor not in clock.subscribers:
            # Loggers that need increasing steps (Weights & Biases) drop a row below the
            # last: a member logging its window's earlier steps logs before the others.
            at = 0 if getattr(monitor, "logs_earlier_steps", False) else len(clock.subscribers)
            clock.subscribers.insert(at, monitor)
            clock._takers += [monitor] if hasattr(monitor, "take") else []
            clock._at_start += [monitor] if hasattr(monitor, "step_started") else []
            clock._at_end += [monitor] if hasattr(monitor, "step_ended") else []
            clock._tokens = clock._tokens or getattr(monitor, "tokens", None)
            if isinstance(monitor, Measurement):
                monitor.in_window = True  # its failure can travel to the other ranks
        device = trainer.strategy.root_device
        if sync_marks and clock.marks is None and debug_mode().serves(device.type):
            clock.marks = clock.timer.sync_marks = SyncMarks()  # open from a step's start
        return clock

    @classmethod
    def of(cls, trainer: pl.Trainer) -> StepClock | None:
        """The fit's clock, where a monitor placed one."""
        clock = _CLOCKS.get(trainer)
        return clock if clock is not None and clock._edges else None

    def seconds(self) -> float:
        """Host seconds since training started (the first monitor's on_train_start)."""
        return time.perf_counter() - self.started

    def route(self, trainer: pl.Trainer) -> None:
        """The DataLoader's waits, timed below any prefetcher (again for a new loader)."""
        timer = self.timer
        self._layer.route(trainer.fit_loop, lambda items: TimedReads(items, timer))

    def close_marks(self) -> None:
        """CUDA's debug mode is armed only where the marks are read: the training steps and
        the gaps between them, not validation or the epoch's end (their saves)."""
        if self.marks is not None:
            self.marks.close()

    def finish(self) -> list:
        """Training is over: every step read back (waiting costs nothing now)."""
        if any(edge.failed for edge in self._edges):
            return []  # the clock stopped measuring, and said so
        done = self.timer.close()
        self.close_marks()
        self._give(done)
        return done

    def remove(self, trainer: pl.Trainer) -> None:
        """Off the fit: the marks, the routing layer and the edges."""
        self.close_marks()
        self._layer.remove()
        if self._edges:
            trainer.callbacks = [c for c in trainer.callbacks if c not in self._edges]
        self._edges = ()
        self._undo_dispatch()
        self._undo_dispatch = lambda: None
        _CLOCKS.pop(trainer, None)

    # -- each step, from the edges --------------------------------------------------------

    def _step_started(self) -> None:
        if self.marks is not None:
            self.marks.open()
        for monitor in self._at_start:
            monitor.step_started()
        self.timer.start_step()

    def _step_ended(self, batch: Any) -> None:
        self.timer.end_step()  # first: what follows is the callbacks' work
        samples = self._size(batch)
        if self._first_batch:
            self._first_batch = False
            self.samples_note = _nested_note(batch, samples)
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        self.timer.count_last(samples, self._tokens(batch) if self._tokens else None)
        for monitor in self._at_end:
            monitor.step_ended(samples)

    def _give(self, timings: list) -> None:
        if timings:
            for monitor in self._takers:
                monitor.take(timings)

    def _log_window(self, trainer: pl.Trainer, batch: Any = None) -> None:
        """The window's steps read back, and every subscriber's window over ranks, in one
        gather. Nothing is read of CUDA between logging steps. ``window_batch`` is the
        logging step's batch while the members make their rows (for its shapes)."""
        self.window_batch = batch
        try:
            self._gather_window(trainer)
        finally:
            self.window_batch = None

    def _gather_window(self, trainer: pl.Trainer) -> None:
        self._give(self.timer.poll())
        self.timer.refresh_stream()
        members = list(self.subscribers)
        rows = [None if _failed(m) else m.window_row() for m in members]
        # asked again: a window_row that raised has just stopped its member (None: no row)
        rows = [None if _failed(m) else row for m, row in zip(members, rows, strict=True)]
        several = trainer.world_size > 1
        if several:
            if any(id(m) not in self._sizes for m in members):
                self._learn_sizes(trainer, members, rows)  # once, at the first window
            flat = [float(row is None) for row in rows]
            for m, row in zip(members, rows, strict=True):
                flat += [math.nan] * self._sizes[id(m)] if row is None else row
        else:
            flat = [x for row in rows if row is not None for x in row]
        gathered = gather_rows(trainer, flat)
        start, raised = (len(members) if several else 0), None
        if several:
            self._drop_failed(trainer, members, [r[: len(members)] for r in gathered])
        for monitor, row in zip(members, rows, strict=True):
            size = self._sizes[id(monitor)] if several else len(row or ())
            if monitor in self.subscribers and row is not None:
                try:  # every member logs its window, one that stops the fit (a signal) too
                    monitor.log_window(trainer, [r[start : start + size] for r in gathered])
                except Exception as err:  # raised once all have logged
                    raised = raised or err
            start += size
        if raised is not None:
            raise raised

    def settle(self, trainer: pl.Trainer) -> None:
        """Training is over: a member that failed on any rank since the last window is
        dropped on every rank before the reports, whose own gathers a failure ends."""
        if trainer.world_size > 1 and self.subscribers:
            members = list(self.subscribers)
            flags = gather_rows(trainer, [float(_failed(m) is not None) for m in members])
            self._drop_failed(trainer, members, flags)
        for monitor in self.subscribers:
            if isinstance(monitor, Measurement):
                monitor.in_window = False

    def _learn_sizes(self, trainer: pl.Trainer, members: list, rows: list) -> None:
        """Each member's row length, from the ranks where it has one: a rank where it
        failed before its first window sends that many NaN (every rank's row must be as
        long for the gather)."""
        sizes = gather_rows(trainer, [-1.0 if r is None else float(len(r)) for r in rows])
        for i, member in enumerate(members):
            self._sizes[id(member)] = max(0, int(max(s[i] for s in sizes)))
            if rows[i] is not None and len(rows[i]) != self._sizes[id(member)]:
                raise RuntimeError(f"{type(member).__name__}'s window rows differ in length "
                                   "over the ranks; they cannot be gathered")  # fmt: skip

    def _drop_failed(self, trainer: pl.Trainer, members: list, flags: list[list[float]]) -> None:
        """Every rank drops the members failed on any rank (the same ``flags`` on every
        rank); rank zero says once where each failed and why."""
        first = [next((r for r, f in enumerate(flags) if f[i]), None) for i in range(len(members))]
        if all(rank is None for rank in first):
            return
        reasons = gather_objects(trainer, [_failed(m) for m in members])  # a failure's words
        for i, member in enumerate(members):
            if first[i] is not None:
                member.stop_measuring(reasons[first[i]][i] or "failed", rank=first[i])
                self._unsubscribe(member)

    def _unsubscribe(self, monitor: Any) -> None:
        for members in (self.subscribers, self._takers, self._at_start, self._at_end):
            if monitor in members:
                members.remove(monitor)
        if getattr(self._tokens, "__self__", None) is monitor:
            self._tokens = None
        monitor.in_window = False


def _failed(monitor: Any) -> str | None:
    """Why a member stopped measuring on this rank, or None (a member that only controls,
    as ``StopOnSignal``, never does)."""
    return getattr(monitor, "failed", None)


class _StepEnd(Measurement):
    """First in the callback list: the step's end, before any callback's own work."""

    label = "the step clock"

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock._step_ended(batch)

    def on_train_end(self, trainer, pl_module) -> None:
        # First of every callback's: each step read back, the failures settled over ranks
        self.clock.finish()
        self.clock.settle(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self.clock.close_marks()
            self.clock.timer.break_gap()  # the next gap holds validation: not a step boundary

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.clock.route(trainer)  # reload_dataloaders_every_n_epochs gives a new loader
        self.clock.timer.break_gap()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.clock.close_marks()
        self.clock.timer.break_gap()


class _StepStart(Measurement):
    """Last in the callback list: the step's start, and the point where every callback's
    ``on_train_batch_end`` has run (what they enqueued is device work, not idle)."""

    label = "the step clock"

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def must_raise(self) -> bool:
        # a member's failure that must end the fit (strict's) reaches here from log_window
        return any(isinstance(m, Measurement) and m.must_raise() for m in self.clock.subscribers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if compat.is_logging_step(trainer):
            self.clock._log_window(trainer, batch)  # a collective: every rank, at one step
        self.clock.timer.hooks_done()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock._step_started()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.timer.backward_begins()

    def on_after_backward(self, trainer, pl_module) -> None:
        self.clock.timer.backward_ended()


def _nested_note(batch: Any, samples: int | None) -> str | None:
    """One line where the first tensor's first dimension may not count the samples: a
    batch of batches (task sets, a list of (x, y) pairs), or tensors that disagree on it."""
    firsts = sorted({t.shape[0] for t in held_tensors(batch) if t.ndim})
    items = batch.values() if isinstance(batch, dict) else batch
    nested = isinstance(batch, list | tuple | dict) and any(
        isinstance(item, list | tuple | dict) and held_tensors(item) for item in items
    )
    if not nested and len(firsts) < 2:
        return None
    why = "the batch holds batches" if nested else "the batch's tensors differ there"
    return (
        f"samples per batch counted as {samples}, the first tensor's first dimension; {why} "
        f"(first dimensions {', '.join(map(str, firsts[:4]))}): give the LightningModule a "
        "samples_in_batch(batch) method that returns its count"
    )


def _batch_size(batch: Any) -> int | None:
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:
        return batch[0].shape[0] if batch[0].ndim else 1  # extract_batch_size's first leaf
    try:
        return extract_batch_size(batch)  # reads a shape: no device access
    except MisconfigurationException:
        return None
