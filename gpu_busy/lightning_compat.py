"""The one place the template reads Lightning internals.

Each private attribute below is pinned by ``tests/contracts/test_lightning_compat.py``: when a
Lightning release renames one, that test fails with the name, instead of the template
silently misbehaving.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars as _scalars
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor

from gpu_busy.host_reads import numbers_in_one_copy
from gpu_busy.patches import patch
from gpu_busy.syncs.attribution import user_frame

# The hooks Lightning calls on every callback at every batch.
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
        if (getattr(cls, n) is getattr(pl.Callback, n) or _idle_for_its_settings(callback, n))
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


def is_logging_step(trainer: pl.Trainer) -> bool:
    """True in the training step whose metrics Lightning will send to the loggers.

    Lets a module do a costly reduction (a collective, a host read) only on the steps
    where the result is written, every ``log_every_n_steps``.
    """
    # Private: Trainer._logger_connector.should_update_logs (Lightning 2.0 to 2.6), the
    # property Lightning itself consults before calling the loggers. In training it
    # depends only on what the key holds (logger_connector.py:50-65 in 2.6.6): asked by
    # six hooks a step, it is computed once per step.
    if trainer.state.stage is not RunningStage.TRAINING:
        return bool(trainer._logger_connector.should_update_logs)
    key = (
        trainer.fit_loop.epoch_loop._batches_that_stepped,
        trainer.should_stop,
        trainer.log_every_n_steps,
    )
    cached = trainer.__dict__.get("_gpu_busy_logging_step")
    if cached is None or cached[0] != key:
        cached = trainer.__dict__["_gpu_busy_logging_step"] = (
            key,
            bool(trainer._logger_connector.should_update_logs),
        )
    return cached[1]


def metrics_at_last_step_end(trainer: pl.Trainer) -> dict:
    """The callback metrics as Lightning stored them at the last training step's end: the
    logged tensors, not computed again (``trainer.callback_metrics`` would)."""
    # Private: Trainer._logger_connector._callback_metrics (Lightning 2.0 to 2.6), the dict
    # _LoggerConnector.on_batch_end updates after the callbacks' on_train_batch_end.
    return dict(trainer._logger_connector._callback_metrics)


def prog_bar_numbers_when_read(trainer: pl.Trainer) -> Callable[[], None]:
    """Until the returned undo is called, Lightning converts ``prog_bar=True`` values when
    ``trainer.progress_bar_metrics`` is read, all in one copy, not with an ``.item()`` per
    value after every batch (a sync each on a GPU: Lightning's issue #21232), and hands its
    loggers a logging step's values in one copy. The numbers are the same. The undo
    converts what is left unread."""
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result

    connector_class = type(trainer._logger_connector)
    read = connector_class.progress_bar_metrics.fget

    def progress_bar_metrics(connector: Any) -> dict:  # LoggedAt.origin knows it by name
        return _to_numbers_in_place(read(connector))

    undos = [
        # Private: result.py's and logger_connector.py's module-level
        # convert_tensors_to_scalars (Lightning 2.0 to 2.6), called only by
        # _ResultCollection.metrics for each prog_bar value, and by
        # _LoggerConnector.log_metrics for the values it hands the loggers.
        patch(result, "convert_tensors_to_scalars", _kept_for_the_reader),
        patch(logger_connector, "convert_tensors_to_scalars", numbers_in_one_copy),
        patch(connector_class, "progress_bar_metrics", property(progress_bar_metrics)),
    ]

    def undo() -> None:
        for step in reversed(undos):
            step()
        # Private: _LoggerConnector._progress_bar_metrics (2.0 to 2.6), the dict it returns
        _to_numbers_in_place(trainer._logger_connector._progress_bar_metrics)

    return undo


def _kept_for_the_reader(value: Any) -> Any:
    """A ``prog_bar`` value as logged; Lightning's own error for more than one element."""
    return value if isinstance(value, Tensor) and value.numel() == 1 else _scalars(value)


def _to_numbers_in_place(metrics: dict) -> dict:
    if any(isinstance(v, Tensor) for v in metrics.values()):
        metrics.update(numbers_in_one_copy(metrics))
    return metrics


def logger_step(trainer: pl.Trainer) -> int:
    """The step number Lightning passes to the loggers, so rows written directly line up."""
    # Private: _TrainingEpochLoop._batches_that_stepped (Lightning 2.0 to 2.6), what
    # _LoggerConnector.log_metrics uses as ``step``.
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def epoch_position(trainer: pl.Trainer) -> tuple[int, int]:
    """``(epoch, batches of it trained)`` for the next training batch, read while a
    checkpoint is written.

    From a mid-epoch save (``on_train_batch_end``, a mid-epoch validation) that is the
    current epoch and the batches run so far, the one just trained included; from an
    epoch-end save it is ``(next epoch, 0)``.
    """
    # Public attributes, but what ``processed`` means at save time (the batch that just ran
    # is counted; ``completed`` is not yet) is Lightning's loop bookkeeping (2.0 to 2.6),
    # pinned by tests/contracts/test_lightning_compat.py and tests/resume/test_resume.py.
    trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    epoch = int(trainer.current_epoch)
    if trained >= trainer.num_training_batches:
        return epoch + 1, 0
    return epoch, trained


def fetcher_counts(loop: Any) -> tuple[int | None, int, int]:
    """``(length, fetched, lookahead)`` of the loop's data fetcher in the current pass.

    Lightning's fetcher stops asking its CombinedLoader for batches once ``fetched``
    reaches ``length`` (None for loaders without one); there it keeps ``lookahead``
    batches ahead of what the loop has consumed. ``fetched`` includes the batches a
    resumed epoch skipped, so it is on the same scale as the loop's ``batch_progress``.
    """
    # Private: loop._data_fetcher and its .length / .fetched / .prefetch_batches
    # (Lightning 2.1 to 2.6).
    fetcher = loop._data_fetcher
    length = None if fetcher.length is None else int(fetcher.length)
    lookahead = 0 if length is not None else int(getattr(fetcher, "prefetch_batches", 0))
    return length, int(fetcher.fetched), lookahead


def fetched_ahead(loop: Any) -> list:
    """The batches the loop's fetcher has already read and holds for the next steps (a
    loader without a length: Lightning reads one ahead, at ``iter()``, before any hook of
    the pass), as ``(batch, batch_idx, dataloader_idx)``; the list itself, to replace in."""
    # Private: loop._data_fetcher.batches (_PrefetchDataFetcher, Lightning 2.0 to 2.6).
    fetcher = getattr(loop, "_data_fetcher", None)
    batches = getattr(fetcher, "batches", None)
    return batches if isinstance(batches, list) else []


def combined_loader(loop: Any) -> Any | None:
    """The CombinedLoader a loop's fetcher iterates, or None before the loop has one."""
    # Private: loop._combined_loader (Lightning 2.0 to 2.6).
    return getattr(loop, "_combined_loader", None)


def throttle_sigterm_broadcast(trainer: pl.Trainer, due: Callable[[], bool]) -> Callable[[], None]:
    """Make the training loop's per-step SIGTERM broadcast run only when ``due()`` says.

    ``due`` must answer the same on every rank at the same step (it gates a collective).
    Returns a function that restores Lightning's own behaviour.
    """
    loop = trainer.fit_loop.epoch_loop
    # Private: _TrainingEpochLoop._broadcast_sigterm_tensor (Lightning 2.5.2 to 2.6), called
    # at the start of advance() under DDP. Older releases have no per-step check.
    original = getattr(type(loop), "_broadcast_sigterm_tensor", None)
    if original is None:
        return lambda: None

    def broadcast_when_due() -> None:
        if due():
            original(loop)

    return patch(loop, "_broadcast_sigterm_tensor", broadcast_when_due)


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


def moves_to_the_cpu_as_to_cuda() -> Callable[[], None]:
    """Until the returned undo is called, Lightning moves tensors to the CPU with the
    ``non_blocking=True`` it passes to CUDA (its batches, the values it logs): the sync
    detector's simulation of a GPU run. On the CPU the move is the same either way."""
    from lightning.fabric.utilities import apply_func

    # Private: lightning.fabric.utilities.apply_func._BLOCKING_DEVICE_TYPES (2.0 to 2.6):
    # move_data_to_device passes non_blocking=True to a device type not in it.
    blocking = tuple(t for t in apply_func._BLOCKING_DEVICE_TYPES if t != "cpu")
    return patch(apply_func, "_BLOCKING_DEVICE_TYPES", blocking)


def keep_handlers_past_teardown(trainer: pl.Trainer, handlers: dict[int, Any]) -> dict[int, Any]:
    """Make Lightning put ``handlers`` back when it tears down, instead of the ones it found
    at the start of fit; returns those it found.

    Lightning restores its saved handlers in ``Trainer._teardown``, which runs before
    ``on_fit_end``, where callbacks still gather over ranks: a handler in place there must
    not start a collective of its own (Lightning's SIGTERM handler broadcasts).
    """
    # Private: Trainer._signal_connector._original_handlers (Lightning 2.0 to 2.6), the
    # dict _SignalConnector.teardown re-registers (trainer/connectors/signal_connector.py).
    saved = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    if not isinstance(saved, dict):
        return {}
    found = {}
    for signum, handler in handlers.items():
        if signum in saved:
            found[signum] = saved[signum]
            saved[signum] = handler
    return found


def ddp_used_parameter_map(trainer: pl.Trainer) -> Any | None:
    """DDP's map of the parameters used in a step, on the device, where its reducer keeps
    one (``find_unused_parameters=True`` without a static graph); None otherwise."""
    model = trainer.strategy.model  # the DistributedDataParallel wrapper under DDP
    reducer = getattr(model, "reducer", None)
    if reducer is None or not getattr(model, "find_unused_parameters", False):
        return None
    if getattr(model, "static_graph", False):
        return None
    # Private, in torch: Reducer._get_local_used_map (torch 2.0 to 2.14), the device map
    # that reducer.cpp copies into its host map once per backward.
    return reducer._get_local_used_map()


def started_ranks(trainer: pl.Trainer) -> list:
    """The processes of the ranks this process started (Lightning's launcher starts a
    node's other ranks from its local rank zero), as ``Popen``; empty where processes were
    started by something else (torchrun, SLURM)."""
    # Undocumented: _SubprocessScriptLauncher.procs (Lightning 2.0 to 2.6), the Popen of
    # local ranks 1..n-1 in order.
    if trainer.local_rank != 0:
        return []
    return list(getattr(trainer.strategy.launcher, "procs", None) or [])


def child_exit_codes(trainer: pl.Trainer) -> dict[int, int | None]:
    """``{global rank: return code or None while running}`` of ``started_ranks``."""
    first = trainer.node_rank * trainer.num_devices
    return {first + i + 1: proc.poll() for i, proc in enumerate(started_ranks(trainer))}


def defer_child_observer() -> Callable[[], None]:
    """While a faster watch runs, keep Lightning's launcher from SIGKILLing this process.

    Lightning's launcher checks its child ranks every 5 s from a thread and, at the first
    that died, SIGKILLs every process, this one included: exit code -9 and no message.
    ``StopOnRankFailure`` checks every ``poll_interval`` and exits with a line naming the
    rank; when the two race, Lightning's kill wins one time in ten. Returns the undo.
    """
    import threading

    # Undocumented: lightning.fabric.strategies.launchers.subprocess_script.
    # _ChildProcessObserver (Lightning 2.1 to 2.6), a thread whose run() calls self._run()
    # every _sleep_period seconds and kills everything when it finds a failed child.
    observers = [t for t in threading.enumerate() if type(t).__name__ == "_ChildProcessObserver"]
    undos = [patch(observer, "_run", lambda: False) for observer in observers]

    def undo() -> None:
        for each in undos:
            each()

    return undo


_CORE = os.path.dirname(os.path.abspath(pl.LightningModule.log.__code__.co_filename)) + os.sep
_RESULT_COLLECTION = os.path.join(
    "lightning", "pytorch", "trainer", "connectors", "logger_connector", "result.py"
)
# The Trainer and its connectors: what a metric read passes through on its way from the
# reader (the loop, a progress bar, a callback reading trainer.callback_metrics).
_TRAINER_DIR = os.path.join(os.path.dirname(_CORE.rstrip(os.sep)), "trainer") + os.sep


class LoggedAt:
    """Where each ``prog_bar=True`` metric was logged, so that Lightning's conversion of it
    after the step is reported at the user's ``self.log`` line.

    Lightning turns every ``prog_bar=True`` tensor into a number after every training
    step, outside any user frame (``ResultCollection.metrics``, result.py:492 in 2.6: an
    ``.item()`` per metric). ``install()`` wraps ``LightningModule.log`` while a fit runs
    and keeps, per ``(hook, name)``, the user line that logged it; ``origin`` is a
    ``SyncDetector`` origin that finds that line from the converting frame.

    Example::

        logged = LoggedAt()
        with logged.install():
            detector = SyncDetector("cpu", origins=(logged.origin,))
    """

    def __init__(self) -> None:
        self.lines: dict[tuple[str, str], tuple[str, int, str]] = {}

    @contextlib.contextmanager
    def install(self) -> Iterator[None]:
        original = pl.LightningModule.log
        lines = self.lines

        @functools.wraps(original)
        def log(module, name, value, *args, **kwargs):
            if kwargs.get("prog_bar") or (len(args) > 0 and args[0] is True):
                # The line that logged: the user's, else the library's that called log
                # (a demo module's own training_step), past Lightning's log_dict.
                caller = sys._getframe(1)
                while caller is not None and caller.f_code.co_filename.startswith(_CORE):
                    caller = caller.f_back
                frame = user_frame(caller) or caller
                if frame is not None:
                    # Private: LightningModule._current_fx_name (Lightning 2.0 to 2.6), the
                    # ``fx`` of the ResultCollection key Lightning stores the metric under.
                    code = frame.f_code
                    lines[(module._current_fx_name, name)] = (
                        code.co_filename, frame.f_lineno, code.co_name
                    )  # fmt: skip
            return original(module, name, value, *args, **kwargs)

        undo = patch(pl.LightningModule, "log", log)
        try:
            yield
        finally:
            undo()

    def origin(self, frame: Any) -> tuple[str, int, str, Any] | None:
        """The user line that logged the metric being converted in ``frame``, and the frame
        that asked for it (the reader: the loop, a progress bar, a callback), the first
        outside the Trainer and its connectors. Where ``prog_bar_numbers_when_read``
        converts them all at a read, the reader is the line: no one ``self.log`` is."""
        code = frame.f_code
        if code is numbers_in_one_copy.__code__ and frame.f_back.f_code.co_name == "log_metrics":
            # Private: _LoggerConnector.log_metrics (2.0 to 2.6) hands the loggers their values
            asked = frame.f_back
            return asked.f_code.co_filename, asked.f_lineno, "log_metrics", asked
        if code.co_filename == __file__ and code.co_name == "progress_bar_metrics":
            reader = _reader(frame)
            if reader is None:
                return None
            asked = reader.f_code
            return asked.co_filename, reader.f_lineno, asked.co_name, reader
        if code.co_name != "metrics" or not code.co_filename.endswith(_RESULT_COLLECTION):
            return None
        # Private: the loop variable ``result_metric`` of ResultCollection.metrics and its
        # ``meta.fx``/``meta.name`` (Lightning 2.0 to 2.6): the metric being converted.
        meta = frame.f_locals["result_metric"].meta
        line = self.lines.get((meta.fx, meta.name))
        if line is None:
            return None
        return (*line, _reader(frame))


def _reader(frame: Any) -> Any:
    """The first frame outside the Trainer, its connectors and this module, past ``frame``."""
    reader = frame.f_back
    while reader is not None and (
        reader.f_code.co_filename.startswith(_TRAINER_DIR) or reader.f_code.co_filename == __file__
    ):
        reader = reader.f_back
    return reader
