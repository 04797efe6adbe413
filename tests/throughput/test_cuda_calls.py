"""The CUDA calls the default callbacks make per step, counted on the CPU along their CUDA
route (``python -m bench.host --cuda-route``): a change that adds CUDA work to a steady step
fails here, where no GPU is."""

from __future__ import annotations

import pytest

from bench import cuda_calls, host


@pytest.fixture(scope="module")
def counted() -> dict:
    return host.cuda_route(steps=100)  # two epochs of 100 steps, 5 logging steps each


def _rows(counted: dict, bucket: str) -> dict[str, dict[str, float]]:
    return counted["per_step"][bucket]["rows"]


def test_a_steady_step_reads_nothing_back_and_makes_at_most_15_calls(counted):
    steady = counted["per_step"]["steady"]
    assert steady["reads"] == 0, _rows(counted, "steady")
    # 34.1 calls (15.0 reads) a steady step before the reads moved to the window; 14 now,
    # and the events the pools make while they fill (none once full)
    assert steady["calls"] <= 15.0, _rows(counted, "steady")


def test_each_steady_call_is_one_the_figures_need(counted):
    steady = {
        (row, kind): round(n)
        for row, kinds in _rows(counted, "steady").items()
        for kind, n in kinds.items()
        if round(n) and kind not in ("event create", "stream create")
    }
    assert steady == {
        ("StepClock", "event record"): 4,  # hooks done, data ready, step start, step end
        ("StreamPrefetcher", "event record"): 3,  # copy start and end, compute stream there
        ("StreamPrefetcher", "stream enter/exit"): 2,  # the copy on the side stream
        ("StreamPrefetcher", "wait_event"): 1,  # the compute stream waits for the copy
        ("StreamPrefetcher", "record_stream"): 2,  # each tensor of the batch (x, y)
        ("StreamPrefetcher", "is_pinned"): 2,
    }


def test_the_window_reads_what_the_steps_recorded(counted):
    rows = _rows(counted, "logging")
    assert rows["StepClock"]["event elapsed_time"] >= 4 * 15  # every step of the window
    assert rows["StepClock"]["event query"] <= 3  # the newest completed end tells the rest
    assert rows["ThroughputMonitor"]["memory statistics read"] == 1
    assert rows["ThroughputMonitor"]["memory statistics reset"] == 1
    assert rows["StreamPrefetcher"]["event elapsed_time"] > 0


def test_the_table_ends_with_the_two_lines(counted):
    lines = cuda_calls.table(counted)
    assert lines[-1] == "CUDA reads per steady step: 0"
    assert lines[-2].startswith("CUDA calls per steady step: ")
