"""The sync detector alone (gpu_busy.syncs, no Lightning), in the CPU simulation.

One case per row of the coverage list: each must be reported once, with this file's
line; clean cases must report nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpu_busy.syncs import SyncError, assert_no_syncs, detect_syncs
from gpu_busy.syncs.detector import SyncDetector
from gpu_busy.syncs.sampling import WatchSchedule
from gpu_busy.syncs.sites import SyncSiteTable, fix_hint
from tests.conftest import ROOT

# Made before any detector is entered, like a model's parameters or a transferred batch:
# device memory in the CPU simulation. Tensors a case makes itself without device= are
# host memory there, as on a GPU.
x = torch.arange(6.0)
mask = x > 2
counts = torch.tensor([0, 1, 1])
eye = torch.eye(2)
log_probs = torch.randn(5, 1, 3).log_softmax(2)
targets, input_lengths, target_lengths = (
    torch.tensor([[1, 2]]),
    torch.tensor([5]),
    torch.tensor([2]),
)


def _item():
    return x.sum().item()


def _float():
    return float(x.sum())


def _int():
    return int(x.sum())


def _bool():
    if x.sum() > 0:
        return 1


def _fstring():
    return f"{x.sum():.3f}"


def _print(capsys=None):
    print(x)


def _repr():
    return repr(x)


def _str():
    return str(x)


def _full():
    return torch.full((2,), x.sum())


def _arange():
    return torch.arange(x.sum())


def _nonzero():
    return x.nonzero()


def _argwhere():
    return torch.argwhere(mask)


def _where_one_arg():
    return torch.where(mask)


def _mask_index():
    return x[mask]


def _mask_assign_tensor():
    y = x.clone()
    y[mask] = torch.ones(3)


def _masked_select():
    return x.masked_select(mask)


def _masked_fill_tensor():
    return x.masked_fill(mask, x.sum())


def _unique():
    return torch.unique(x)


def _unique_consecutive():
    return torch.unique_consecutive(x)


def _repeat_interleave():
    return x.repeat_interleave(torch.full((6,), 2))


def _bincount():
    return torch.bincount(counts)


def _histc():
    return torch.histc(x)


def _equal():
    return torch.equal(x, x + 1)  # not one view of one memory: compared on the device


def _allclose():
    return torch.allclose(x, x)


def _linalg_inv():
    return torch.linalg.inv(eye)


def _ctc_loss():
    return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def _cpu():
    return x.cpu()


def _to_cpu():
    return x.to("cpu")


def _tolist():
    return x.tolist()


def _numpy():
    return x.numpy()


def _np_asarray():
    return np.asarray(x)


def _synchronize():
    torch.cpu.synchronize()


SYNCS = [
    (_item, "Tensor.item()"),
    (_float, "float(tensor)"),
    (_int, "int(tensor)"),
    (_bool, "bool(tensor)"),
    (_fstring, "format(tensor)"),
    (_print, "print/repr/str"),
    (_repr, "print/repr/str"),
    (_str, "print/repr/str"),
    (_full, "scalar read"),
    (_arange, "scalar read"),
    (_nonzero, "nonzero"),
    (_argwhere, "nonzero"),
    (_where_one_arg, "nonzero"),
    (_mask_index, "x[mask]"),
    (_mask_assign_tensor, "x[mask] = value"),
    (_masked_select, "masked_select"),
    (_masked_fill_tensor, "masked_fill with a device tensor"),
    (_unique, "unique"),
    (_unique_consecutive, "unique"),
    (_repeat_interleave, "repeat_interleave"),
    (_bincount, "bincount"),
    (_histc, "histc"),
    (_equal, "torch.equal"),
    (_allclose, "torch.allclose"),
    (_linalg_inv, "linalg"),
    (_ctc_loss, "ctc_loss"),
    (_cpu, "Tensor.cpu()"),
    (_to_cpu, "Tensor.to"),
    (_tolist, "Tensor.tolist()"),
    (_numpy, "Tensor.numpy()"),
    (_np_asarray, "np.asarray"),
    (_synchronize, "torch.cpu.synchronize()"),
]


@pytest.mark.parametrize(("fn", "op"), SYNCS, ids=[f.__name__.strip("_") for f, _ in SYNCS])
def test_each_sync_is_reported_once_at_the_users_line(fn, op):
    with detect_syncs(device_type="cpu") as rec:
        fn()
    assert len(rec.events) == 1, [str(e) for e in rec.events]
    event = rec.events[0]
    assert op in event.op
    assert event.filename == __file__
    assert event.function == fn.__name__
    # the line is the one inside fn that made the call
    lines = fn.__code__.co_positions() if hasattr(fn.__code__, "co_positions") else None
    assert fn.__code__.co_firstlineno < event.lineno <= fn.__code__.co_firstlineno + 3, lines
    assert event.code and event.phase == "forward"
    assert fix_hint(event)


def _clean():
    y = x * 2 + 1
    _ = (y.shape, y.dtype, y.device, y.ndim, y.numel(), len(y), y.size(0))
    _ = torch.where(mask, y, 0.0)  # three arguments: elementwise
    _ = y.index_select(0, torch.tensor([0, 2]))
    _ = y.masked_fill(mask, 0.5)  # a Python scalar
    _ = torch.nonzero_static(mask, size=6)
    z = y.clone()
    z[mask] = 0.0  # becomes masked_fill_
    _ = y.to(torch.float64), y.to("cpu", non_blocking=True)
    _ = y.repeat_interleave(2), y.repeat_interleave(torch.full((6,), 2), output_size=12)
    _ = torch.histc(y, bins=4, min=0, max=10)
    _ = torch.multinomial(y + 1, 1)  # its check is an _assert_async on CUDA (torch >= 2.11)
    w = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    loss = ((w * y).sum() - 1) ** 2
    loss.backward()
    opt.step()
    opt.zero_grad()
    _ = torch.nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))


def test_operations_that_do_not_sync_are_never_reported():
    with detect_syncs(device_type="cpu") as rec:
        _clean()
    assert rec.events == [], [str(e) for e in rec.events]


def test_a_composite_op_syncs_as_the_installed_torch_decomposes_it():
    # torch.combinations synced twice on CUDA with torch 2.11 (a masked_select) and not at
    # all with 2.14 (nonzero_static): the simulation follows the version it runs on.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        torch.combinations(x)
    reads = sum(name in ("masked_select", "nonzero") for name in ops.names)
    with detect_syncs(device_type="cpu") as rec:
        torch.combinations(x)
    assert len(rec.events) >= reads and (reads == 0) == (rec.events == []), ops.names


def test_backward_of_a_mask_index_names_the_forward_line():
    w = torch.randn(6, requires_grad=True)
    with detect_syncs(device_type="cpu") as rec:
        picked = w[mask]  # forward: a sync here
        picked.sum().backward()
    ops = [(e.op, e.phase) for e in rec.events]
    assert [op.split(" ")[0] for op, _ in ops] == ["x[mask]", "backward"]
    assert [phase for _, phase in ops] == ["forward", "backward"]
    assert rec.events[0].lineno == rec.events[1].lineno
    assert rec.events[1].code == "picked = w[mask]  # forward: a sync here"


def test_a_library_read_names_the_users_call_and_the_library_line():
    from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

    with detect_syncs(device_type="cpu") as rec:
        convert_tensors_to_scalars({"loss": x.sum()})
    (event,) = rec.events
    assert event.filename == __file__
    assert "convert_tensors_to_scalars" in event.code
    assert event.via is not None
    assert event.via.startswith("lightning/fabric/utilities/apply_func.py")
    assert event.chain[0] == event.via


def test_a_distributions_argument_check_is_fixed_by_its_own_switch():
    # The rule's own hint, "branch on the device with torch.where", does not apply to a check
    # inside torch.distributions: its switch is validate_args.
    loc, scale = torch.zeros(3), torch.ones(3)  # device memory: made before watching
    with detect_syncs(device_type="cpu") as rec:
        torch.distributions.Normal(loc, scale)
    assert len(rec.events) == 2  # one check per argument: loc, scale
    assert all("validate_args=False" in e.hint for e in rec.events), rec.events[0].hint
    assert all("set_default_validate_args(False)" in e.hint for e in rec.events)
    with detect_syncs(device_type="cpu") as rec:
        torch.distributions.Normal(loc, scale, validate_args=False)
    assert rec.events == []


def test_a_torch_device_object_is_the_device_to_the_simulation_as_the_guide_says():
    # A stated limit (docs/GUIDE.md, "What the CPU simulation cannot see"): on a CPU, a
    # torch.device("cpu") held in a variable is the object a torch.cuda.is_available()
    # branch makes, so it stands for the device; written on the line, as the string "cpu"
    # and .cpu(), it is the host.
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    assert "x.to(device)" in guide and 'torch.device("cpu")' in guide
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with detect_syncs(device_type="cpu") as rec:
        x.to(device)  # device to device: no copy
        x.to("cpu")  # device to host: a blocking copy
    assert [e.code for e in rec.events] == ['x.to("cpu")  # device to host: a blocking copy']


def test_the_unique_fix_asks_for_nothing_unique_cannot_take():
    # Its hint once said "pass a known size": torch.unique has no such argument.
    with detect_syncs(device_type="cpu") as rec:
        _unique()
    (event,) = rec.events
    assert "known size" not in event.hint and ".scatter_(0, x, True)" in event.hint


def test_device_type_decides_what_counts():
    # with "cuda" as the device, CPU tensors are host memory: nothing here syncs
    with detect_syncs(device_type="cuda") as rec:
        x.sum().item()
        print(x)
        x.nonzero()
    assert rec.events == []


def test_strict_raises_before_the_op_with_the_line():
    with pytest.raises(SyncError, match=r"Tensor\.item\(\) at .*test_syncs.py:\d+"):  # noqa: SIM117
        with detect_syncs(device_type="cpu", strict=True):
            x.sum().item()


def test_after_strict_raises_the_errors_handling_is_not_recorded_until_entered_again():
    """What runs after strict's error (Lightning's exception hooks, a progress bar's last
    read) is not the program's step: the report counts the sync that ended it, alone."""
    det = SyncDetector("cpu", strict=True)
    with det:
        with pytest.raises(SyncError):
            x.sum().item()
        x.max().item()  # the error's handling
    assert [e.op for e in det.take()] == ["Tensor.item()"]
    det.strict = False
    with det:
        x.max().item()
    assert [e.op for e in det.take()] == ["Tensor.item()"]


