"""Multi-node launch: the Trainer reads torchrun's and SLURM's variables (no real run)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

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
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False)
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
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False)
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank) == (4, 2)
    assert (trainer.node_rank, trainer.local_rank) == (1, 0)
    assert environment.main_address == "gpu01"


def test_cluster_tests_leave_no_rank_behind():
    # Runs after the two above (file order): the fixture restored rank zero and the env.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    assert rank_zero_only.rank == 0
    assert os.environ.get("MASTER_ADDR") != "gpu01"
