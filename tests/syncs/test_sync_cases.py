"""The detector against PyTorch's own account of which calls sync (tests/helpers/sync_cases.py),
in the CPU simulation: every syncing case found as often as a GPU run waits, at the
case's line; every sync-free case silent."""

from __future__ import annotations

import pytest

from gpu_busy.syncs import detect_syncs
from tests.helpers.sync_cases import CASES, Tensors


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_simulation_finds_what_a_gpu_run_waits_for(case):
    t = Tensors("cpu")
    with detect_syncs(device_type="cpu") as rec:
        rec.memory.mark_host(*t.host())
        case.run(t)
    assert rec.internal_errors == 0
    assert len(rec.events) == case.syncs, [str(e) for e in rec.events]
    for event in rec.events:  # named at this project's line, never inside a library
        assert event.filename.endswith("sync_cases.py"), str(event)
