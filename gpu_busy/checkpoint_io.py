"""Lightning's checkpoint writes, atomic on the run directory's own disk, and in the background.

``AtomicCheckpointIO`` stages each file beside its target (not in ``$TMPDIR``), so a kill
leaves the previous checkpoint whole; ``BackgroundCheckpointIO`` (the default config's)
makes the same write from a thread, holding the loop only for a snapshot of the state.
Why, what waits for what, and the failure lines: docs/ARCHITECTURE.md, "Saving and
finding checkpoints".

Example::

    trainer = Trainer(plugins=[BackgroundCheckpointIO()])
    # or in a LightningCLI config:  trainer.plugins: [gpu_busy.checkpoint_io.AtomicCheckpointIO]
"""

from __future__ import annotations

import errno
import io
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from gpu_busy.log import get_logger
from gpu_busy.resume.checkpoint_file import SaveFailed, plain_numbers, write_atomically
from gpu_busy.resume.snapshot import StateSnapshot

log = get_logger(__name__)


def _local(path: Any, storage_options: Any) -> str | None:
    """The local file a save goes to; None for remote storage (``s3://``...)."""
    text = str(path)
    if storage_options is not None or ("://" in text and not text.startswith("file://")):
        return None
    return text.removeprefix("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are staged beside the target and renamed."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        checkpoint = plain_numbers(checkpoint)  # what the resume's safe load can read
        target = _local(path, storage_options)
        if target is None:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_atomically(target, buffer.getbuffer())


class BackgroundCheckpointIO(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` whose local writes run in a thread, from a snapshot.

    Args:
        background: True: always; False: never (the loop waits for each write, as
            ``AtomicCheckpointIO``); None: where the state lives on a GPU. Training on a
            CPU keeps every core busy, so a writer thread would take them from training:
            on a 2-core CPU, saves every 100 steps in the background ran at 792 samples/s
            against 846 in place (``python -m bench.checkpoints``, docs/BENCHMARKS.md).
    """

    def __init__(self, background: bool | None = None) -> None:
        super().__init__()
        self.background = background
        self.in_background: bool | None = None  # decided at a fit's first save, kept after
        self._decided = False  # in this fit
        self._told_in_place = False
        self.snapshot = StateSnapshot()
        # per background save: how long the loop was held, and the part of it spent waiting
        # for the previous write; per write: how long the writer took
        self.blocked_s: list[float] = []
        self.waited_s: list[float] = []
        self.write_s: list[float] = []
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None
        self._writing: str | None = None  # the file the write in flight goes to
        self._failed: dict[str, SaveFailed] = {}  # by file: its newest save did not land

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        target = _local(path, storage_options)
        started = time.perf_counter()
        self.wait()  # one write at a time: its snapshot buffers are reused now
        waited = time.perf_counter() - started
        if target is None or not self._in_background(checkpoint):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        try:
            state, ready = self.snapshot.take(checkpoint)
        except Exception as err:  # pickling refused an object: torch.save says it best
            if not self._told_in_place:
                log.warning(
                    "checkpoint %s is written in place: its state could not be copied for a "
                    "background write (%s: %s)", target, type(err).__name__, err,
                )  # fmt: skip
                self._told_in_place = True
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if not self.blocked_s:
            log.info(
                "checkpoints are written in the background from a snapshot of the state: "
                "%.0f MiB of %s host memory held for it between saves",
                self.snapshot.bytes / 2**20,
                "pinned" if self.snapshot.pinned else "ordinary",
            )
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._in_flight = self._writer.submit(self._write, state, ready, target)
        self._writing = target
        self.blocked_s.append(time.perf_counter() - started)
        self.waited_s.append(waited)

    def _in_background(self, checkpoint: dict[str, Any]) -> bool:
        if not self._decided:
            self._decided = True
            self.in_background = self.background
            if self.background is None:
                self.in_background = _holds_cuda_tensors(checkpoint)
                if not self.in_background:
                    log.info(
                        "checkpoints are written in place: the state is in host memory, where "
                        "training uses the cores a writer thread would (background=True "
                        "forces it)"
                    )
        return self.in_background

    def _write(self, state: Any, ready: Any, target: str) -> None:
        started = time.perf_counter()
        ready()  # the device's copies into the snapshot have landed
        buffer = io.BytesIO()
        torch.save(plain_numbers(state), buffer)
        try:
            write_atomically(target, buffer.getbuffer())
        except SaveFailed as e:
            self._failed[target] = e
            log.error("checkpoint write failed in the background: %s", e.strerror)
            return
        finally:
            self.write_s.append(time.perf_counter() - started)
        self._failed.pop(target, None)

    def wait(self) -> None:
        """Returns once no write is in flight; an error other than a failed write (one the
        snapshot could not pickle) is raised here, in the loop."""
        in_flight, self._in_flight, self._writing = self._in_flight, None, None
        if in_flight is not None:
            in_flight.result()

    def remove_checkpoint(self, path) -> None:
        if self._writing is not None and _local(path, None) == self._writing:
            self.wait()  # its write would land after the removal
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        """The end of the run, however it ends: the write in flight lands first."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
        super().teardown()
        self._decided = False  # the next fit may run elsewhere; in_background stays readable
        failed, self._failed = list(self._failed.values()), {}
        if failed:
            raise SaveFailed(
                failed[-1].errno or errno.EIO,
                "; ".join(e.strerror for e in failed) + " (written in the background)",
            )


def _holds_cuda_tensors(checkpoint: Any) -> bool:
    found = []
    apply_to_collection(checkpoint, torch.Tensor, lambda t: found.append(t.is_cuda))
    return any(found)
