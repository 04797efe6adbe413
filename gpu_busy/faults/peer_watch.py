"""PeerWatch: every rank learns within bounded time that another rank failed.

A thread per rank beats a heartbeat into a store every rank reaches and reads its shared
``failed`` record (first writer wins); rank zero also fails a launcher child that exited
or a heartbeat stalled past ``peer_timeout``. ``on_failure(rank, reason)`` runs on that
thread. Bounds: docs/ARCHITECTURE.md, "A failed rank".

Example::

    watch = PeerWatch(store, rank, world_size, on_failure=lambda rank, why: os._exit(1))
    watch.start()
    try:
        train()
    except Exception as e:
        watch.report_failure(f"{type(e).__name__}: {e}")
        raise
    watch.finish()
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

FAILED = "failed"


def describe_exit(code: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL``, for a process's return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class PeerWatch:
    """A heartbeat and a shared failure record for ``world_size`` ranks.

    Args:
        store: a store every rank can reach (``add``, ``set``, ``check``, ``get``,
            ``compare_set``), hosted by rank zero's process.
        rank, world_size: this process's place.
        on_failure: called once, on the watch thread, with ``(rank, reason)`` of another
            rank's failure.
        poll_interval: seconds between heartbeats and checks.
        peer_timeout: seconds without a heartbeat after which rank zero declares a rank dead.
        exit_codes: for rank zero's local children, ``{rank: return code or None}``.
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        on_failure: Callable[[int, str], None],
        *,
        poll_interval: float = 0.5,
        peer_timeout: float = 30.0,
        exit_codes: Callable[[], dict[int, int | None]] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.on_failure = on_failure
        self.poll_interval, self.peer_timeout = poll_interval, peer_timeout
        self.exit_codes = exit_codes
        self._lock = threading.Lock()  # one store call at a time (thread and main thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (count, when it changed)
        self._known: tuple[int, str] | None = None

    def start(self) -> PeerWatch:
        now = time.monotonic()
        self._beats = {r: (0, now) for r in range(self.world_size) if r != self.rank}
        self._thread.start()
        return self

    # -- called from the training (main) thread ----------------------------------------

    def report_failure(self, reason: str) -> None:
        """Record this rank's failure for the others (unless one is recorded already)."""
        self._record(self.rank, reason)

    def failure(self) -> tuple[int, str] | None:
        """The recorded failure ``(rank, reason)``, if any (this rank's included)."""
        if self._known is None:
            try:
                with self._lock:
                    if self.store.check([FAILED]):
                        self._known = _parse(self.store.get(FAILED))
            except Exception:
                if self.rank != 0:
                    self._known = (0, "is gone (its store stopped answering)")
        return self._known

    def wait_for_peer_failure(self, seconds: float) -> tuple[int, str] | None:
        """Another rank's recorded failure, waiting up to ``seconds`` for one to appear."""
        deadline = time.monotonic() + seconds
        while True:
            known = self.failure()
            if known is not None and known[0] != self.rank:
                return known
            if known is not None or time.monotonic() >= deadline:
                return None
            time.sleep(min(self.poll_interval, 0.1))

    def finish(self, wait: float | None = None) -> None:
        """A clean end on this rank. Rank zero, whose process hosts the store, then waits
        (up to ``wait``, default ``peer_timeout``) for the others to finish too."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            with self._lock:
                self.store.set(f"done/{self.rank}", "1")
            if self.rank == 0:
                others = [f"done/{r}" for r in range(1, self.world_size)]
                deadline = time.monotonic() + (self.peer_timeout if wait is None else wait)
                while others and time.monotonic() < deadline:
                    with self._lock:
                        if self.store.check(others):
                            break
                    time.sleep(0.05)
        except Exception:
            pass  # the store is gone: nobody is left to wait for

    # -- the watch thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                found = self._check()
            except Exception:
                if self._stop.is_set():
                    return
                found = (0, "is gone (its store stopped answering)") if self.rank else None
                if found is None:
                    continue
            if found is not None and found[0] != self.rank and not self._stop.is_set():
                self._known = found
                self.on_failure(*found)
                return

    def _check(self) -> tuple[int, str] | None:
        with self._lock:
            self.store.add(f"beat/{self.rank}", 1)
            if self.store.check([FAILED]):
                return _parse(self.store.get(FAILED))
        if self.rank == 0:
            dead = self._dead_peer()
            if dead is not None:
                return self._record(*dead)
        return None

    def _dead_peer(self) -> tuple[int, str] | None:
        with self._lock:
            done = {r for r in self._beats if self.store.check([f"done/{r}"])}
        for rank, code in (self.exit_codes() if self.exit_codes else {}).items():
            if code not in (None, 0) and rank not in done:
                return rank, describe_exit(code)
        now = time.monotonic()
        for rank, (count, since) in self._beats.items():
            if rank in done:
                continue
            with self._lock:
                current = self.store.add(f"beat/{rank}", 0)
            if current != count:
                self._beats[rank] = (current, now)
            elif now - since > self.peer_timeout:
                return rank, f"stopped responding for {self.peer_timeout:.0f} s (killed, or frozen)"
        return None

    def _record(self, rank: int, reason: str) -> tuple[int, str]:
        """Write ``rank``'s failure unless one is there already; returns the one that is."""
        with self._lock:
            current = self.store.compare_set(FAILED, "", f"{rank}|{reason}")
        self._known = _parse(current)
        return self._known


def _parse(value: bytes | str) -> tuple[int, str]:
    text = value.decode() if isinstance(value, bytes) else value
    rank, _, reason = text.partition("|")
    return int(rank), reason


# Messages of a collective whose peer went away (gloo's TCP transport, NCCL).
_LOST_PEER_HINTS = ("Connection closed by peer", "Connection reset by peer", "NCCL", "gloo")


def lost_a_peer(exception: BaseException) -> bool:
    """Whether a collective failed because a peer went away (rather than on this rank)."""
    text = f"{type(exception).__name__} {exception}"
    return isinstance(exception, dist.DistError) or any(h in text for h in _LOST_PEER_HINTS)


def failure_line(rank: int, reason: str) -> str:
    """The one line that says a rank failed and the others were stopped."""
    if reason.startswith(("was ", "is ", "stopped ")):  # no word from the rank itself
        hint = " (the out-of-memory killer sends SIGKILL)" if "SIGKILL" in reason else ""
        what = f"{reason}{hint}; stopped the other ranks"
    else:
        what = f"failed ({reason}); stopped the other ranks. Its traceback is above"
    return f"error: rank {rank} {what}; checkpoints already written are kept"
