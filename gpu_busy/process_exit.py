"""How a process that trained on several ranks ends: its exit code, never an abort.

Python's own exit finalizes the interpreter with torch's C++ threads still running, and
two upstream behaviours turn that into ``terminate called without an active exception``
(SIGABRT) after a fit that succeeded:

- a thread that returns from torch's C++ code while the interpreter finalizes is ended
  by ``pthread_exit`` inside a ``noexcept`` destructor (pybind11's ``gil_scoped_release``;
  pytorch/pytorch#38228, CPython's ``take_gil`` before 3.14);
- ``destroy_process_group`` drops torch's own references, but a sharded model's
  ``DeviceMesh`` keeps its groups (``_pg_registry``, torch/distributed/device_mesh.py), so
  their gloo threads live on into finalization, and the groups' C++ destructors run
  there, or never.

So a process that joined a process group leaves with ``os._exit`` once its own exit work
is done: the threads that are not daemons joined, the ``atexit`` handlers run (loggers'
flushes, ``logging.shutdown``), every open Python file flushed. Details:
docs/ARCHITECTURE.md, "Every rank ends".

A rank that ``multiprocessing`` started with ``spawn`` (Lightning's ``ddp_spawn``) runs no
entry point of ours; ``end_spawned_rank_by_the_rule`` gives it the same end.

Example::

    if __name__ == "__main__":
        end_process(main)          # main() returns the exit code
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import NoReturn

from gpu_busy.patches import patch

_joined = False  # this process destroyed a process group it had joined


def end_group() -> None:
    """Destroy the default process group, where there is one: after a success only (a
    failed rank may leave the others inside a collective). No collective."""
    global _joined
    if _in_a_group():
        sys.modules["torch.distributed"].destroy_process_group()
        _joined = True


def joined_a_group() -> bool:
    """Whether this process joined a process group (still, or one ``end_group`` ended)."""
    return _joined or _in_a_group()


def _in_a_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported: never joined
    return dist is not None and dist.is_available() and dist.is_initialized()


def end_process(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and end the process with its exit code (an uncaught error: its
    traceback and 1; Ctrl+C: 130), through ``leave`` where the process joined a group."""
    try:
        code = exit_code(main())
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())  # the traceback Python would print
        code = 1
    if not joined_a_group():
        sys.exit(code)
    leave(code)


def leave(code: int) -> NoReturn:
    """End now with ``code``, having done what Python's exit does for the program (the
    threads that are not daemons joined, ``atexit`` handlers, open files flushed) but
    without finalizing the interpreter under torch's threads."""
    for thread in threading.enumerate():
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()  # public in effect: the handlers Python's exit would run
    with warnings.catch_warnings():  # isinstance reads __class__, which some objects warn
        warnings.simplefilter("ignore")  # of (torch.distributed.reduce_op, deprecated)
        streams = [o for o in gc.get_objects() if isinstance(o, io.IOBase)]
    for stream in [*streams, sys.stdout, sys.stderr]:
        with contextlib.suppress(Exception):  # a stream whose device is gone: nothing to save
            if not stream.closed and stream.writable():
                stream.flush()
    os._exit(code)


def end_spawned_rank_by_the_rule() -> None:
    """In a process ``multiprocessing`` spawned, end through ``leave`` as well.

    A spawned child's last act is ``sys.exit(code)`` in ``multiprocessing.spawn.spawn_main``
    (CPython's multiprocessing/spawn.py, line 123 in 3.11), with the code of the function it
    ran: Python's exit, under the group's threads. Only that call is taken over; any other
    ``sys.exit`` raises ``SystemExit`` as always. Children of ``fork`` and ``forkserver``
    end with ``os._exit`` already (popen_fork.py line 73, forkserver.py line 281).

    ``import gpu_busy`` calls it: a spawned rank imports the package when it unpickles
    the set, before ``spawn_main`` ends it.

    Example::

        end_spawned_rank_by_the_rule()   # in gpu_busy/__init__.py
    """
    # Called under spawn_main (it imports __main__ and unpickles what the child runs, the
    # set among it); parent_process() is set only after that, and sys.argv is the parent's.
    spawn = sys.modules.get("multiprocessing.spawn")
    if spawn is None or isinstance(sys.exit, _SpawnedRankExit):
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not spawn.spawn_main.__code__:
        frame = frame.f_back
    if frame is None:
        return
    patch(sys, "exit", _SpawnedRankExit(sys.exit, spawn.spawn_main.__code__))  # to the end


class _SpawnedRankExit:
    """``sys.exit`` that ends through ``leave`` where spawn_main calls it."""

    def __init__(self, python_exit: Callable[..., NoReturn], spawn_main: object) -> None:
        self.python_exit, self.spawn_main = python_exit, spawn_main

    def __call__(self, status: object = None) -> NoReturn:
        if sys._getframe(1).f_code is self.spawn_main and joined_a_group():
            leave(exit_code(status))
        self.python_exit(status)


def exit_code(value: object) -> int:
    """The exit code Python gives ``sys.exit(value)``: None is 0, a number itself, and any
    other value is printed and is 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1
