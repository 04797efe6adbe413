"""Every rank ends, and ends on time: 2-rank fits run again and again on a loaded machine.

Each run is the real entry point on 2 CPU ranks (gloo), sharded (configs/fsdp.yaml) or
plain DDP, started by Lightning's launcher, by ``ddp_spawn`` (plain only: Lightning's
sharded strategy has no spawn launcher) or by two torchrun agents on loopback (one a
node); the ``*-fail`` kinds have rank 1 raise after step 2. A run passes when every process
exits with the run's code (0, or the failure's 1) within ``--bound`` seconds, none printed
an abort (``terminate called``, ``Fatal Python error``), the second torchrun agent left
within ``--agent-gap`` seconds of the first (torchrun's exit barrier waits 300 s for an
agent whose worker died), and nothing of the run is left afterwards (its process
groups are empty).

    python scripts/stress_ranks.py                    # 20 runs of each of the 5, 2 busy processes
    python scripts/stress_ranks.py --runs 1 --load 0 --kinds lightning-sharded torchrun-ddp

Prints a line a run and a table at the end; exits 1 when any run failed. Every child
runs with Python's faulthandler on, so an abort prints each thread's Python stack.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("lightning-sharded", "lightning-ddp", "spawn-ddp", "torchrun-sharded", "torchrun-ddp")
# rank 1 raises after step 2: every process ends with its code, 1, within the bound
FAILING = ("lightning-fail", "spawn-fail", "torchrun-fail")
FAIL_AT = [
    "--trainer.callbacks+=tests.helpers.faults_probe.FailAt",
    "--trainer.callbacks.init_args.step=2",
    "--trainer.callbacks.init_args.rank=1",
]
ABORTS = ("terminate called", "Fatal Python error", "core dumped", "Aborted")


def fit_args(sharded: bool, devices: int, nodes: int = 1) -> list[str]:
    """A short fit (8 steps, a logging window every 4) of the default set on CPU ranks."""
    configs = ["default", "debug", *(["fsdp"] if sharded else [])]
    return [
        "fit", *[a for c in configs for a in ("--config", str(ROOT / "configs" / f"{c}.yaml"))],
        "--trainer.accelerator=cpu", f"--trainer.devices={devices}",
        f"--trainer.num_nodes={nodes}", "--trainer.limit_train_batches=8",
        "--trainer.log_every_n_steps=4",
    ]  # fmt: skip


def commands(kind: str) -> list[list[str]]:
    """The processes one run starts: one for Lightning's launchers, an agent a node for
    torchrun."""
    sharded = kind.endswith("sharded")
    extra = FAIL_AT if kind in FAILING else []
    train = [sys.executable, "-m", "template.train"]
    if kind.startswith("lightning"):
        return [[*train, *fit_args(sharded, devices=2), *extra]]
    if kind.startswith("spawn"):
        return [[*train, *fit_args(False, devices=2), "--trainer.strategy=ddp_spawn", *extra]]
    port = free_port()
    return [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
         f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
         "-m", "template.train", *fit_args(sharded, devices=1, nodes=2), *extra]
        for node in (0, 1)
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    kind: str
    seconds: float
    codes: list[int | None]
    agent_gap: float  # seconds between the first and the last process's exit
    left: list[int]  # process groups that still held a process afterwards
    aborted: str = ""  # the abort line printed, if any
    problems: list[str] = field(default_factory=list)


def run_once(kind: str, bound: float, agent_gap: float) -> Outcome:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="stress-") as folder:
        logs = [Path(folder) / f"process{i}.log" for i in range(2)]
        started = time.monotonic()
        procs = []
        for command, log in zip(commands(kind), logs, strict=False):
            with log.open("w") as out:  # each in a session of its own: its group is the run's
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=folder,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        ended: list[float] = []
        problems = []
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, started + bound - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"still running after {bound:.0f} s")
                break
            ended.append(time.monotonic())
        seconds = time.monotonic() - started
        left = [p.pid for p in procs if _group_alive(p.pid)]
        for pid in left:  # a run that outlived its bound, or left a rank behind
            os.killpg(pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        text = "\n".join(log.read_text(errors="replace") for log in logs if log.exists())
    codes = [p.returncode for p in procs]
    gap = max(ended) - min(ended) if len(ended) == len(procs) else seconds
    aborted = next((line for line in text.splitlines() if any(a in line for a in ABORTS)), "")
    expected = 1 if kind in FAILING else 0
    if any(code != expected for code in codes):
        problems.append(f"exit codes {codes}, not {expected}")
    if aborted:
        problems.append(f"printed {aborted.strip()!r}")
    if gap > agent_gap:
        problems.append(f"the last process left {gap:.0f} s after the first")
    if left:
        problems.append(f"{len(left)} process group(s) still held a process")
    if problems:
        tail = "\n".join(text.splitlines()[-40:])
        print(f"--- {kind}: last lines of its output\n{tail}\n---", flush=True)
    return Outcome(kind, seconds, codes, gap, left, aborted, problems)


def _group_alive(pgid: int, grace: float = 5.0) -> bool:
    """Whether the process group still holds a process ``grace`` seconds on (a rank that
    outlives its launcher would show here)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a zombie group leader not yet reaped counts as alive
            pass
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def _busy() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each kind (20)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS + FAILING, default=list(KINDS),
                        help="what to run (default: the 5 that succeed)")  # fmt: skip
    parser.add_argument("--load", type=int, default=2, help="busy processes beside them (2)")
    parser.add_argument("--bound", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--agent-gap", type=float, default=60,
                        help="seconds the last process may leave after the first (60)")  # fmt: skip
    args = parser.parse_args(argv)
    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    outcomes: list[Outcome] = []
    try:
        for i in range(args.runs):
            for kind in args.kinds:
                o = run_once(kind, args.bound, args.agent_gap)
                outcomes.append(o)
                verdict = "ok" if not o.problems else "FAILED: " + "; ".join(o.problems)
                print(
                    f"{kind:18} run {i + 1:2}/{args.runs}: {o.seconds:5.1f} s, "
                    f"processes left {o.agent_gap:4.1f} s apart: {verdict}",
                    flush=True,
                )
    finally:
        for p in load:
            p.terminate()
    print(f"\n{'kind':18} {'runs':>4} {'failed':>6} {'aborts':>6} {'max s':>6} {'max gap s':>9}")
    for kind in args.kinds:
        mine = [o for o in outcomes if o.kind == kind]
        if mine:
            print(f"{kind:18} {len(mine):4} {sum(bool(o.problems) for o in mine):6} "
                  f"{sum(bool(o.aborted) for o in mine):6} {max(o.seconds for o in mine):6.1f} "
                  f"{max(o.agent_gap for o in mine):9.1f}")  # fmt: skip
    print(f"load: {args.load} busy process(es) on {os.cpu_count()} core(s)")
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
