"""Fixes that hold when followed: every fix the sync report prints, applied as printed to
the call that triggers it (tests/helpers/sync_fixes.py), leaves no sync, in the CPU
simulation (on CUDA: tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest

from gpu_busy.syncs import detect_syncs, rules
from tests.helpers.sync_fixes import FIXES, FixTensors

# Fixes followed in a Lightning fit, where "self.log" and "at logging steps" mean something:
# tests/whole/test_fixes_walked.py.
FOLLOWED_IN_A_FIT = {
    rules.PYTHON_RULES[rules.torch.Tensor.__format__].hint,
    rules.PYTHON_RULES[rules.torch.Tensor.__repr__].hint,
}


def _events(run):
    t = FixTensors("cpu")
    with detect_syncs(device_type="cpu") as rec:
        rec.memory.mark_host(*t.host())
        run(t)
    assert rec.internal_errors == 0
    return rec.events


@pytest.mark.parametrize("fix", FIXES, ids=[f.name for f in FIXES])
def test_a_fix_followed_as_printed_leaves_no_sync(fix):
    events = _events(fix.before)
    says = (fix.says,) if isinstance(fix.says, str) else fix.says
    assert events, f"{fix.name} no longer syncs"
    for event in events:  # every site of `before` gets a fix that `after` follows
        assert any(s in event.hint for s in says), (event.op, event.hint)
    for s in says:
        assert any(s in event.hint for event in events), f"no fix printed says {s!r}"
    if fix.after is None:
        assert all("no sync-free form" in event.hint for event in events)
    else:
        assert [str(e) for e in _events(fix.after)] == []


def _hints() -> set[str]:
    tables = (rules.PYTHON_RULES, rules.ATEN_RULES, rules.BACKWARD_RULES)
    found = {form.hint for table in tables for r in table.values() for form in r.forms or (r,)}
    return found | {fix for _, fix in rules.LIBRARY_READS}


def test_every_fix_the_rules_print_is_followed_by_a_case():
    printed = {event.hint for fix in FIXES for event in _events(fix.before)}
    assert _hints() - printed - FOLLOWED_IN_A_FIT == set()
