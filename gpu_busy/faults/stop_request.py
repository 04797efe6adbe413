"""SIGTERM and SIGINT as a request to stop, which the training loop answers when it can.

The handler only records the signal (printing or a collective there could deadlock); the
loop polls ``requested`` at a step boundary. A second SIGINT raises ``TrainingStopped`` at
once, except inside ``stops_deferred()`` (a checkpoint being written), which it lets end.

Example::

    stop = StopRequest()
    stop.install()
    for step, batch in enumerate(loader):
        train(batch)
        if stop.requested:
            save(); break
    stop.uninstall()
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from gpu_busy.faults.training_stopped import TrainingStopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_deferring = 0  # blocks of stops_deferred() open on the main thread
_pending: list[TrainingStopped] = []


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A second Ctrl+C inside the block stops the run at its end, not in the middle. On the
    main thread only: a block in another thread (a background checkpoint write) does not
    hold the loop back; whoever stops waits for that thread instead."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        pending = list(_pending) if not _deferring else []
        if not _deferring:
            _pending.clear()
    if pending:
        raise pending[0]


class StopRequest:
    """Records the first SIGTERM or SIGINT; install from the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""

    def install(self) -> bool:
        """Take over SIGTERM and SIGINT; False (nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def restore_to(self, handlers: dict[int, object]) -> None:
        """At ``uninstall``, put these back for their signals instead of those found at
        ``install``."""
        for signum, handler in handlers.items():
            if signum in self._previous:
                self._previous[signum] = handler

    def uninstall(self) -> None:
        """Put back the handlers found at ``install``, where this one is still in place."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            # A second Ctrl+C: stop now, without saving. Not KeyboardInterrupt, which
            # Lightning turns into its own message and exit code 1.
            if _deferring:
                _pending.append(
                    TrainingStopped(
                        "Ctrl+C twice: stopped once the checkpoint being written was saved "
                        "(resume with --ckpt_path last)",
                        exit_code=128 + signal.SIGINT,
                        failure=False,
                    )
                )
                return
            raise TrainingStopped(
                "Ctrl+C twice: stopped at once, without saving this step; the checkpoints "
                "saved before are kept (resume with --ckpt_path last)",
                exit_code=128 + signal.SIGINT,
                failure=False,
            )
        if self.signum is None:
            self.signum = signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