def test_events_accumulate_over_entries_and_hooks_are_restored():
    original = torch.cpu.synchronize
    det = SyncDetector("cpu")
    with det:
        x.sum().item()
    x.sum().item()  # not watched
    with det:
        torch.cpu.synchronize()
    assert torch.cpu.synchronize is original
    assert [e.op for e in det.take()] == ["Tensor.item()", "torch.cpu.synchronize()"]
    assert det.events == []
    with pytest.raises(RuntimeError, match="already active"), det, det:
        pass
    assert not det.active


def test_nested_detectors_both_record():
    with detect_syncs(device_type="cpu") as outer:
        with detect_syncs(device_type="cpu") as inner:
            x.sum().item()
            torch.cpu.synchronize()
        x.tolist()
    assert len(inner.events) == 2
    assert len(outer.events) == 3


class _Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        t = torch.tensor(float(i))
        return t * t, int(t)  # host tensors read on the host: not a device sync


def test_the_data_loader_in_the_main_process_is_not_a_device():
    loader = DataLoader(_Squares(), batch_size=4, num_workers=0)
    with detect_syncs(device_type="cpu") as rec:
        for batch in loader:
            batch[0].mul_(2)
    assert rec.events == []


def test_a_move_to_x_device_is_no_sync_and_a_move_to_the_host_is():
    from lightning.fabric.utilities.apply_func import move_data_to_device

    with detect_syncs(device_type="cpu") as rec:
        move_data_to_device(x, torch.device("cpu"))  # Lightning's transfer: to the device
        x.to(x.device)
        x.to("cpu")  # the user's own: a read to the host
        x.cpu()
    assert [e.op.split(" ")[0] for e in rec.events] == ["Tensor.to", "Tensor.cpu()"]


