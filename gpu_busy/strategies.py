"""FSDP2 over every rank: Lightning's ``ModelParallelStrategy`` with no tensor parallelism.

Its ``"auto"`` mesh would make a node one tensor-parallel group; this class puts every
rank in ``data_parallel`` once the processes exist, and broadcasts rank zero's buffers
(BatchNorm's statistics, which FSDP2 leaves per rank) before each validation and save,
as DDP's statistics. The model shards itself in ``configure_model`` over
``self.device_mesh["data_parallel"]``. Why and the sources: docs/ARCHITECTURE.md,
"Sharding (FSDP2)".

Example (``configs/fsdp.yaml``; ``make train STRATEGY=fsdp GPUS=4``)::

    trainer = pl.Trainer(strategy=FullyShardedStrategy(), devices=4)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from gpu_busy import lightning_compat as compat
from gpu_busy.errors import UserError


class FullyShardedStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1)``;
    every other argument is ``ModelParallelStrategy``'s."""

    def __init__(self, **kwargs: Any) -> None:
        for fixed in ("data_parallel_size", "tensor_parallel_size"):
            if fixed in kwargs:
                raise TypeError(
                    f"FullyShardedStrategy sets {fixed} itself (every rank shards); for "
                    "tensor parallelism use lightning's ModelParallelStrategy"
                )
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self._ranks: dist.ProcessGroup | None = None  # the data-parallel group, once it exists

    def setup_environment(self) -> None:
        # The world is known here (the launcher or torchrun made the processes); the
        # parent resolves "auto" to the number of nodes, which is one rank per node.
        compat.set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()
        # Once: slicing the mesh builds a sub-mesh from a host tensor (a .tolist() per call)
        self._ranks = self.device_mesh["data_parallel"].get_group()

    def setup(self, trainer: Any) -> None:
        self.check_model(self.lightning_module)
        super().setup(trainer)

    @staticmethod
    def check_model(module: Any) -> None:
        """Lightning's own check (the parent's ``setup``), as one line: a model that does
        not shard itself. The entry point asks before it starts the other ranks."""
        if module is not None and not is_overridden("configure_model", module):
            raise UserError(
                f"STRATEGY=fsdp: {type(module).__name__} shards nothing; give it a "
                "configure_model() that calls torch.distributed.fsdp.fully_shard on its "
                "repeated blocks, then on itself, over self.device_mesh['data_parallel'] (as "
                "template/models/classifier.py does), or train it with DDP"
            )

    def on_validation_start(self) -> None:
        self.broadcast_buffers()
        super().on_validation_start()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.broadcast_buffers()  # every rank saves, and the planner keeps one rank's copy
        return super().lightning_module_state_dict()

    def broadcast_buffers(self) -> None:
        """Rank zero's floating-point buffers on every data-parallel rank."""
        group = self._ranks
        if self.model is None or group is None or self.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.model.buffers():
            if buffer.is_floating_point() and not isinstance(buffer, DTensor):
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        with torch.no_grad():
            for buffers in by_dtype.values():
                flat = _flatten_dense_tensors(buffers)
                dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
                synced = _unflatten_dense_tensors(flat, buffers)
                for buffer, value in zip(buffers, synced, strict=True):
                    buffer.copy_(value)
