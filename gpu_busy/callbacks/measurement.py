"""Measurement: a callback that only measures, so its own failure never ends the user's fit.

A hook of a ``Measurement`` that raises logs one warning naming the measurement, and the
callback stops measuring: its later hooks return at once (``teardown`` and
``on_exception`` still run, to undo what it placed), and at the end of the fit its report
is one "n/a" line. Under DDP a rank that skipped its collectives would leave the others
waiting, so there the failure travels first: a member of the step clock's window says so
in the gather the window already makes (``StepClock``), and every rank drops it at the same
step; rank zero's warning names the rank and its error. Never caught: a stop the callback
means (``TrainingStopped``, ``SyncError``), anything while ``must_raise()`` (the sync
detector under ``strict``), and a failure under DDP outside the window (before training,
in the reports' own gathers), which ``StopOnRankFailure`` turns into an end of every rank.
Details: docs/ARCHITECTURE.md, "A measurement never ends a fit".

Example::

    class StepCounter(Measurement):
        label = "step counts"
        def on_train_batch_end(self, trainer, *args):
            self.steps += 1       # an AttributeError here: one warning, the fit goes on
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from gpu_busy import lightning_compat as compat
from gpu_busy.faults.training_stopped import TrainingStopped
from gpu_busy.log import get_logger
from gpu_busy.syncs.attribution import SyncError

log = get_logger(__name__)

# Lightning's hooks, and what the step clock calls on the members of its window
_HOOKS = frozenset(
    [n for n in dir(pl.Callback) if n.startswith("on_")]
    + ["setup", "teardown", "state_dict", "load_state_dict"]
    + ["take", "step_started", "step_ended", "window_row", "log_window"]
)
_ALWAYS_RUN = frozenset(["teardown", "on_exception"])  # they undo what the callback placed
_PASSED_ON = (TrainingStopped, SyncError)
_REPORT_HOOKS = frozenset(["on_train_end", "on_fit_end"])  # where the reports are made
_WHEN_FAILED: dict[str, Callable[[], Any]] = {"window_row": list}  # an empty row


class Measurement(compat.Callback):
    """A callback whose hooks (all of them, or the names in ``measured``) are guarded, and
    that reports on the steps a fit ran when the fit is cut short (``at_stop``)."""

    label = "a measurement"  # what the warning and the n/a line call it
    report_name = ""  # the report it publishes at the end of a fit ("idle"), if any
    measured: frozenset[str] | None = None  # None: every hook the class defines
    # what makes its report, run at on_exception where the fit ended early (report_at_stop)
    at_stop: tuple[str, ...] = ("on_train_end", "on_fit_end")
    # set by the step clock while a failure can travel in its window to every rank
    in_window = False
    # what it builds for a fit (a clock, a copier, a detector: locks, streams, threads),
    # made again at the next fit's set-up; a pickle (ddp_spawn's, after a fit too) holds None
    made_per_fit: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {k: None if k in self.made_per_fit else v for k, v in vars(self).items()}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = (_HOOKS if cls.measured is None else cls.measured) | _ALWAYS_RUN
        for name, fn in list(vars(cls).items()):
            if name in names and callable(fn) and not getattr(fn, "_guarded", False):
                setattr(cls, name, _guarded(name, fn))

    @property
    def failed(self) -> str | None:
        """Why this callback stopped measuring, or None."""
        return self.__dict__.get("_failed")

    # Guarded below (the report at a stop runs first; teardown ends the fit's record)
    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        pass

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        pass

    def must_raise(self) -> bool:
        """Whether a failure must end the fit after all (a check, not a measurement)."""
        return False

    def stop_measuring(self, reason: str, rank: int | None = None) -> None:
        """Stop, and say so once: ``rank`` is where it failed, under DDP (every rank drops
        the measurement at the same step; rank zero's log speaks)."""
        if self.failed and rank is None:
            return
        if not self.failed:
            self.__dict__["_failed"] = reason if rank is None else f"on rank {rank}: {reason}"
        where = "" if rank is None else f" on rank {rank}"
        everywhere = "" if rank is None else " on every rank"
        log.warning(
            "%s stopped measuring%s (%s); its figures are n/a%s, and training goes on",
            self.label, where, reason, everywhere,
        )  # fmt: skip

    def _fail(self, hook: str, err: Exception) -> None:
        reason = f"{type(err).__name__} in {type(self).__name__}.{hook}: {err}"
        if _several_ranks():  # said when every rank drops it, at the window
            self.__dict__["_failed"] = reason
        else:
            self.stop_measuring(reason)


def _guarded(name: str, fn: Callable) -> Callable:
    always = name in _ALWAYS_RUN

    @functools.wraps(fn)
    def guarded(self: Measurement, *args: Any, **kwargs: Any) -> Any:
        if name == "on_exception":
            report_at_stop(self, *args[:3])
        if name in self.at_stop:
            self.__dict__.setdefault("_ran", set()).add(name)
        if name == "teardown":
            self.__dict__.pop("_ran", None)  # the fit is over: the next starts afresh
        if "_failed" in self.__dict__ and not always:
            if name in _REPORT_HOOKS and self.report_name and not self.__dict__.get("_said"):
                self.__dict__["_said"] = True  # at the first hook where its report was due
                _say_na(self, args[0])
            return _WHEN_FAILED.get(name, lambda: None)()
        try:
            return fn(self, *args, **kwargs)
        except _PASSED_ON:
            raise
        except Exception as err:
            if self.must_raise() or (_several_ranks() and not self.in_window):
                raise
            if not self.failed:
                self._fail(name, err)
            return _WHEN_FAILED.get(name, lambda: None)()

    guarded._guarded = True
    return guarded


def report_at_stop(
    callback: Measurement, trainer: pl.Trainer, pl_module: Any, exception: BaseException
) -> None:
    """A fit cut short (a stop every rank made together, or any error in one process)
    still writes this callback's report of the steps it ran: its ``at_stop`` hooks that did
    not run, before its own ``on_exception`` tidies up. Under DDP, only a deliberate stop
    (``TrainingStopped`` that is no failure) is one every rank makes at the same step, so
    only then are the reports' collectives met on every rank."""
    if trainer.state.fn != "fit" or not trainer.global_step:  # no step ran: nothing to say
        return
    deliberate = isinstance(exception, TrainingStopped) and not exception.failure
    if _several_ranks() and not deliberate:
        return
    ran = set(callback.__dict__.get("_ran", ()))
    for hook in callback.at_stop:
        if hook not in ran and getattr(type(callback), hook) is not getattr(pl.Callback, hook):
            args = (trainer, pl_module, "fit") if hook == "teardown" else (trainer, pl_module)
            getattr(callback, hook)(*args)


def _say_na(callback: Measurement, trainer: pl.Trainer) -> None:
    from gpu_busy.callbacks.ranks import publish  # ranks imports the report layer

    line = f"{callback.report_name}: n/a ({callback.failed})"
    publish(trainer, f"{callback.report_name} n/a", {}, [line])


def _several_ranks() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


Measurement.on_exception = _guarded("on_exception", Measurement.on_exception)
Measurement.teardown = _guarded("teardown", Measurement.teardown)
