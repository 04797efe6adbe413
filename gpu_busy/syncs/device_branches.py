"""Reads the CPU simulation sees only because the code runs on a CPU.

Code may branch on where a tensor lives (``if x.device == torch.device("cpu")``,
``if not x.is_cuda``, ``if x.device.type == "cuda"``): torchmetrics tests binary preds
with an ``if`` on a CPU tensor and with ``torch.where`` on a CUDA one. In the simulation
every tensor is a CPU tensor, so a read on the CPU side is seen that a GPU never makes.
One rule decides: a sync is CPU only where its line, in any frame between the op and the
user's line, would not run on a GPU. That is read from the source: the line sits on one
side of an ``if`` that tests a device, or after an ``if`` whose other side returns or
raises; the test is evaluated with a CUDA device in place of each ``.device`` (and
``.is_cuda``, ``.is_cpu``) of device memory, and the CPU's for a tensor the simulation
knows is host memory (it stays there on a GPU). ``and``/``or`` settle as Python's do. A
test whose truth on a GPU hangs on anything else cannot be evaluated: the sync is counted,
and the site says the simulation cannot tell.

Example::

    branch = device_branch(sys._getframe(), memory.on_device)
    if branch is not None and branch.cpu_only:
        print(branch.text)   # "CPU only: no sync on a GPU (compute.py:232 tests ...)"
"""

from __future__ import annotations

import ast
import copy
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_busy.syncs.attribution import _SYNCS_DIR, _TRAINING_LOOP, is_library, short_path
from gpu_busy.syncs.rules import GPU_BRANCHES

# What a test may read about a tensor's place, and what it reads on each device.
_DEVICE_ATTRS = ("device", "is_cuda", "is_cpu")
_ON = {
    kind: {"device": torch.device(kind), "is_cuda": kind == "cuda", "is_cpu": kind == "cpu"}
    for kind in ("cpu", "cuda")
}


@dataclass(frozen=True)
class DeviceBranch:
    """A sync's line in code that branches on a device: ``cpu_only`` when the line does not
    run on a CUDA tensor; ``text`` says so, with the test's and the GPU side's lines."""

    cpu_only: bool
    text: str


@dataclass(frozen=True)
class _Region:
    """Lines ``first..last`` that run only where ``test`` evaluates to ``when``."""

    first: int
    last: int
    test: ast.expr
    test_line: int
    when: bool
    gpu_line: int | None  # where the other side begins


def device_branch(frame: Any, on_device: Callable[[Any], bool]) -> DeviceBranch | None:
    """The device branch a sync at ``frame`` (the op's caller) sits in: the frames from the
    op out to the first user frame (or into a training loop) are asked, innermost first.
    ``on_device(t)``: whether a tensor is device memory on a GPU (a host tensor's test
    reads "cpu" there too)."""
    unsure = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SYNCS_DIR):
            found = _in_branch(frame, on_device)
            if found is not None and found.cpu_only:
                return found
            unsure = unsure or found
            if not is_library(filename) or _TRAINING_LOOP.search(filename):
                break
        frame = frame.f_back
    return unsure


_regions: dict[str, tuple[_Region, ...]] = {}  # by file
_on_gpu: dict[tuple, bool | None] = {}  # a test's truth on a GPU, by (region, host names)


def _in_branch(frame: Any, on_device: Callable[[Any], bool]) -> DeviceBranch | None:
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    regions = _regions.get(filename)
    if regions is None:
        regions = _regions[filename] = _device_regions(filename)
    unsure = None
    for region in regions:
        if not region.first <= lineno <= region.last:
            continue
        host = _host_names(region.test, frame, on_device)
        key = (region, host)
        if key not in _on_gpu:
            _on_gpu[key] = _truth(region.test, "cuda", host)
        # The line ran here, on the CPU: whether it runs on a GPU is the test's truth there.
        on_gpu = _on_gpu[key]
        where = f"{short_path(filename)}:{region.test_line}"
        if on_gpu is None:
            unsure = DeviceBranch(
                False,
                f"on a GPU this line may not run ({where} tests the device along with other "
                "values): the simulation cannot tell; check it on a GPU",
            )
        elif on_gpu != region.when:
            return DeviceBranch(True, _cpu_only_text(frame, where, region))
    return unsure


def _cpu_only_text(frame: Any, where: str, region: _Region) -> str:
    path = short_path(frame.f_code.co_filename)
    known = GPU_BRANCHES.get((path, frame.f_code.co_name))
    gpu = f"{path}:{region.gpu_line}" if region.gpu_line else "the other side"
    if known:
        return f"CPU only: no sync on a GPU ({where} tests the device; on a GPU {gpu} {known})"
    return (
        f"CPU only: this line does not run on a GPU ({where} tests the device); the GPU "
        f"side, {gpu}, did not run here: check it on a GPU"
    )


