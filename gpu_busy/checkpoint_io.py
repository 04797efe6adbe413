"""AtomicCheckpointIO: Lightning's checkpoint writes, atomic on the run directory's own disk.

Lightning's ``TorchCheckpointIO`` writes a local file through an fsspec transaction that
stages it in ``$TMPDIR`` and moves it into place. On a cluster, where ``/tmp`` is
node-local and runs live on NFS or Lustre, that move is a truncate-and-copy: a kill
during it leaves ``last.ckpt`` empty, and a full ``/tmp`` fails every save. This plugin
stages beside the target instead (``gpu_busy.resume.checkpoint_file.write_atomically``),
and a failed save ends the run with one line, its earlier checkpoints whole. Remote paths
(``s3://``...) go through Lightning's own code. NumPy scalars (a scheduler's
``numpy.float64`` learning rate) are saved as Python numbers, which the resume's safe
load reads back.

Example::

    trainer = Trainer(plugins=[AtomicCheckpointIO()])
    # or in a LightningCLI config:  trainer.plugins: [gpu_busy.checkpoint_io.AtomicCheckpointIO]
"""

from __future__ import annotations

import io
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from gpu_busy.resume.checkpoint_file import plain_numbers, write_atomically


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are staged beside the target and renamed."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        checkpoint = plain_numbers(checkpoint)  # what the resume's safe load can read
        text = str(path)
        if storage_options is not None or ("://" in text and not text.startswith("file://")):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_atomically(text.removeprefix("file://"), buffer.getbuffer())
