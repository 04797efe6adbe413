"""How long a checkpoint save holds the training loop: written in place vs in the background.

    python -m bench.checkpoints [--state-mib 300] [--steps 40] [--every 10] [--repeats 2]
                                [--device auto|cpu|cuda]

One process, one model, the two writers interleaved: ``AtomicCheckpointIO`` (the loop waits
for the whole write) and ``BackgroundCheckpointIO`` (the loop waits for a snapshot of the
state; a thread writes). The model is a stack of square linear layers trained with Adam
(its state: weights, gradients' two moments), sized to ``--state-mib`` of checkpoint. For
each writer: the time the loop was held per save (median over saves), the fit's samples/s
with a save every ``--every`` steps, and beside them the snapshot copy alone and the fit
with no saves. Writes go to a temporary directory on the disk ``--dir`` is on. On a GPU the
background writer is the default config's (the state lives on the device); on a CPU it is
forced (``background=True``) to measure what the default leaves out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bench.results import add_device_option, chosen_device, machine, save
from gpu_busy.checkpoint_io import AtomicCheckpointIO, BackgroundCheckpointIO
from gpu_busy.resume.snapshot import StateSnapshot

WIDTH = 1024
BATCH = 64


class Stack(pl.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Timed:
    """Wraps a writer's ``save_checkpoint``: how long each call held the loop."""

    def __init__(self, plugin) -> None:
        self.plugin, self.held = plugin, []
        real = plugin.save_checkpoint

        def timed(*args, **kwargs):
            started = time.perf_counter()
            real(*args, **kwargs)
            self.held.append(time.perf_counter() - started)

        plugin.save_checkpoint = timed


def layers_for(state_mib: float) -> int:
    # per layer: weight and bias, saved three times (the values, Adam's two moments)
    per_layer = 3 * 4 * (WIDTH * WIDTH + WIDTH)
    return max(1, math.ceil(state_mib * 2**20 / per_layer))


def fit(layers: int, steps: int, every: int, plugin, folder: Path, device: str) -> float:
    """samples/s of a fit with a save every ``every`` steps (0: none)."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(BATCH * steps, WIDTH)), batch_size=BATCH)
    callbacks = []
    if every:
        callbacks.append(
            ModelCheckpoint(folder, "last", every_n_train_steps=every, enable_version_counter=False)
        )
    trainer = pl.Trainer(
        accelerator=device, devices=1, max_steps=steps, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(every),
        plugins=[plugin] if plugin is not None else None,
    )  # fmt: skip
    started = time.perf_counter()
    trainer.fit(Stack(layers), data)
    return BATCH * steps / (time.perf_counter() - started)


def run(state_mib: float, steps: int, every: int, repeats: int, folder: Path, device: str) -> dict:
    layers = layers_for(state_mib)
    held: dict[str, list[float]] = {"in place": [], "background": []}
    rate: dict[str, list[float]] = {"in place": [], "background": [], "no saves": []}
    snapshot_bytes = 0
    fit(layers, 4, 0, None, folder, device)  # the first fit in a process: imports, allocator
    for _ in range(repeats):  # interleaved, so drift hits each alike
        arms = (("in place", AtomicCheckpointIO), ("background", _background))
        for arm, make in arms:
            timed = Timed(make())
            rate[arm].append(fit(layers, steps, every, timed.plugin, folder, device))
            held[arm] += timed.held[1:]  # the first save allocates the snapshot's buffers
            if arm == "background":
                snapshot_bytes = timed.plugin.snapshot.bytes
        rate["no saves"].append(fit(layers, steps, 0, None, folder, device))
    model = Stack(layers).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, WIDTH, device=device)).sum().backward()
    optimizer.step()
    state = {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
    snapshot = StateSnapshot()
    snapshot.take(state)[1]()  # allocates
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        _, ready = snapshot.take(state)
        copies.append(time.perf_counter() - started)
        ready()  # the copies landed: the next take may reuse the buffers
    return {
        "layers": layers,
        "state_mib": snapshot.bytes / 2**20,
        "snapshot_mib_held": snapshot_bytes / 2**20,
        "held_ms": {arm: 1e3 * statistics.median(v) for arm, v in held.items()},
        "held_ms_all": {arm: [1e3 * x for x in v] for arm, v in held.items()},
        "snapshot_copy_ms": 1e3 * statistics.median(copies),
        "samples_per_s": {arm: statistics.median(v) for arm, v in rate.items()},
    }


def _background() -> BackgroundCheckpointIO:
    return BackgroundCheckpointIO(background=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoints", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--state-mib", type=float, default=300.0, help="checkpoint size")
    parser.add_argument("--steps", type=int, default=40, help="steps per fit")
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("runs"), help="where saves go")
    parser.add_argument("--out", type=Path, default=None, help="write checkpoints.json here")
    add_device_option(parser)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-checkpoints-") as folder:
        results = run(args.state_mib, args.steps, args.every, args.repeats, Path(folder), device)
    results["machine"] = machine("bench.checkpoints", device, argv)
    save(results, args.out, "checkpoints.json")
    held, rate = results["held_ms"], results["samples_per_s"]
    ratio = held["background"] / held["in place"]
    print(
        f"checkpoint of {results['state_mib']:.0f} MiB (a {results['layers']}-layer stack, "
        f"Adam), a save every {args.every} of {args.steps} steps, {args.repeats} repeats, "
        f"{results['machine']['device']}"
    )
    print(f"{'writer':<12}{'loop held per save':>20}{'samples/s':>12}")
    for arm in ("in place", "background"):
        print(f"{arm:<12}{held[arm]:>17.0f} ms{rate[arm]:>12.0f}")
    print(f"{'no saves':<12}{'':>20}{rate['no saves']:>12.0f}")
    print(
        f"background / in place: {100 * ratio:.1f}% of the hold; the snapshot alone holds "
        f"the loop {results['snapshot_copy_ms']:.0f} ms; host memory held for it "
        f"{results['snapshot_mib_held']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
