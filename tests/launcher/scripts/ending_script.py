"""A plain Lightning script over ``tests.helpers.doors``: the launcher's door to the same
endings the entry point's tests give through ``--model.init_args.ending``.

    python ending_script.py ENDING [--val-batches N] [--max-steps N] [--strategy S --devices N]
                             [--plain-loader]
"""

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from tests.helpers.doors import EndingData, EndingModel

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ending")
    parser.add_argument("--val-batches", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=16)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--plain-loader", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", strategy=args.strategy, devices=args.devices,
        max_steps=args.max_steps, log_every_n_steps=1, num_sanity_val_steps=0,
        logger=CSVLogger("runs", name="ending"),
        enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(
        EndingModel(args.ending),
        EndingData(args.ending, val_batches=args.val_batches, plain_loader=args.plain_loader),
    )