def test_via_names_a_library_whose_name_starts_like_torch():
    from torchmetrics.functional.classification import multiclass_accuracy

    preds, target = x.reshape(2, 3).softmax(1), x[:2].long()
    with detect_syncs(device_type="cpu") as rec:
        multiclass_accuracy(preds, target, num_classes=3)  # validate_args: reads it back
    assert rec.events and all(e.via.startswith("torchmetrics/") for e in rec.events)


def test_assert_no_syncs_returns_the_result_or_lists_every_line():
    assert assert_no_syncs(lambda a: a * 2, x).sum() == 30
    with pytest.raises(AssertionError) as err:
        assert_no_syncs(lambda: (_item(), _nonzero()))
    message = str(err.value)
    assert "made 2 host-device sync(s)" in message
    assert "test_syncs.py" in message and "in _item" in message and "in _nonzero" in message


def test_the_no_syncs_fixture(no_syncs, pytester=None):
    with no_syncs(device_type="cpu"):
        x * 2
    with pytest.raises(pytest.fail.Exception, match="1 host-device sync"), no_syncs():
        x.sum().item()


def test_a_sync_check_aimed_at_a_device_the_block_never_used_fails_saying_so(no_syncs):
    # A CI gate that checked nothing must not pass: a CUDA check of CPU tensors (a runner
    # without a GPU) names what the block used. A block with no tensor work made no sync.
    said = "no_syncs checked nothing: the block ran no operation on a cuda tensor, only on cpu"
    with pytest.raises(pytest.fail.Exception, match=said), no_syncs("cuda"):
        x * 2
    with no_syncs("cuda"):
        pass
    with pytest.raises(AssertionError, match='give device_type="cpu" to check it on the CPU'):
        assert_no_syncs(lambda: x * 2, device_type="cuda")


