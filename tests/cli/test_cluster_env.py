"""Multi-node launch: the Trainer reads torchrun's and SLURM's variables (no real run)."""

from __future__ import annotations

import os

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from tests.helpers.trainers import quiet_trainer

CLUSTER_VARS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NODE_RANK",
)  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    """Isolate the test: Lightning writes MASTER_* into os.environ and the global rank into
    rank_zero_only while resolving ranks; left behind, they make later tests act as rank 3
    (no files written) and point later DDP runs at a host that does not exist."""
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning_utilities.core import rank_zero as utils_rank_zero

    saved_env = dict(os.environ)
    saved_ranks = [
        (m.rank_zero_only, m.rank_zero_only.rank) for m in (fabric_rank_zero, utils_rank_zero)
    ]
    for name in list(os.environ):
        if name in CLUSTER_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved_env)
    for function, rank in saved_ranks:
        function.rank = rank


def test_torchrun_variables(clean_env):
    # torchrun --nnodes=2 --nproc-per-node=2: this is the second process of the second node.
    for name, value in {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job",
    }.items():  # fmt: skip
        clean_env.setenv(name, value)
    trainer = quiet_trainer(devices=2, num_nodes=2, strategy="ddp")
    assert isinstance(trainer.strategy.cluster_environment, TorchElasticEnvironment)
    assert (trainer.world_size, trainer.global_rank) == (4, 3)
    assert (trainer.node_rank, trainer.local_rank) == (1, 1)


def test_slurm_variables(clean_env):
    # sbatch --nodes=2 --ntasks-per-node=2, srun: the first task of the second node.
    for name, value in {
        "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[01-02]",
        "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "train",
    }.items():  # fmt: skip
        clean_env.setenv(name, value)
    trainer = quiet_trainer(devices=2, num_nodes=2, strategy="ddp")
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank) == (4, 2)
    assert (trainer.node_rank, trainer.local_rank) == (1, 0)
    assert environment.main_address == "gpu01"


SLURM_TWO_TASKS = {
    "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
    "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "train",
}  # fmt: skip


def test_slurm_tasks_started_without_srun_are_one_line(clean_env):
    """A batch script's plain `python ...` under --ntasks=2: Lightning would wait forever
    for the second task at "Initializing distributed"."""
    from gpu_busy.cli.preflight import check_slurm_launch
    from gpu_busy.errors import UserError

    for name, value in SLURM_TWO_TASKS.items():
        clean_env.setenv(name, value)
    with pytest.raises(UserError, match="not started by srun") as caught:
        check_slurm_launch()
    assert "put srun in front of the command" in str(caught.value)
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")  # what srun sets for the tasks it starts
    check_slurm_launch()
    clean_env.setenv("SLURM_JOB_NAME", "bash")  # an interactive job: Lightning ignores SLURM
    clean_env.delenv("SLURM_STEP_NUM_TASKS")
    check_slurm_launch()


@pytest.mark.slow
def test_a_run_under_slurm_variables_without_srun_exits_at_once(tmp_path):
    from tests.conftest import DEBUG, DEFAULT, HANG_S, run_entry_point

    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    result = run_entry_point(
        ["fit", "--config", DEFAULT, "--config", DEBUG, "--trainer.accelerator=cpu",
         "--trainer.devices=2"],
        cwd=tmp_path, timeout=HANG_S, env={**env, **SLURM_TWO_TASKS},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "SLURM's environment has 2 tasks, but this process was not started by srun" in line


def test_cluster_tests_leave_no_rank_behind():
    # Runs after the two above (file order): the fixture restored rank zero and the env.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    assert rank_zero_only.rank == 0
    assert os.environ.get("MASTER_ADDR") != "gpu01"
