"""The command line's one-line errors on both jsonargparse bounds: the oldest release
pyproject.toml allows (``make install`` puts it in .venv/oldest-jsonargparse) and the
locked one. The lines come from the settings given and the errors' objects, not from
jsonargparse's English, so each case must read the same on both."""

import json
import os
import re
import subprocess
import sys

import pytest
from packaging.version import Version

from tests.conftest import HANG_S, ROOT

OLDEST = ROOT / ".venv" / "oldest-jsonargparse"

# (the flags after the default and CPU configs, the error line expected)
CASES = [
    # 4.39 took max_epoch for max_epochs, whatever allow_abbrev said: checked before it parses
    (["--trainer.max_epoch=1"], "the command line: trainer.max_epoch is not an option; "
     "did you mean trainer.max_epochs? (python -m template.train fit --help lists every "
     "option)"),
    (["--model.widht=8"], "the command line: model.widht is not an option; did you mean "
     "model.width?"),
    (["--config", "{tmp}/misspelt.yaml"], "{tmp}/misspelt.yaml: modle.lr is not an option; "
     "did you mean model.lr?"),
    (["--data.batch_size=many"], "the command line: data.batch_size=many: expected int"),
    # a setting whose value is a word of the message too ('Parser key "data"')
    (["--data.data_dir=data", "--data.batch_size=many"], "the command line: "
     "data.batch_size=many: expected int"),
    (["--trainer.max_epochs=three"], "the command line: trainer.max_epochs=three: expected "
     "int or null"),
    # a constructor's own refusal: a UserError, then any other error
    (["--model.lr=-1"], "model.lr must be greater than 0, got -1.0"),
    (["--data.crop_padding=-1"], "building the trainer, model or data from the config failed "
     "(ValueError: padding must be >= 0, got -1)"),
    # Lightning's refusal of the devices, reworded
    (["--trainer.accelerator=cpu", "--trainer.devices=0"], "trainer.accelerator=cpu "
     "trainer.devices=0: "),
]  # fmt: skip

PROBE = """
import json, sys
import jsonargparse
from gpu_busy.cli import main
lines = []
for flags in json.loads(sys.argv[1]):
    code = main(["fit", "--config", "configs/default.yaml", "--config", "configs/cpu.yaml",
                 *flags], prog="python -m template.train")
    lines.append(code)
print(json.dumps({"version": jsonargparse.__version__, "codes": lines}))
"""


def _oldest_allowed() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"jsonargparse\[signatures\]>=([0-9.]+)"', text).group(1)


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["oldest", "locked"])
def test_each_error_reads_the_same_on_both_jsonargparse_bounds(tmp_path, bound):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if bound == "oldest":
        if not (OLDEST / "jsonargparse").is_dir():
            message = f"{OLDEST} is missing: `rm .venv/.installed && make install` puts it there"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        env["PYTHONPATH"] = f"{OLDEST}{os.pathsep}{ROOT}"
    (tmp_path / "misspelt.yaml").write_text("modle:\n  lr: 0.1\n")
    flags = [[f.format(tmp=tmp_path) for f in case] for case, _ in CASES]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(flags)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if bound == "oldest":
        assert Version(report["version"]) == Version(_oldest_allowed())
    assert report["codes"] == [2] * len(CASES)
    said = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "Traceback" not in result.stderr
    assert len(said) == len(CASES), result.stderr[-3000:]
    for line, (_, expected) in zip(said, CASES, strict=True):
        assert line.startswith("error: " + expected.format(tmp=tmp_path)), line
