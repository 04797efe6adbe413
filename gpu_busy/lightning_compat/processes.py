"""Lightning's processes and signals: the ranks its launcher started, its SIGTERM broadcast
and handlers, its child-process observer, and how it moves tensors to the CPU.

Example::

    for proc in started_ranks(trainer):       # local rank zero's Popen of the others
        proc.poll()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from gpu_busy.patches import patch


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


def children_run_through(launcher_argv: list[str]) -> Callable[[], None]:
    """Have Lightning's DDP launchers start a node's other ranks as ``launcher_argv``
    followed by the arguments of the command they would run (this process's, and a Hydra
    app's own overrides), instead of the script alone. Returns the undo.

    Lightning's launcher starts local ranks 1..n-1 by running the command of this process
    again; a script run through ``python -m gpu_busy run`` is ``__main__`` there, and would
    be run bare.
    """
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    def ours(command: list[str]) -> list[str]:
        # [python, script | -m module, *arguments]: the script's start replaced with ours
        start = 3 if len(command) > 1 and command[1] == "-m" else 2
        return [*launcher_argv, *command[start:]]

    def basic(original: Callable) -> Callable:
        return lambda: ours(list(original()))

    def hydra(original: Callable) -> Callable:
        def command(local_rank: int) -> tuple[list[str], str]:
            argv, cwd = original(local_rank)
            return ours(list(argv)), cwd

        return command

    # Undocumented: subprocess_script._basic_subprocess_cmd and _hydra_subprocess_cmd
    # (Lightning 2.0 to 2.6), module functions each launcher module looks up when it starts
    # the other ranks (the Hydra one where the script is a Hydra app).
    undo = [
        patch(m, name, wrap(getattr(m, name)))
        for m in (launcher, fabric_launcher)
        for name, wrap in (("_basic_subprocess_cmd", basic), ("_hydra_subprocess_cmd", hydra))
    ]

    def undo_all() -> None:
        for u in undo:
            u()

    return undo_all