# -- aggregation and sampling ----------------------------------------------------------


def test_site_table_counts_merges_and_renders_hints():
    with detect_syncs(device_type="cpu") as rec:
        for _ in range(3):
            _item()
    table = SyncSiteTable()
    table.add_all(rec.take(), step=5, logging=False)
    other = SyncSiteTable()
    with detect_syncs(device_type="cpu") as rec:
        _item()
    other.add_all(rec.take(), step=7, logging=True)
    table.merge(other.rows())
    (site,) = table.sites.values()
    assert (site.count, site.steady_count, site.steps) == (4, 3, [5, 7])
    text = "\n".join(table.render())
    assert "4x" in text and "test_syncs.py" in text and "fix: log the tensor with self.log" in text


def test_watch_schedule_first_steps_then_within_the_budget():
    s = WatchSchedule(budget=0.01, first=3)
    assert [s.should_watch(i) for i in range(6)] == [True, True, True, False, False, False]
    s.update(watched_s=0.111, plain_s=0.100)  # +11% per watched step
    assert s.extra == pytest.approx(0.11) and s.interval == 11  # 11% / 11 = 1%
    # The first three cost 0.33 plain steps: nothing more until step 43 pays them back.
    watched = [i for i in range(6, 120) if s.should_watch(i)]
    assert watched == [43, 54, 65, 76, 87, 98, 109]
    for steps in (44, 60, 120):  # the whole fit stays within 1% once paid back
        cost = sum(0.11 for i in [0, 1, 2, *watched] if i < steps)
        assert cost <= 0.01 * steps + 1e-9
    s.update(0.100, 0.100)  # no slower than a plain step: noise (never free), kept as known
    assert s.extra == pytest.approx(0.11) and s.interval == 11
    s.update(10.0, 0.01)  # very costly: rarely, but still within the budget
    assert not any(s.should_watch(i) for i in range(122, 20_000))
    assert WatchSchedule.overhead(0.111, 0.100) == pytest.approx(0.11)


