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


def test_a_line_logged_under_an_open_progress_bar_starts_on_its_own_line(capsys):
    import sys

    from tqdm import tqdm

    from gpu_busy.log import _formatted, _StderrHandler

    handler = _formatted(_StderrHandler())
    logger = logging.getLogger("template.test.bar")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root's handler, where a CLI test set one, would write it too
    try:
        with tqdm(total=10, file=sys.stderr, desc="Epoch 0", ascii=True) as bar:
            bar.update(3)
            bar.refresh()
            logger.info("a line of ours")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    (line,) = [x for x in err.split("\n") if "a line of ours" in x]
    # What a terminal shows: the text after the last carriage return, the bar cleared.
    assert "Epoch 0" not in line.split("\r")[-1] and "INFO a line of ours" in line
