"""Every rank ends with its code: no abort at exit, no agent left waiting (process_exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import DEBUG, DEFAULT, HANG_S, ROOT, run_entry_point

# A process that joined a (one-rank, gloo) group, with a daemon thread in torch's C++ code
# at exit, an atexit handler and a file left open: how it ends is the last line.
RANK = """
import atexit, sys, threading
import torch, torch.distributed as dist
from tests.helpers.exit_threads import add_forever

dist.init_process_group("gloo", store=dist.FileStore("store", 1), rank=0, world_size=1)
dist.all_reduce(torch.ones(2))
threading.Thread(target=add_forever, daemon=True).start()
atexit.register(lambda: open("atexit_ran", "w").close())
results = open("results.txt", "w")
results.write("kept")  # never closed: Python's exit would flush it
"""


def _rank(tmp_path: Path, last_line: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(RANK) + last_line
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT)})  # fmt: skip


def test_a_rank_ends_with_its_code_its_exit_work_done_and_no_abort(tmp_path):
    result = _rank(tmp_path, "from gpu_busy.process_exit import end_process\n"
                             "end_process(lambda: 3)\n")  # fmt: skip
    assert result.returncode == 3, result.stderr[-2000:]
    assert "terminate called" not in result.stderr
    assert (tmp_path / "atexit_ran").exists()
    assert (tmp_path / "results.txt").read_text() == "kept"


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 hangs such threads instead")
def test_without_it_python_s_own_exit_aborts_that_rank(tmp_path):
    # What the rule is for (pytorch/pytorch#38228): the same process, ended by sys.exit.
    result = _rank(tmp_path, "sys.exit(3)\n")
    assert result.returncode != 3 and "terminate called" in result.stderr, result.stderr[-2000:]


def test_an_error_is_its_traceback_and_1_and_a_process_without_a_group_exits_as_python_does(
    tmp_path,
):
    script = (
        "from gpu_busy.process_exit import end_process\ndef main():\n    raise ValueError('bad')\n"
    )
    result = _rank(tmp_path, script + "end_process(main)\n")
    assert result.returncode == 1 and "ValueError: bad" in result.stderr
    assert "terminate called" not in result.stderr
    plain = subprocess.run(
        [sys.executable, "-c", "from gpu_busy.process_exit import end_process\n"
                               "end_process(lambda: 'said and 1')"],
        cwd=tmp_path, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert plain.returncode == 1 and plain.stderr.strip() == "said and 1"


SPAWN = """
import multiprocessing
from tests.helpers.exit_threads import spawned_rank
child = multiprocessing.get_context("spawn").Process(target=spawned_rank, args=(".", 3, {rule}))
child.start()
child.join()
print(child.exitcode)
"""


@pytest.mark.parametrize("rule", [True, False])
def test_a_spawned_rank_ends_with_its_code_through_the_rule_and_aborts_without_it(tmp_path, rule):
    # ddp_spawn's ranks: multiprocessing's spawn_main ends them with sys.exit(code).
    if not rule and sys.version_info >= (3, 14):
        pytest.skip("3.14 hangs such threads instead")
    result = subprocess.run([sys.executable, "-c", SPAWN.format(rule=rule)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT)})  # fmt: skip
    exitcode = int(result.stdout.split()[-1])
    if rule:
        assert exitcode == 3 and "terminate called" not in result.stderr, result.stderr[-2000:]
        assert (tmp_path / "atexit_ran").exists()
    else:
        assert exitcode == -6 and "terminate called" in result.stderr, result.stderr[-2000:]


def test_only_spawn_mains_own_exit_is_taken_over(monkeypatch):
    from gpu_busy import process_exit

    left = []
    monkeypatch.setattr(process_exit, "joined_a_group", lambda: True)
    monkeypatch.setattr(process_exit, "leave", left.append)

    def spawn_main_stand_in(rule, code):  # its code object stands for spawn_main's
        rule(code)

    rule = process_exit._SpawnedRankExit(sys.exit, spawn_main_stand_in.__code__)
    with pytest.raises(SystemExit) as raised:  # an exit elsewhere: Python's, as always
        rule(4)
    assert raised.value.code == 4 and left == []
    with pytest.raises(SystemExit):  # the stand-in leave returns; Python's exit follows
        spawn_main_stand_in(rule, 3)
    assert left == [3]


@pytest.mark.slow
def test_ddp_ranks_with_a_torch_thread_at_exit_end_with_0(tmp_path):
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
         "--trainer.devices=2", "--trainer.callbacks+=tests.helpers.exit_probe.TorchThreadAtExit"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "terminate called" not in output and "fit done in" in output
    assert "Warning" not in output.split("fit done in")[-1]  # the exit itself says nothing


@pytest.mark.slow
def test_ddp_spawn_ranks_through_the_entry_point_pickle_and_end_with_0(tmp_path):
    # The Trainer travels pickled (its loggers' guarded save too); each rank's torch thread
    # at exit would abort it through spawn_main's sys.exit: the parent then fails the run.
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
         "--trainer.devices=2", "--trainer.strategy=ddp_spawn",
         "--trainer.callbacks+=tests.helpers.exit_probe.TorchThreadAtExit"],
        cwd=tmp_path, timeout=HANG_S,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "terminate called" not in output and "fit done in" in output


@pytest.mark.slow
def test_the_stress_loop_once_for_the_ways_no_other_test_starts_ends_every_rank(tmp_path):
    """scripts/stress_ranks.py, one run of each way no other test starts: a rank failing
    under two torchrun agents and under ``ddp_spawn`` (the loop of every kind on a loaded
    machine is outside the suite, with its own command: docs/BENCHMARKS.md)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "stress_ranks.py"), "--runs", "1", "--load", "0",
         "--kinds", "torchrun-fail", "spawn-fail"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.count(": ok") == 2, result.stdout
