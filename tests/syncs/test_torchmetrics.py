"""torchmetrics in a training step: the settings README calls sync-free are, and a sync
inside torchmetrics gets the fix that the metric's own arguments give.

Simulated on the CPU (``detect_syncs(device_type="cpu")``): every tensor here stands for
device memory, as the batch and the model's outputs are in a GPU step.
"""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MeanMetric, MeanSquaredError, MetricCollection, SumMetric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryF1Score,
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
)

from gpu_busy.syncs import assert_no_syncs, detect_syncs

LOGITS, LABELS = torch.randn(8, 5), torch.randint(0, 5, (8,))
SCORES, BINARY = torch.randn(8), torch.randint(0, 2, (8,))


def _syncs(metric, *inputs):
    """The syncs of a step's use of ``metric``: forward (update and the batch's value)."""
    return _detect(metric, *inputs).events


def _detect(metric, *inputs):
    with detect_syncs(device_type="cpu") as rec:
        metric(*inputs)
    return rec


# README, "A sync-free step": each row is a setting it names.
SYNC_FREE = {
    'MulticlassAccuracy(average="micro", validate_args=False)': (
        MulticlassAccuracy(5, average="micro", validate_args=False),
        (LOGITS, LABELS),
    ),
    'MulticlassF1Score(average="micro", validate_args=False)': (
        MulticlassF1Score(5, average="micro", validate_args=False),
        (LOGITS, LABELS),
    ),
    "BinaryAccuracy(validate_args=False) on logits": (
        BinaryAccuracy(validate_args=False),
        (SCORES, BINARY),
    ),
    "BinaryF1Score(validate_args=False) on probabilities": (
        BinaryF1Score(validate_args=False),
        (SCORES.sigmoid(), BINARY),
    ),
    'MeanMetric(nan_strategy="disable")': (MeanMetric(nan_strategy="disable"), (SCORES,)),
    'SumMetric(nan_strategy="disable")': (SumMetric(nan_strategy="disable"), (SCORES,)),
    "MeanSquaredError()": (MeanSquaredError(), (SCORES, BINARY.float())),
}


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_the_settings_readme_names_are_sync_free(name):
    metric, inputs = SYNC_FREE[name]
    assert _syncs(metric, *inputs) == []


def test_readme_names_each_sync_free_setting():
    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    for setting in ('average="micro", validate_args=False', "validate_args=False",
                    "on logits or probabilities", 'nan_strategy="disable"',
                    "MetricCollection", "compute_groups=False"):  # fmt: skip
        assert setting in readme, setting


# The defaults that sync, and the argument each fix must name.
DEFAULTS = [
    ("MulticlassAccuracy(5)", MulticlassAccuracy(5), (LOGITS, LABELS), 'average="micro"'),
    ("MulticlassConfusionMatrix", MulticlassConfusionMatrix(5, validate_args=False),
     (LOGITS, LABELS), "macro"),
    ("BinaryAccuracy()", BinaryAccuracy(), ((SCORES > 0).long(), BINARY), "validate_args=False"),
    ("MeanMetric()", MeanMetric(), (SCORES,), 'nan_strategy="disable"'),
]  # fmt: skip


@pytest.mark.parametrize("name,metric,inputs,argument", DEFAULTS, ids=[d[0] for d in DEFAULTS])
def test_a_sync_inside_torchmetrics_gets_the_metrics_own_fix(name, metric, inputs, argument):
    events = _syncs(metric, *inputs)
    assert events, f"{name} no longer syncs: update README's list"
    for event in events:
        assert event.filename == __file__  # the user's line that called the metric
        assert argument in event.hint, (event, event.hint)
        assert "scatter_add_" not in event.hint  # the fix for code inside torchmetrics


@pytest.mark.parametrize("preds", ["probabilities", "logits"])
def test_a_binary_metrics_cpu_only_test_of_its_preds_is_listed_and_not_counted(preds):
    """torchmetrics tests whether binary preds are logits with an ``if`` on a CPU tensor
    and a torch.where on a CUDA one (utilities/compute.py, normalize_logits_if_needed):
    the simulation sees the if's read, a GPU makes none. strict agrees with the count."""
    inputs = (SCORES.sigmoid() if preds == "probabilities" else SCORES, BINARY)
    rec = _detect(BinaryAccuracy(validate_args=False), *inputs)
    assert rec.events == []
    (read,) = rec.cpu_only
    assert read.cpu_only and read.filename == __file__
    assert read.branch.startswith("CPU only: no sync on a GPU (torchmetrics/utilities/compute.py:")
    assert "tests the device; on a GPU torchmetrics/utilities/compute.py:" in read.branch
    assert "torch.where" in read.branch
    metric = BinaryAccuracy(validate_args=False)  # made outside: a new metric's state is
    with detect_syncs(device_type="cpu", strict=True):  # copied to its device (a read)
        metric(*inputs)  # strict raises at a counted sync only
    assert_no_syncs(metric, *inputs)


def _collection(**settings):
    return MetricCollection(
        {
            "acc": MulticlassAccuracy(5, average="micro", validate_args=False),
            "f1": MulticlassF1Score(5, average="micro", validate_args=False),
        },
        **settings,
    )


def test_a_metric_collections_grouping_gets_its_own_fix_and_the_fix_holds():
    """MetricCollection's default compute_groups=True compares the metrics' states on the
    host at its first update; each fix the report prints, applied as printed, syncs never."""
    with detect_syncs(device_type="cpu") as rec:
        _collection().update(LOGITS, LABELS)
    assert rec.events, "MetricCollection no longer compares states: update README's list"
    for event in rec.events:
        assert event.filename == __file__ and "compute_groups=False" in event.hint, event.hint
    for fix in ({"compute_groups": False}, {"compute_groups": [["acc", "f1"]]}):
        collection = _collection(**fix)
        with detect_syncs(device_type="cpu") as rec:
            for _ in range(3):
                collection.update(LOGITS, LABELS)
        assert rec.events == [], (fix, rec.events)
        assert collection.compute()["acc"] == MulticlassAccuracy(5, average="micro")(
            LOGITS, LABELS
        )  # the same figure, grouped or not


def test_a_site_that_syncs_only_at_the_fits_first_step_says_so():
    from gpu_busy.syncs.attribution import SyncEvent
    from gpu_busy.syncs.sites import SyncSiteTable

    table = SyncSiteTable()
    first, logging = SyncEvent("allclose", "model.py", 3), SyncEvent(".item()", "model.py", 9)
    table.add_all([first, first, logging], step=0, logging=True, first=True)
    table.add_all([logging], step=10, logging=True)
    lines = table.render()
    assert any("allclose (the fit's first step only)" in line for line in lines), lines
    assert any(".item() (the first step and logging steps only)" in line for line in lines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_binary_metric_on_cuda_probabilities_makes_no_sync():
    """What the CPU-only rule stands on: on a CUDA tensor torchmetrics tests the preds with
    torch.where; CUDA's sync debug mode (armed by the detector) hears no wait."""
    metric = BinaryAccuracy(validate_args=False).cuda()
    preds, target = SCORES.sigmoid().cuda(), BINARY.cuda()
    metric(preds, target)  # the first call sets up
    with detect_syncs(device_type="cuda") as rec:
        metric(preds, target)
    assert rec.events == [] and rec.cpu_only == []