def _host_names(test: ast.expr, frame: Any, on_device: Callable[[Any], bool]) -> frozenset:
    """The local names in ``test`` whose device is read and that hold host memory: on a GPU
    they are still on the CPU."""
    names = set()
    for node in ast.walk(test):
        if _device_read(node) and isinstance(node.value, ast.Name):
            value = frame.f_locals.get(node.value.id)
            if isinstance(value, torch.Tensor) and not on_device(value):
                names.add(node.value.id)
    return frozenset(names)


def _truth(test: ast.expr, kind: str, host: frozenset) -> bool | None:
    """The test's truth with every device tensor on ``kind`` (``host`` names on the CPU);
    None where it depends on more than devices. ``and``/``or``/``not`` are read as Python
    does, so ``x.is_cuda and flag`` is False on the CPU whatever ``flag`` is."""
    if isinstance(test, ast.BoolOp):
        values = [_truth(v, kind, host) for v in test.values]
        decisive = isinstance(test.op, ast.Or)  # what settles it: True for or, False for and
        if decisive in values:
            return decisive
        return None if None in values else not decisive
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        value = _truth(test.operand, kind, host)
        return None if value is None else not value
    try:
        tree = ast.Expression(_Substitute(host).visit(copy.deepcopy(test)))
        ast.fix_missing_locations(tree)
        if not _only_devices(tree):
            return None
        namespace = {"torch": torch, "str": str, "__builtins__": {}}
        for place, on in (("", kind), ("host_", "cpu")):
            namespace |= {f"__{place}{attr}__": value for attr, value in _ON[on].items()}
        return bool(eval(compile(tree, "<device test>", "eval"), namespace))
    except Exception:
        return None


def _device_read(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in _DEVICE_ATTRS
        and ast.unparse(node) != "torch.device"
    )


class _Substitute(ast.NodeTransformer):
    """``<tensor>.device`` (``.is_cuda``, ``.is_cpu``) becomes a name the namespace gives:
    the device's, or the host's for ``host`` names."""

    def __init__(self, host: frozenset) -> None:
        self.host = host

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if not _device_read(node):
            return self.generic_visit(node)
        place = "host_" if isinstance(node.value, ast.Name) and node.value.id in self.host else ""
        return ast.copy_location(ast.Name(f"__{place}{node.attr}__", ast.Load()), node)


_SUBSTITUTES = {f"__{place}{attr}__" for place in ("", "host_") for attr in _DEVICE_ATTRS}


def _only_devices(tree: ast.AST) -> bool:
    """Whether the substituted test reads nothing but devices, constants, ``torch.device``
    and ``str``: then evaluating it runs no code of the program's."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in ("torch", "str", *_SUBSTITUTES):
            return False
        if isinstance(node, ast.Call) and ast.unparse(node.func) not in ("torch.device", "str"):
            return False
        if (
            isinstance(node, ast.Attribute)
            and ast.unparse(node) != "torch.device"
            and node.attr not in ("type", "index")
        ):
            return False
    return True


def _device_regions(filename: str) -> tuple[_Region, ...]:
    """Every region of a file's code guarded by an ``if`` that reads a device attribute."""
    source = "".join(linecache.getlines(filename))
    if not any(f".{attr}" in source for attr in _DEVICE_ATTRS):
        return ()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    regions: list[_Region] = []
    for block in _blocks(tree):
        for i, node in enumerate(block):
            if isinstance(node, ast.If) and _reads_device(node.test):
                regions += _regions_of(node, block[i + 1 :])
    return tuple(regions)


def _blocks(tree: ast.AST):
    """Every statement list in the tree (bodies, else branches, handlers...)."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _reads_device(test: ast.expr) -> bool:
    return any(_device_read(n) for n in ast.walk(test))


def _regions_of(node: ast.If, after: list[ast.stmt]) -> list[_Region]:
    test, line = node.test, node.lineno

    def region(stmts: list[ast.stmt], when: bool, other: list[ast.stmt]) -> _Region:
        gpu = other[0].lineno if other else (after[0].lineno if after else None)
        return _Region(stmts[0].lineno, stmts[-1].end_lineno or stmts[-1].lineno, test, line,
                       when, gpu)  # fmt: skip

    out = [region(node.body, True, node.orelse)]
    if node.orelse:
        out.append(region(node.orelse, False, node.body))
    body_exits, else_exits = _exits(node.body), bool(node.orelse) and _exits(node.orelse)
    if after and body_exits != else_exits:
        # The code after the if runs only where the side that returns was not taken.
        out.append(region(after, not body_exits, node.body if body_exits else node.orelse))
    return out


def _exits(block: list[ast.stmt]) -> bool:
    return isinstance(block[-1], ast.Return | ast.Raise)
