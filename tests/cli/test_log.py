from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_only

from gpu_busy.log import get_logger


def test_rank_zero_lines_only_on_rank_zero_per_rank_lines_say_their_rank(monkeypatch, caplog):
    log = get_logger("template.test")
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    log.info("shared line")
    log.info("about this rank", rank_zero_only=False)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    log.info("shared line")
    assert [r.getMessage() for r in caplog.records] == ["[rank 1] about this rank", "shared line"]
