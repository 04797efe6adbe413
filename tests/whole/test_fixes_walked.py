"""A user's own package (tests/helpers/own_project/mytext: torchmetrics' defaults, six
accidental syncs) walked to a sync-free fit by the report's fixes alone: each round reads
``syncs.json``, applies the fix each site prints (matched by its words, nothing else), and
fits again, until no site is left. The fixes that need a fit to mean something ("log the
tensor with self.log", "at logging steps") are followed here; the rest, call by call, in
tests/syncs/test_sync_fixes.py."""

from __future__ import annotations

import importlib
import json

from lightning.pytorch.loggers import CSVLogger

from tests.conftest import ROOT
from tests.helpers.trainers import default_callbacks, quiet_trainer

OWN_PROJECT = ROOT / "tests" / "helpers" / "own_project"

# Words of a printed fix -> the change in mytext that does what they say.
FOLLOW = {
    "log the tensor with self.log": "log",
    "branch on the device with torch.where": "branch",
    "keep it on the device, with ops whose output size is known on the host": "counts",
    "create it on the device (device=x.device)": "counts",
    "torch.where(mask, x, 0)": "mask",
    "compute_groups=False": "metrics",
    'average="micro"': "metrics",
    "validate_args=False": "metrics",
}


def _fit(tmp_path, round_: int, fixed: tuple[str, ...]) -> tuple[list[dict], dict]:
    mytext = importlib.import_module("mytext")
    trainer = quiet_trainer(
        callbacks=default_callbacks(),
        max_steps=8,
        limit_train_batches=8,  # the epoch ends: the metrics logged on_epoch are computed
        log_every_n_steps=4,
        enable_progress_bar=True,
        logger=CSVLogger(tmp_path, name=f"round{round_}"),
    )
    trainer.fit(mytext.TextClassifier(fixed=fixed), mytext.TextData())
    report = json.loads((tmp_path / f"round{round_}" / "version_0" / "syncs.json").read_text())
    # Lightning's one copy of the logged values to the loggers at a logging step is the
    # logging itself: the report says "expected"; every other site is the module's.
    sites = [s for s in report["sites"] if "expected" not in s["hint"]]
    return sites, report["summary"]


def test_the_reports_fixes_followed_as_printed_walk_a_users_module_to_no_syncs(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(OWN_PROJECT))  # the user's folder on the path
    fixed: set[str] = set()
    first = None
    for round_ in range(3):
        sites, summary = _fit(tmp_path, round_, tuple(sorted(fixed)))
        first = first if first is not None else sites
        if not sites:
            break
        for site in sites:
            keys = {key for words, key in FOLLOW.items() if words in site["hint"]}
            assert keys, f"no fix to follow at {site['location']}: {site['hint']}"
            fixed |= keys
    assert sites == [], [(s["op"], s["location"]) for s in sites]
    assert summary["steady_syncs_per_batch"] == 0
    assert fixed == {"log", "branch", "counts", "mask", "metrics"}
    # Each accidental sync was named at the user's own file, and torchmetrics' at the call
    # of the metric (its first step only for the grouping).
    assert all("mytext" in s["location"] for s in first), [s["location"] for s in first]
    assert len({s["location"] for s in first}) == 7, sorted(s["location"] for s in first)
    ops = {s["op"].split(" (")[0] for s in first}
    assert {"Tensor.item()", "format(tensor) / f-string", "print/repr/str(tensor)",
            "bool(tensor)", "Tensor.cpu()", "x[mask]", "bincount", "unique",
            "torch.equal / torch.allclose"} <= ops, ops  # fmt: skip
