"""FSDP2 over every rank: Lightning's ``ModelParallelStrategy`` with no tensor parallelism.

``ModelParallelStrategy`` builds a 2-D device mesh, ``data_parallel`` x ``tensor_parallel``,
and its ``"auto"`` sizes are one node per data-parallel group and every GPU of a node in
one tensor-parallel group (``lightning/pytorch/strategies/model_parallel.py``,
``setup_environment``). Sharding alone (ZeRO-3: parameters, gradients and optimizer state
split over all ranks) wants the opposite: every rank in ``data_parallel``, a
tensor-parallel size of 1. A config cannot name the world size, so this class sets it
once the processes exist. The model shards itself in ``configure_model`` over
``self.device_mesh["data_parallel"]`` (``torch.distributed.fsdp.fully_shard``), as the
example's ``ImageClassifier`` does.

Example (``configs/fsdp.yaml``; ``make train STRATEGY=fsdp GPUS=4``)::

    trainer = pl.Trainer(strategy=FullyShardedStrategy(), devices=4)
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy


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

    def setup_environment(self) -> None:
        # The world is known here (the launcher or torchrun made the processes); the
        # parent resolves "auto" to the number of nodes, which is one rank per node.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