def test_under_load_a_watched_step_that_looks_free_keeps_the_schedule_within_its_budget():
    """A loaded machine makes a watched step (+190%) look no slower than the plain ones,
    whose own spread is wide: the cost measured before stays, and 375 batches keep 1%."""
    s = WatchSchedule(budget=0.01, first=3)
    s.plan_fit(375)
    watched = [n for n in range(20) if s.should_watch(n)]
    s.update(0.29, 0.10, 0.12)  # measured on a quiet machine: +190%
    for n in range(20, 375):
        if s.should_watch(n):
            watched.append(n)
        if n % 20 == 19:
            s.update(0.30, 0.30, 0.55)  # under load: within the plain steps' spread
    assert s.extra == pytest.approx(1.9)
    assert len(watched) * 1.9 <= 0.01 * 375 + 1.9, watched  # the budget, and one to learn


def test_a_report_over_budget_blames_the_fits_length_only_when_that_is_the_cause():
    from gpu_busy.report.syncs import _overhead

    summary = {"watched_batch_overhead": 1.9, "amortised_overhead": 0.12, "budget": 0.01,
               "batches": 375, "always_watched": 1}  # fmt: skip
    assert "a loaded machine" in _overhead(summary)
    assert "too short" in _overhead({**summary, "batches": 100, "always_watched": 3})
    assert "not resolved" in _overhead({**summary, "overhead_within_spread": True})


def test_watch_schedule_watches_rarely_until_a_cost_is_known():
    s = WatchSchedule(budget=0.01, first=2, max_interval=50)
    s.update(None, 0.1)  # no watched step timed yet
    assert [i for i in range(200) if s.should_watch(i)] == [0, 1, 51, 101, 151]


def test_watch_schedules_with_the_same_updates_agree():
    a, b = WatchSchedule(), WatchSchedule()
    seen = []
    for step in range(200):
        wa, wb = a.should_watch(step), b.should_watch(step)
        seen.append(wa == wb)
        a.observe(wa, 0.2 if wa else 0.1)
        b.observe(wb, 0.25 if wb else 0.1)  # another rank measures differently...
        if step % 20 == 19:  # ...but both apply the reduced figures
            a.update(0.25, 0.1)
            b.update(0.25, 0.1)
    assert all(seen)


def test_the_no_syncs_fixture_comes_with_the_installed_package(no_syncs, request):
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "gpu_busy"]
    assert entry.value == "pytest_gpu_busy" and request.config.pluginmanager.hasplugin("gpu_busy")
    with no_syncs(device_type="cpu"):
        (x * 2).sum()
    with pytest.raises(pytest.fail.Exception, match=r"Tensor\.item\(\)"), no_syncs("cpu"):
        x.sum().item()


# -- the detector never changes or breaks what it watches -------------------------------

# Every form of Tensor.to that torch documents (positional and keyword), with copy= and
# memory_format=: GradScaler calls .to(..., copy=True).
TO_CALLS = [
    (("cpu",), {}),
    (("cpu",), {"copy": True}),
    ((torch.device("cpu"), torch.float64), {}),
    ((torch.device("cpu"), torch.float64, False, True), {}),
    ((), {"device": "cpu", "dtype": torch.float16, "non_blocking": False, "copy": True}),
    ((), {"device": "cpu", "memory_format": torch.preserve_format}),
    ((torch.float64,), {}),
    ((torch.float64, False, True), {}),
    ((), {"dtype": torch.int32, "copy": True}),
    ((torch.zeros(1, dtype=torch.float16),), {}),
    ((torch.zeros(1, dtype=torch.float16), False, True), {}),
    ((), {"tensor": torch.zeros(1, dtype=torch.float16), "copy": True}),
    (("cpu",), {"non_blocking": True}),
]


