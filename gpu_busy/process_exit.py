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
from collections.abc import Callable
from typing import NoReturn

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
    streams = [o for o in gc.get_objects() if isinstance(o, io.IOBase)]
    for stream in [*streams, sys.stdout, sys.stderr]:
        with contextlib.suppress(Exception):  # a stream whose device is gone: nothing to save
            if not stream.closed and stream.writable():
                stream.flush()
    os._exit(code)


def exit_code(value: object) -> int:
    """The exit code Python gives ``sys.exit(value)``: None is 0, a number itself, and any
    other value is printed and is 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1
