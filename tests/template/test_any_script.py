"""README's one command for any Lightning script, on a script nobody changed for it:
``python -m gpu_busy run bug_report_model.py`` (Lightning's own bug-report script)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import ADDED, ROOT, run_launcher


@pytest.mark.slow
def test_an_unchanged_script_trains_with_the_set_and_its_report(tmp_path):
    script = tmp_path / "bug_report_model.py"
    shutil.copy(ROOT / "tests" / "launcher" / "lightning_examples" / script.name, script)
    ran = run_launcher([str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stderr.count(ADDED) == 1, ran.stderr[-3000:]  # one Trainer, the set once
    assert "fit done" in ran.stderr and "sync points:" in ran.stderr, ran.stderr[-3000:]
    (report,) = (tmp_path / "lightning_logs").glob("version_*/run.json")
    assert json.loads(report.read_text()), report