@pytest.mark.parametrize(("args", "kwargs"), TO_CALLS)
def test_every_form_of_tensor_to_runs_unchanged_under_the_detector(args, kwargs):
    x = torch.arange(6.0).reshape(2, 3)
    expected = x.to(*args, **kwargs)
    with detect_syncs(device_type="cpu") as rec:
        got = x.to(*args, **kwargs)
    assert torch.equal(got, expected) and got.dtype == expected.dtype
    assert rec.internal_errors == 0
    # In the CPU simulation a target means the host only where the line writes the CPU;
    # here every target comes from the table above: the device, where x already is.
    assert rec.events == [], rec.events


def test_a_string_means_the_host_where_the_line_that_moves_writes_it():
    x = torch.arange(6.0)  # made before watching: device memory in the simulation
    device = "cpu"  # what a script computes where there is no GPU: it stands for the device
    with detect_syncs(device_type="cpu") as rec:
        x.to("cpu")  # the host by the line's own word: a blocking copy back
        x.to(device)  # already there: no copy
        x.to(device="cpu", non_blocking=True)  # to the host, but not waited for
    assert [e.op for e in rec.events] == ["Tensor.to (a blocking copy to the host)"], rec.events


def test_grad_scaler_steps_under_the_detector():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(8, 4)
    with detect_syncs(device_type="cpu") as rec:
        for _ in range(2):
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(optimizer)  # reads found_inf back: a sync on a GPU too
            scaler.update()
            optimizer.zero_grad()
    assert rec.internal_errors == 0
    assert [e.op for e in rec.events] == ["Tensor.item()"] * 2


