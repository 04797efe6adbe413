"""Lightning's calls of the callbacks' hooks: skipped where a callback's hook is empty, seen
from outside (``around_callback_hooks``), unprofiled where no profiler was chosen.

Example::

    class CountSteps(Callback):          # Lightning skips the per-batch hooks left empty
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx): ...
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.profilers import PassThroughProfiler

from gpu_busy.patches import patch

BATCH_HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
    "on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start",
    "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip


class Callback(pl.Callback):
    """``pl.Callback`` whose per-batch hooks, where it leaves them empty, Lightning skips.

    Lightning calls every callback's hook at every batch, each inside a profiler context
    named from the callback's ``state_key``: about 4 us per callback and hook on a 2-core
    CPU, for hooks that do nothing (bench.host). Every gpu_busy callback derives from this.

    Example::

        class CountSteps(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.steps += 1          # the only per-batch hook Lightning calls here
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Callback:
        self = super().__new__(cls)
        skip_empty_hooks(self)
        return self


def skip_empty_hooks(callback: pl.Callback) -> list[str]:
    """Lightning no longer calls the per-batch hooks ``callback``'s class leaves empty (and
    has not been told to skip yet); returns their names, for ``skip_hooks(..., skip=False)``."""
    cls = type(callback)
    names = [
        n for n in BATCH_HOOKS
        # a stand-in without the hook on its class (a test's Mock) keeps it as it is
        if (getattr(cls, n, None) is getattr(pl.Callback, n) or _idle_for_its_settings(callback, n))
        and n not in callback.__dict__
    ]  # fmt: skip
    skip_hooks(callback, names)
    return names


def _idle_for_its_settings(callback: pl.Callback, name: str) -> bool:
    """A hook that returns at its first test under the callback's settings."""
    # Private: ModelCheckpoint._every_n_train_steps and ._train_time_interval (Lightning
    # 2.0 to 2.6). Its on_train_batch_end (model_checkpoint.py:340 in 2.6.6) returns before
    # any other work where neither is set, in both optimization modes (lines 352 and 442):
    # checkpoints by epoch or by validation, the default, never save per batch.
    if name != "on_train_batch_end" or not isinstance(callback, ModelCheckpoint):
        return False
    every_n = getattr(callback, "_every_n_train_steps", None)  # None: before its __init__
    return every_n is not None and every_n < 1 and callback._train_time_interval is None


def skip_hooks(callback: pl.Callback, names: list[str] | tuple[str, ...], skip: bool = True):
    """Lightning does not call these hooks of ``callback`` (``skip=False``: again does)."""
    # Private: _call_callback_hooks (lightning/pytorch/trainer/call.py, 2.0 to 2.6) calls a
    # hook only where ``callable(getattr(callback, name))``: None on the instance skips it.
    # A subclass's own override, and super() calls, still find the class's method.
    for name in names:
        if skip:
            callback.__dict__[name] = None
        else:
            callback.__dict__.pop(name, None)


_NOT_PROFILED = contextlib.nullcontext()


def lighter_dispatch(trainer: pl.Trainer) -> Callable[[], None]:
    """For this fit, Lightning skips the per-batch hooks each callback leaves empty, and,
    where no profiler was chosen, its profiling context around every hook; returns the undo.

    Both are Lightning's own per-hook costs, paid at every batch for work that does
    nothing: about 4 us per empty callback hook and 3 us per profiled hook on a 2-core CPU
    (bench.host), where a step calls about 50 hooks.
    """
    skipped = [(c, skip_empty_hooks(c)) for c in trainer.callbacks]
    profiler = trainer.profiler
    # Lightning wraps every hook it calls in ``trainer.profiler.profile(name)``
    # (trainer/call.py:176, :227 and :328 in 2.6.6): a @contextmanager generator
    # (profilers/profiler.py:57) around start and stop, which PassThroughProfiler, the
    # Trainer's default, leaves empty (profilers/base.py:29-34). Only that exact class:
    # a subclass may record something.
    quiet = type(profiler) is PassThroughProfiler
    profiled = patch(profiler, "profile", lambda action_name: _NOT_PROFILED) if quiet else None

    def undo() -> None:
        for callback, names in skipped:
            skip_hooks(callback, names, skip=False)
        if profiled is not None:
            profiled()

    return undo


def around_callback_hooks(
    enter: Callable[[], None], leave: Callable[[], None]
) -> Callable[[], None]:
    """Call ``enter`` as Lightning starts calling the callbacks' hooks for an event, and
    ``leave`` when they have all returned, for every event, until the returned undo is
    called. What runs between is the loops' and the LightningModule's own work."""
    from lightning.pytorch.trainer import call

    # Private: lightning.pytorch.trainer.call._call_callback_hooks (Lightning 2.0 to 2.6):
    # every loop, the precision plugin and the Trainer call the callbacks' hooks through
    # it, as an attribute of the module (``call._call_callback_hooks(...)``).
    original = call._call_callback_hooks

    @functools.wraps(original)
    def call_callback_hooks(*args: Any, **kwargs: Any) -> Any:
        enter()
        try:
            return original(*args, **kwargs)
        finally:
            leave()

    return patch(call, "_call_callback_hooks", call_callback_hooks)
