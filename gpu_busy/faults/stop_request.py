"""SIGTERM and SIGINT as a request to stop, which the training loop answers when it can.

The handler only records the signal (printing or a collective there could deadlock); the
loop polls ``requested`` at a step boundary. A second SIGINT raises ``TrainingStopped`` at
once, except inside ``stops_deferred()`` (a checkpoint being written), which it lets end.
So does a boundary that does not come within ``wait`` seconds (a loader that never yields,
a step that hangs): a timer signals the main thread again, which interrupts a blocking
call there (a sleep, a lock, a queue read), and the handler raises ``overdue()``'s stop.

Example::

    stop = StopRequest(wait=20.0, overdue=lambda: TrainingStopped("no step ended", 143))
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
from collections.abc import Callable, Iterator
from types import FrameType

from gpu_busy.faults.training_stopped import TrainingStopped, resume_hint

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_deferring = 0  # blocks of stops_deferred() open on the main thread
_pending: list[BaseException] = []


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

    def __init__(
        self, wait: float | None = None, overdue: Callable[[], BaseException] | None = None
    ) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self.wait, self.overdue = wait, overdue
        self._timer: threading.Timer | None = None
        self._late = False  # the timer fired: the next handler call stops the run
        self._lock = threading.Lock()  # the timer signals only while the handler is ours

    def __getstate__(self) -> dict:
        # A pickled Trainer (ddp_spawn) carries the request unarmed: no timer, no lock
        return {"signum": self.signum, "wait": self.wait}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["wait"])
        self.signum = state["signum"]

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
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            for signum, previous in self._previous.items():
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, previous)
            self._previous = {}

    def _start_timer(self) -> None:
        if self.wait is None or self.overdue is None or self._timer is not None:
            return
        main = threading.main_thread().ident
        self._timer = threading.Timer(self.wait, self._time_is_up, args=(main,))
        self._timer.daemon = True
        self._timer.start()

    def _time_is_up(self, main: int) -> None:
        with self._lock:
            if self._previous and self.signum is not None:
                self._late = True
                signal.pthread_kill(main, self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._late and self.overdue is not None:
            self._late = False
            _raise_unless_deferred(self.overdue())
            return
        if self.signum is not None and signum == signal.SIGINT:
            # A second Ctrl+C: stop now, without saving. Not KeyboardInterrupt, which
            # Lightning turns into its own message and exit code 1.
            where = (
                "once the checkpoint being written was saved"
                if _deferring
                else "at once, without saving this step; the checkpoints saved before are kept"
            )
            stop = TrainingStopped(
                f"Ctrl+C twice: stopped {where} ({resume_hint()})",
                exit_code=128 + signal.SIGINT,
                failure=False,
            )
            _raise_unless_deferred(stop)
            return
        if self.signum is None:
            self.signum = signum
            self._start_timer()


def _raise_unless_deferred(stop: BaseException) -> None:
    """Raise ``stop`` now, or at the end of the ``stops_deferred`` block open."""
    if _deferring:
        _pending.append(stop)
        return
    raise stop


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
