"""What a checkpoint save costs the training loop: written in place vs in the background.

    python -m bench.checkpoints [--state-mib 300] [--every 10,200] [--saves 4] [--repeats 2]
                                [--device auto|cpu|cuda]

One process, one model, the writers interleaved: ``AtomicCheckpointIO`` (the loop waits for
the whole write), ``BackgroundCheckpointIO`` (the loop waits for a snapshot of the state; a
thread writes) and no saves. The model is a stack of square linear layers trained with Adam
(its state: weights, gradients' two moments), sized to ``--state-mib`` of checkpoint. Each
spacing in ``--every`` (steps between saves) is a fit of ``--saves`` times that many steps.
A background save's cost comes in three parts, each given on its own:

- the snapshot: the loop held while the state is copied (median over saves);
- the wait for the previous write, where saves come faster than a write (median);
- the loop's slowdown while a write runs: samples/s against the same fit with no saves.

Beside them the in-place hold, one background write's duration (is the spacing wider than
a write?), and the goals: a hold of at most 2x the snapshot and 10% of the in-place hold,
and samples/s of at least 90% of no saves, where saves are spaced wider than a write. The
first save of each fit (it allocates the snapshot's buffers) is left out. Writes go to a
temporary directory on the disk ``--dir`` is on. On a GPU the background writer is the
default config's (the state lives on the device); on a CPU it is forced
(``background=True``) to measure what the default leaves out.
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


def run(layers: int, every: int, saves: int, repeats: int, folder: Path, device: str):
    """One spacing: the three arms interleaved ``repeats`` times."""
    steps = saves * every
    held: dict[str, list[float]] = {"in place": [], "background": []}
    waited: list[float] = []
    writes: list[float] = []
    rate: dict[str, list[float]] = {"in place": [], "background": [], "no saves": []}
    for _ in range(repeats):  # interleaved, so drift hits each alike
        for arm, make in (("in place", AtomicCheckpointIO), ("background", _background)):
            timed = Timed(make())
            rate[arm].append(fit(layers, steps, every, timed.plugin, folder, device))
            held[arm] += timed.held[1:]  # the first save allocates the snapshot's buffers
            if arm == "background":
                waited += timed.plugin.waited_s[1:]
                writes += timed.plugin.write_s[1:]
        rate["no saves"].append(fit(layers, steps, 0, None, folder, device))
    hold = {arm: 1e3 * statistics.median(v) for arm, v in held.items()}
    wait_ms = 1e3 * statistics.median(waited)
    return {
        "every": every,
        "steps": steps,
        "held_ms": hold,
        "held_ms_all": {arm: [1e3 * x for x in v] for arm, v in held.items()},
        "snapshot_ms": hold["background"] - wait_ms,
        "wait_for_write_ms": wait_ms,
        "write_ms": 1e3 * statistics.median(writes),
        "samples_per_s": {arm: statistics.median(v) for arm, v in rate.items()},
    }


def snapshot_copy_ms(layers: int, device: str) -> tuple[float, float]:
    """The snapshot copy alone, outside a fit: (ms, MiB held)."""
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
    return 1e3 * statistics.median(copies), snapshot.bytes / 2**20


def _background() -> BackgroundCheckpointIO:
    return BackgroundCheckpointIO(background=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoints", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--state-mib", type=float, default=300.0, help="checkpoint size")
    parser.add_argument(
        "--every", default="10,200", help="steps between saves, one fit per spacing: 10,200"
    )
    parser.add_argument("--saves", type=int, default=4, help="saves per fit")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("runs"), help="where saves go")
    parser.add_argument("--out", type=Path, default=None, help="write checkpoints.json here")
    add_device_option(parser)
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    try:
        spacings = [int(x) for x in args.every.split(",")]
    except ValueError:
        parser.error(f"--every {args.every}: give steps between saves, as 10,200")
    if args.saves < 2 or min(spacings) < 1:
        parser.error("--saves must be 2 or more and every spacing 1 or more")
    args.dir.mkdir(parents=True, exist_ok=True)
    layers = layers_for(args.state_mib)
    fit(layers, 4, 0, None, args.dir, device)  # the first fit in a process: imports, allocator
    copy_ms, mib = snapshot_copy_ms(layers, device)
    results: dict = {"layers": layers, "state_mib": mib, "snapshot_copy_ms": copy_ms}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-checkpoints-") as folder:
        results["spacings"] = [
            run(layers, every, args.saves, args.repeats, Path(folder), device) for every in spacings
        ]
    results["machine"] = machine("bench.checkpoints", device, argv)
    save(results, args.out, "checkpoints.json")
    print(
        f"checkpoint of {mib:.0f} MiB (a {layers}-layer stack, Adam), {args.saves} saves per "
        f"fit, {args.repeats} repeats, {results['machine']['device']}; the snapshot copy "
        f"alone {copy_ms:.1f} ms"
    )
    print(
        f"{'save every':<11}{'write':>9}{'snapshot':>10}{'wait':>9}{'held':>9}{'in place':>10}"
        f"{'samples/s: bg':>15}{'in place':>10}{'none':>8}{'bg/none':>9}"
    )
    for r in results["spacings"]:
        held, rate = r["held_ms"], r["samples_per_s"]
        print(
            f"{r['every']:>5} steps{r['write_ms']:>6.0f} ms{r['snapshot_ms']:>7.0f} ms"
            f"{r['wait_for_write_ms']:>6.0f} ms{held['background']:>6.0f} ms"
            f"{held['in place']:>7.0f} ms{rate['background']:>15.0f}{rate['in place']:>10.0f}"
            f"{rate['no saves']:>8.0f}{100 * rate['background'] / rate['no saves']:>8.0f}%"
        )
    for r in results["spacings"]:
        print(_goals(r, copy_ms))
    return 0


def _goals(r: dict, copy_ms: float) -> str:
    """The goals, for a spacing wider than a write (the only one they are set for)."""
    held, rate = r["held_ms"], r["samples_per_s"]
    between_ms = 1e3 * r["every"] * BATCH / rate["no saves"]  # the steps between two saves
    if between_ms <= r["write_ms"]:
        return (
            f"every {r['every']} steps ({between_ms:.0f} ms): saves come faster than a write "
            f"({r['write_ms']:.0f} ms), so the loop waits for the one before: no goal is set"
        )
    checks = [
        ("hold <= 2x the snapshot copy", held["background"] <= 2 * copy_ms),
        ("hold <= 10% of in place", held["background"] <= 0.1 * held["in place"]),
        ("samples/s >= 90% of no saves", rate["background"] >= 0.9 * rate["no saves"]),
    ]
    said = "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks)
    return f"every {r['every']} steps ({between_ms:.0f} ms, wider than a write): {said}"


if __name__ == "__main__":
    sys.exit(main())
