"""A callback the sharded test adds from the command line: what each rank holds.

Each rank writes ``shards/params_rank<N>.json`` at the start of training: the parameters'
full element count, the count this rank holds, and whether every parameter is a DTensor
sharded over the data-parallel ranks (shapes only: no sync). At the end of training the
ranks gather the full weights, which rank zero saves to ``shards/final_<version>.pt``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from template.models import ImageClassifier
from tests.helpers.foreign_modules import BlobClassifier, SyntheticTransformer


class RecordParameters(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        out = Path("shards")
        out.mkdir(exist_ok=True)
        (out / f"params_rank{trainer.global_rank}.json").write_text(
            json.dumps({
                "full": sum(p.numel() for p in params),
                "local": local,
                "all_dtensors": all(isinstance(p, DTensor) for p in params),
                "mesh_sizes": sorted({p.device_mesh.size() for p in params
                                      if isinstance(p, DTensor)}),
            })
        )  # fmt: skip

    def on_train_end(self, trainer, pl_module) -> None:
        full = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in pl_module.state_dict().items()
        }  # every rank: full_tensor() is a collective
        if trainer.global_rank == 0:
            torch.save(full, Path("shards") / f"final_{trainer.logger.version}.pt")


class NonFiniteFrom(ImageClassifier):
    """The example model, whose loss turns NaN from optimizer step ``nan_from_step`` on."""

    def __init__(self, nan_from_step: int = 10, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_from_step = nan_from_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if self.trainer.global_step >= self.nan_from_step else loss


class ShardedBlobClassifier(BlobClassifier):
    """A module in the style people write (dict batches, Adam, prog_bar=True), sharded as
    one FSDP2 unit: what configure_model takes for a model with no repeated blocks."""

    def configure_model(self) -> None:
        if self.device_mesh is not None and not isinstance(self.net, FSDPModule):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class ShardedTransformer(SyntheticTransformer):
    """Lightning's Transformer demo, each encoder and decoder layer one FSDP2 unit."""

    def configure_model(self) -> None:
        model = self.model.transformer
        if self.device_mesh is None or isinstance(model, FSDPModule):
            return
        ranks = self.device_mesh["data_parallel"]
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            fully_shard(layer, mesh=ranks)
        fully_shard(self.model, mesh=ranks)
