"""A callback the sharded test adds from the command line: what each rank holds.

Each rank writes ``shards/params_rank<N>.json`` at the start of training: the parameters'
full element count, the count this rank holds, and whether every parameter is a DTensor
sharded over the data-parallel ranks. It reads shapes only: no sync.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
from torch.distributed.tensor import DTensor


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
