"""The default set: every gpu_busy callback and plugin, for any ``Trainer``, in one call.

``defaults()`` is what ``make train`` runs with and what ``python -m gpu_busy run`` adds to
a script's Trainer; ``complete()`` is the one rule that adds it to what a Trainer already
has: a kind the Trainer already has (its own progress bar, ``ModelCheckpoint``, checkpoint
IO, ...) stays, and ours of that kind is left out.

Example::

    import gpu_busy
    trainer = pl.Trainer(max_epochs=10, **gpu_busy.defaults(monitor="val/acc"))
    # or, with callbacks of your own kept:
    trainer = pl.Trainer(**gpu_busy.complete(callbacks=[TQDMProgressBar()]).trainer_kwargs)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.plugins.io import CheckpointIO

from gpu_busy import callbacks as cb
from gpu_busy import lightning_names
from gpu_busy.callbacks.every_rank import EveryRankAttached
from gpu_busy.checkpoint_io import BackgroundCheckpointIO
from gpu_busy.log import get_logger
from gpu_busy.options import Options


@dataclass(frozen=True)
class Default:
    """One row of the default set: what to build, and the kind that stands for it (a
    Trainer that already has an object of ``kind`` keeps its own)."""

    name: str
    kind: type
    make: Callable[[Options], Any]
    wanted: Callable[[Options, dict], bool] = lambda options, settings: True


def _checkpoints_on(options: Options, settings: dict) -> bool:
    # Lightning refuses a ModelCheckpoint beside enable_checkpointing=False
    return options.monitor is not None and settings.get("enable_checkpointing") is not False


def _bar_on(options: Options, settings: dict) -> bool:
    return settings.get("enable_progress_bar") is not False  # else Lightning refuses one


def _best(options: Options) -> cb.BestCheckpoint:
    return cb.BestCheckpoint(
        monitor=options.monitor,
        mode=options.mode,
        save_top_k=1,
        filename="best-epoch{epoch:02d}",
        auto_insert_metric_name=False,
    )


def _last(options: Options) -> ModelCheckpoint:
    # the latest state at every epoch end, what --ckpt_path last resumes (save_last on the
    # best one would write last.ckpt only in epochs that improve the monitor)
    return ModelCheckpoint(filename="last", save_top_k=1, enable_version_counter=False)


def _prefetch_on(options: Options, settings: dict) -> bool:
    return options.prefetch


# In the order a Trainer gets them: the rank check first, since it must run before any
# other callback's set-up makes a collective call.
# fmt: off
CALLBACKS: tuple[Default, ...] = (
    Default("EveryRankAttached", EveryRankAttached,
            lambda o: EveryRankAttached(timeout=o.rank_wait)),
    Default("BestCheckpoint", ModelCheckpoint, _best, _checkpoints_on),
    Default("ModelCheckpoint (last)", ModelCheckpoint, _last, _checkpoints_on),
    Default("CheckpointRngState", cb.CheckpointRngState, lambda o: cb.CheckpointRngState()),
    Default("OneWriterPerCheckpoint", cb.OneWriterPerCheckpoint,
            lambda o: cb.OneWriterPerCheckpoint()),
    # refreshed at most every 0.5 s; logged metrics reach it without a wait
    Default("LoggingStepProgressBar", ProgressBar,
            lambda o: cb.LoggingStepProgressBar(refresh_rate=10), _bar_on),
    Default("StreamPrefetcher", cb.StreamPrefetcher, lambda o: cb.StreamPrefetcher(),
            _prefetch_on),
    Default("StopOnSignal", cb.StopOnSignal, lambda o: cb.StopOnSignal(wait=o.stop_wait)),
    Default("StopOnNonFiniteLoss", cb.StopOnNonFiniteLoss, lambda o: cb.StopOnNonFiniteLoss()),
    Default("StopOnRankFailure", cb.StopOnRankFailure,
            lambda o: cb.StopOnRankFailure(peer_timeout=o.peer_timeout)),
    Default("SyncPointDetector", cb.SyncPointDetector,
            lambda o: cb.SyncPointDetector(strict=o.strict)),
    Default("IdleTimeMonitor", cb.IdleTimeMonitor, lambda o: cb.IdleTimeMonitor()),
    Default("ThroughputMonitor", cb.ThroughputMonitor, lambda o: cb.ThroughputMonitor()),
    Default("RunSummary", cb.RunSummary, lambda o: cb.RunSummary()),
)
# fmt: on
# Checkpoints staged beside their target and renamed into place, written by a background
# thread from a snapshot of the state: training waits only for the snapshot
# (gpu_busy.checkpoint_io.AtomicCheckpointIO instead: the loop waits for the whole write).
PLUGINS: tuple[Default, ...] = (
    Default(
        "BackgroundCheckpointIO",
        CheckpointIO,
        lambda o: BackgroundCheckpointIO(),
        lambda o, settings: not _on_xla(settings),
    ),
)


def _on_xla(settings: dict) -> bool:
    """Whether the Trainer runs on TPUs: Lightning's XLA strategy refuses any checkpoint IO
    but its own ``XLACheckpointIO`` (``strategies/xla.py``)."""
    asked = (settings.get("accelerator"), settings.get("strategy"))
    names = " ".join(v if isinstance(v, str) else type(v).__name__ for v in asked if v)
    return "xla" in names.lower() or "tpu" in names.lower()


@dataclass
class Completed:
    """A Trainer's callbacks and plugins with the default set added, and what was done."""

    callbacks: list[Any]
    plugins: list[Any]
    added: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # the Trainer's own, standing for ours
    left_out: list[str] = field(default_factory=list)  # ours, turned off by a setting

    @property
    def trainer_kwargs(self) -> dict[str, list[Any]]:
        return {"callbacks": self.callbacks, "plugins": self.plugins}

    def line(self) -> str:
        """What was added and kept, in one line."""
        parts = [f"added {', '.join(self.added) or 'nothing'}"]
        if self.kept:
            parts.append(f"kept the Trainer's own {', '.join(self.kept)}")
        if self.left_out:
            parts.append(f"left out {', '.join(self.left_out)}")
        return "gpu_busy: " + "; ".join(parts)


