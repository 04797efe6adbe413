"""Pins the Lightning internals the template touches (all in template/lightning_compat.py).

If one of these fails after a Lightning upgrade, the attribute was renamed or removed:
update lightning_compat.py, not the callers.
"""

from __future__ import annotations

import lightning.pytorch as pl

from template.lightning_compat import is_logging_step


def test_logger_connector_should_update_logs_exists():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert hasattr(trainer, "_logger_connector"), "Trainer._logger_connector was renamed"
    assert hasattr(type(trainer._logger_connector), "should_update_logs"), (
        "_LoggerConnector.should_update_logs was renamed"
    )
    assert isinstance(is_logging_step(trainer), bool)


def test_is_logging_step_matches_lightnings_logging_steps(tmp_path):
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(is_logging_step(trainer))

    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=9,
        log_every_n_steps=3,
        callbacks=[Probe()],
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    # Lightning writes on steps 3, 6, 9 (1-based): the 3rd, 6th and 9th batches.
    assert seen == [False, False, True] * 3