def test_a_failure_inside_the_detector_never_reaches_the_program(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a rule")

    from gpu_busy.syncs.rules import PYTHON_RULES, Rule

    monkeypatch.setitem(PYTHON_RULES, torch.Tensor.item, Rule("Tensor.item()", "", broken))
    with detect_syncs(device_type="cpu") as rec:
        value = x.sum().item()
    assert value == 15.0 and rec.internal_errors == 1
    # The layer below still sees the read: one broken rule loses its label, not the sync.
    assert [e.aten for e in rec.events] == ["aten._local_scalar_dense.default"]


def test_allow_syncs_marks_deliberate_syncs_for_strict_assert_and_the_report(no_syncs):
    from gpu_busy.syncs import allow_syncs

    @allow_syncs("a debug print every 1000 steps")
    def dump():
        return repr(x)

    with detect_syncs(device_type="cpu", strict=True) as rec:
        with allow_syncs("early stopping reads the loss once per epoch"):
            x.sum().item()
        dump()
    assert [e.allowed for e in rec.events] == [
        "early stopping reads the loss once per epoch",
        "a debug print every 1000 steps",
    ]
    assert assert_no_syncs(dump) is not None  # allowed: not a failure
    with no_syncs("cpu"), allow_syncs("checked on purpose"):
        x.max().item()
    with pytest.raises(AssertionError, match="1 host-device sync"):
        assert_no_syncs(lambda: (dump(), x.sum().item()))
    table = SyncSiteTable()
    table.add_all(rec.events, step=0, logging=False)
    text = "\n".join(table.render())
    assert "allowed: early stopping reads the loss once per epoch" in text
    with pytest.raises(ValueError, match="needs a reason"):
        allow_syncs("")


def test_the_first_watched_steps_fit_the_budget_of_a_fit_of_known_length():
    s = WatchSchedule(budget=0.01, first=3)
    assert s.plan_fit(600) and s.first == 3  # 3 x 175% = 5.25 plain steps of 600
    assert s.plan_fit(288) and s.first == 1  # the default fit: 3 cost 1.7% on a GPU machine
    assert not s.plan_fit(150) and s.first == 1  # even one is over 1%: watched, and said
    # The lone one is the second step, the first whose window holds a whole step.
    assert [n for n in range(4) if s.should_watch(n)] == [1]
    assert s.plan_fit(None) and s.plan_fit(float("inf")) and s.first == 3
    one = WatchSchedule()
    assert not one.plan_fit(1) and [n for n in range(1) if one.should_watch(n)] == [0]


def test_under_github_actions_user_syncs_become_annotations_on_the_diff(monkeypatch, capsys):
    from gpu_busy.syncs import allow_syncs
    from gpu_busy.syncs.sites import github_annotations

    monkeypatch.chdir(ROOT)
    with detect_syncs(device_type="cpu") as rec:
        _item()
        with allow_syncs("deliberate"):
            _nonzero()
    table = SyncSiteTable()
    table.add_all(rec.events, step=0, logging=False)
    (line,) = github_annotations(list(table.sites.values()))
    assert line.startswith(
        f"::warning file=tests/syncs/test_syncs.py,line={rec.events[0].lineno}::"
    )
    assert "1x Tensor.item()" in line and "self.log" in line
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    with pytest.raises(AssertionError):
        assert_no_syncs(_item)
    assert capsys.readouterr().out.startswith("\n::warning file=tests/syncs/test_syncs.py,line=")


def test_an_optimizers_step_counters_are_host_memory_however_they_were_made():
    """Adam keeps state["step"] on the host unless capturable or fused; counters made before
    watching began, or loaded on resume, are not device reads either."""
    w = torch.nn.Parameter(torch.ones(4))
    data = torch.arange(4.0)
    trained = torch.optim.Adam([w], lr=0.1)
    (w * data).sum().backward()
    trained.step()  # its counters exist before any detector
    resumed = torch.optim.Adam([w], lr=0.1)
    resumed.load_state_dict(trained.state_dict())

    def step(optimizer):
        optimizer.zero_grad()
        (w * data).sum().backward()
        optimizer.step()

    assert_no_syncs(step, trained)
    assert_no_syncs(step, resumed)
    capturable = torch.optim.Adam([w], lr=0.1, capturable=True)
    capturable.load_state_dict(trained.state_dict())
    with detect_syncs(device_type="cpu") as rec:
        step(capturable)  # its counters live on the device and are read there: no .item()
    assert rec.internal_errors == 0


def test_the_layers_use_only_the_detectors_declared_members_and_it_holds_its_memory():
    """syncs/layers.py works against the Detector protocol; SyncDetector provides it, and
    holds its HostMemory rather than being one."""
    import ast
    import inspect

    from gpu_busy.syncs import layers
    from gpu_busy.syncs.detector import SyncDetector
    from gpu_busy.syncs.memory import HostMemory

    declared = set(layers.Detector.__annotations__) | {
        name for name, _ in inspect.getmembers(layers.Detector, inspect.isfunction)
    }
    detector = SyncDetector("cpu")
    assert [name for name in declared if not hasattr(detector, name)] == []
    assert isinstance(detector.memory, HostMemory) and not isinstance(detector, HostMemory)

    def the_detector(node: ast.expr) -> bool:  # d, detector, self.d
        return getattr(node, "id", None) in ("d", "detector") or (
            isinstance(node, ast.Attribute) and node.attr == "d"
        )

    tree = ast.parse(inspect.getsource(layers))
    used = {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and the_detector(n.value)
    }
    assert used - declared == set(), used - declared
    assert used >= {"memory", "record", "timeline"}  # the walk sees the layers' reads


def test_a_move_to_the_cpu_the_line_names_is_a_copy_to_the_host_in_the_simulation():
    """Every device is the CPU in the simulation: ``x.device`` stands for the GPU, and a
    ``torch.device("cpu")`` written on the line for the host."""
    x = torch.ones(3)
    with detect_syncs(device_type="cpu") as rec:
        x.to(x.device)
        back = x.to(torch.device("cpu"))
        back.sum().item()  # host memory now: no read
    assert [e.op for e in rec.events] == ["Tensor.to (a blocking copy to the host)"]