def _as_list(value: Any) -> list[Any]:
    """The items of a Trainer's ``callbacks`` or ``plugins`` as Lightning reads them
    (``callback_connector.py``, ``accelerator_connector.py``): a Callback, or an object that
    is not iterable, stands alone; any iterable gives its items (Hydra passes a ListConfig)."""
    if value is None:
        return []
    if isinstance(value, pl.Callback) or not isinstance(value, Iterable):
        return [value]
    return list(value)


def complete(
    callbacks: Any = None, plugins: Any = None, settings: dict | None = None, **options: Any
) -> Completed:
    """``callbacks`` and ``plugins`` (as a Trainer takes them) with every default whose kind
    they lack; ``settings`` are the Trainer's other arguments (``enable_checkpointing=False``
    leaves out our checkpoints, ``barebones=True`` everything); ``options``: the fields of
    ``gpu_busy.options.Options`` (the environment's ``GPU_BUSY_*`` for those not given).

    Ours go first: the rank check must run before any callback's collective set-up.
    """
    if (apart := lightning_names.apart()) is not None:  # a pytorch_lightning Trainer would
        # take our bar and checkpoints for plain callbacks and add its own beside them
        get_logger(__name__).warning("gpu_busy: the set is lightning.pytorch's (%s)", apart)
    settings = settings or {}
    chosen = Options.resolved(**options)
    own_callbacks, own_plugins = _as_list(callbacks), _as_list(plugins)
    done = Completed(callbacks=[], plugins=[])
    if settings.get("barebones"):
        done.callbacks, done.plugins = own_callbacks, own_plugins
        done.left_out.append("all of it (barebones=True)")
        return done
    for rows, own, out in ((CALLBACKS, own_callbacks, done.callbacks),
                           (PLUGINS, own_plugins, done.plugins)):  # fmt: skip
        for row in rows:
            theirs = next((o for o in own if isinstance(o, row.kind)), None)
            if theirs is not None:
                if type(theirs).__name__ not in done.kept:
                    done.kept.append(type(theirs).__name__)
            elif row.wanted(chosen, settings):
                out.append(row.make(chosen))
                done.added.append(row.name)
            elif row.kind is not ModelCheckpoint or chosen.monitor is not None:
                done.left_out.append(row.name)
        out.extend(own)
    return done


def defaults(**options: Any) -> dict[str, list[Any]]:
    """The default set as ``Trainer`` arguments: ``Trainer(**defaults(monitor="val/acc"))``.

    ``options``: the fields of ``gpu_busy.options.Options`` (docs/GUIDE.md's table).
    """
    return complete(**options).trainer_kwargs
