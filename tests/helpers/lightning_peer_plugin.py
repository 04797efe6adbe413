"""A pytest plugin that gives every Lightning ``Trainer`` the default set, as ``python -m
gpu_busy run`` does (``gpu_busy.launcher.attach``): ``scripts/lightning_peer_run.py`` runs
Lightning's own tests with it and without it."""

from __future__ import annotations

import sys


def pytest_configure(config) -> None:
    from gpu_busy.launcher import attach

    # ranks Lightning's launcher starts run the same pytest command again
    config._gpu_busy_undo = attach([sys.executable, "-m", "pytest", *sys.argv[1:]])


def pytest_unconfigure(config) -> None:
    undo = getattr(config, "_gpu_busy_undo", None)
    if undo is not None:
        undo()
