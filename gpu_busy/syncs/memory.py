"""The CPU simulation's memory: which tensors a GPU run would hold on the device.

On a machine without the GPU every tensor is a CPU tensor. ``HostMemory`` keeps the ones a
GPU run would hold on the host (made without ``device=``, moved with ``.cpu()``, computed
from host tensors alone, a batch before it is moved), so that a read of one is no sync
and a read of any other is. ``SyncDetector`` is one; on a GPU it asks the tensor itself.
"""

from __future__ import annotations

import collections
import linecache
import os
import re
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from gpu_busy.syncs.attribution import PACKAGE_DIR, TORCH_DIR
from gpu_busy.syncs.rules import FACTORIES, DeviceTypeName, means_host, move_target

COPY = torch.ops.aten.copy_.default
_NAMES_THE_CPU = re.compile(r"""device\(\s*["']cpu["']\s*\)""")
_WRITES_CPU = re.compile(r"""["']cpu["']""")
_NOT_THE_CALLER = (TORCH_DIR, PACKAGE_DIR)
_SYNCS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the simulation's own
_named: dict[tuple[str, int, bool], bool] = {}  # by (file, line, string): writes the CPU


class HostMemory:
    """Which tensors are device memory: on a GPU, those on it; simulated on the CPU
    (``device_type="cpu"``), every tensor but those known to live on the host."""

    def __init__(self, device_type: str) -> None:
        self.device_type = torch.device(device_type).type
        # On a machine without the device, its tensors are CPU tensors: the simulation.
        self.simulating = self.device_type == "cpu"
        self._host = WeakIdKeyDictionary()  # simulation: tensors that live on the host
        self._mirrors: dict[int, tuple[str, str]] = {}  # see copies_to_host
        self._host_devices: dict[int, torch.device] = {}  # see devices_on_the_host

    @property
    def knows_host_tensors(self) -> bool:
        """Whether any tensor is marked host memory (in the simulation): a result computed
        from inputs needs following only then."""
        return bool(self._host)

    @property
    def mirroring(self) -> bool:
        """Whether a library's device tensor was given to ``copies_to_host``."""
        return bool(self._mirrors)

    def on_device(self, value: Any) -> bool:
        """Whether ``value`` is device memory, the one question every rule asks.

        On a GPU: a tensor on it. In the CPU simulation: a CPU tensor that a GPU run would
        hold on the device, i.e. any tensor except those made on the host while watching: a
        factory call without ``device=`` (or with the string ``"cpu"``), ``.cpu()``,
        ``.to("cpu")``, whatever is computed from host tensors alone, and what
        ``mark_host`` was given (an optimizer's step counters). A read of a host tensor is
        no sync; a blocking copy of one to the device is.
        """
        return (
            isinstance(value, torch.Tensor)
            and value.device.type == self.device_type
            and not (self.simulating and value in self._host)
        )

    def names_the_host(self, device: Any) -> bool:
        """In the simulation, whether a move's target means the host. Where a tensor goes
        follows how its target was made, not what it holds (every device is "cpu" here):
        a ``torch.device`` the program keeps for the host (``devices_on_the_host``), or the
        CPU written on the line that asks (``.to("cpu")``, ``torch.device("cpu")``). A
        variable, ``x.device``, ``self.device``, or a string a function returned stands
        for the device, as on a GPU it is one."""
        if isinstance(device, str):
            # the line that passed the string, torch's own too (Adam's step counter is
            # torch.tensor(0.0, device="cpu")), this package's (a pinned read to the host)
            return self._line_writes_the_cpu((_SYNCS_DIR,), string=True)
        if id(device) in self._host_devices:
            return True
        return self._line_writes_the_cpu(_NOT_THE_CALLER, string=False)

    def _line_writes_the_cpu(self, skipped: tuple[str, ...], string: bool) -> bool:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(skipped):
            frame = frame.f_back
        if frame is None:
            return False
        key = (frame.f_code.co_filename, frame.f_lineno, string)
        named = _named.get(key)
        if named is None:
            pattern = _WRITES_CPU if string else _NAMES_THE_CPU
            named = _named[key] = bool(pattern.search(linecache.getline(*key[:2])))
        return named

    def devices_on_the_host(self, *devices: torch.device) -> None:
        """In the simulation, these ``torch.device`` objects mean the host: the program made
        them for the host and keeps them (a replay buffer's ``torch.device("cpu")``); a GPU
        run keeps its device elsewhere, Lightning's ``self.device``."""
        for device in devices:
            self._host_devices[id(device)] = device  # held: its id stays its own

    def mark_host(self, *tensors: Any) -> None:
        """In the CPU simulation, count these tensors as host memory."""
        if self.simulating:
            self._put(list(tensors), on_host=True)

    def batch_from_host(self, batch: Any) -> None:
        """In the simulation, a batch the DataLoader hands over is host memory, as it is on
        a GPU until something moves it, whenever it was collated (Lightning's fetcher reads
        one ahead, outside the step that moves it): its tensors, in collections and in a
        batch object's attributes, are marked host. A move to the device returns a new,
        device tensor (``place`` here, and the prefetcher's own move); a blocking one is a
        sync, as a batch class's ``.to`` is on a GPU (docs/ARCHITECTURE.md, "Finding
        host-device syncs")."""
        if self.simulating:
            self.mark_host(*held_tensors(batch))

    def copies_to_host(self, tensor: torch.Tensor, label: str, hint: str) -> None:
        """``tensor`` is device memory that a library copies into a host tensor of its own
        (``copy_`` in C++, then host reads of that copy): each such copy is one event,
        ``label`` with ``hint``, and in the CPU simulation its destination is host memory.
        DDP's reducer does this with its used-parameter map under
        ``find_unused_parameters=True``: one blocking copy per backward on a GPU."""
        self._mirrors[tensor.data_ptr()] = (label, hint)

    def host_mirror_of(self, func: Any, args: tuple) -> tuple[str, str] | None:
        """The (label, hint) of a ``copy_`` out of a tensor given to ``copies_to_host``."""
        if not self._mirrors or func is not COPY or len(args) < 2:
            return None
        src = args[1]
        return self._mirrors.get(src.data_ptr()) if isinstance(src, torch.Tensor) else None

    def follow_mirror(self, args: tuple) -> None:
        """In the simulation, the library's own copy on the other side of a mirrored
        device tensor (what it copies into it, and out of it) is host memory."""
        dst, src = args[0], args[1]
        if src.data_ptr() in self._mirrors:
            self.mark_host(dst)
        elif dst.data_ptr() in self._mirrors:
            self.mark_host(src)

    def follow_inputs(self, args: tuple, kwargs: dict, out: Any) -> None:
        """What is computed from host tensors alone is on the host."""
        inputs = tensors_of(args, kwargs)
        if inputs and all(t in self._host for t in inputs):
            self.mark_host(*flat(out))

    def place(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Where a Python-level call put its result, the host or the device; returns the
        result. A move (``.cpu()``, ``.to(...)``, ``.type_as(...)``) of a CPU tensor that
        is already where it goes returns the tensor itself: the simulation hands back a
        view of it instead (a new tensor, as on a GPU, with the same values and autograd),
        so that marking the result leaves the source where it was. ``p.data = t`` (how
        ``Module.to`` moves parameters) puts ``p`` where ``t`` is."""
        target = move_target(self, func, args, kwargs)
        if target is not None:
            on_host = target
        elif func in FACTORIES and not excused():
            device = kwargs.get("device")
            on_host = device is None or means_host(self, device)
        elif sets_data(func) and len(args) == 2 and isinstance(args[1], torch.Tensor):
            self._put(args[0], args[1] in self._host)
            return out
        elif func is torch.Tensor.type and isinstance(out, str) and self.on_device(args[0]):
            return DeviceTypeName(out)  # what x.type() names on a GPU: a device type
        else:
            return out
        if isinstance(out, torch.Tensor) and args and out is args[0]:
            if on_host == (out in self._host):
                return out  # already where it goes: no copy on a GPU either
            out = out.view_as(out)
        self._put(out, on_host)
        return out

    def _put(self, out: Any, on_host: bool) -> None:
        for t in flat(out):
            if on_host:
                self._host[t] = True
            else:
                self._host.pop(t, None)


class NewTensors(TorchFunctionMode):
    """A ``Tensor.to`` onto the device a tensor is already on returns a new tensor (a view
    of the same memory), as a copy to a GPU does; the prefetcher moves batch objects onto
    the host device under it. The simulation keeps the DataLoader's tensors as host memory
    by identity, and a move that handed back the very tensors would carry that mark to the
    step (docs/ARCHITECTURE.md, "Finding host-device syncs").

    Example::

        with NewTensors():
            moved = graph.to("cpu", non_blocking=True)  # no tensor of graph's in moved
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _TENSOR_TO and args and out is args[0]:
            return out.view_as(out)
        return out


_TENSOR_TO = torch.Tensor.to


def tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of a call, one level into lists and tuples."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def held_tensors(obj: Any, depth: int = 4, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors ``obj`` holds: itself, or inside dicts, sequences and an object's
    attributes (a batch class), ``depth`` levels down. (``apply_to_collection`` stops at
    a batch class, whose tensors are what its own ``.to`` copies.)"""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if seen is None:
        plain: list[torch.Tensor] = []
        if plain_tensors(obj, plain):  # the usual batch: a third of the walk below
            return plain
        seen = set()
    if depth == 0 or id(obj) in seen or isinstance(obj, str | bytes | int | float | bool):
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [t for item in items for t in held_tensors(item, depth - 1, seen)]


def plain_tensors(x: Any, out: list[torch.Tensor]) -> bool:
    """Whether ``x`` is built of lists, tuples and dicts over tensors and plain values
    alone (exact types: a namedtuple or a tensor subclass is not plain); its
    tensors go into ``out`` in order."""
    kind = type(x)
    if kind is torch.Tensor:
        out.append(x)
        return True
    if kind is tuple or kind is list:
        return all(plain_tensors(v, out) for v in x)
    if kind is dict:
        return all(plain_tensors(v, out) for v in x.values())
    return kind in _PLAIN_LEAVES


_PLAIN_LEAVES = frozenset((int, float, bool, str, bytes, type(None)))


def held_outside_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a module and its submodules keep as plain attributes, in lists, dicts and
    deques too (a replay buffer's first entries, torchvision's cell anchors), and in the
    attributes of plain objects of the user's own classes it keeps (a replay buffer in a
    helper object), three levels down. ``Module.to`` moves only parameters and buffers
    (torch/nn/modules/module.py, ``Module._apply``), so on a GPU these stay on the host
    where ``__init__`` made them. A module class with its own ``_apply`` (a torchmetrics
    ``Metric`` moves its states there) is left out: it may move them; so are objects of
    the frameworks' classes (the Trainer a LightningModule holds, a dataset, a module)."""
    return [t for t, _ in _held(module)]


def refilled_slots(module: torch.nn.Module) -> list[tuple[Any, str]]:
    """The attributes (``(owner, name)``) where ``held_outside_parameters`` found host
    memory in a container (a list, tuple, deque or dict) or in a helper object: what a
    program puts there between watched steps is unseen by the simulation, and takes the
    kind the slot's tensors had as the last watched step ended (``SlotKinds``). A bare
    tensor attribute of a module is not one: a program may put a device result there
    (``self.last_loss = loss``)."""
    slots: dict[tuple[int, str], tuple[Any, str]] = {}
    for _, (owner, name, refilled) in _held(module):
        if refilled:
            slots[(id(owner), name)] = (owner, name)
    return list(slots.values())


class SlotKinds:
    """Where the tensors a program keeps in its slots live, by how they were made.

    A tensor the simulation saw made (in a watched step) keeps its own place, whatever
    holds it later: torchvision's cell anchors, moved to the device in the first watched
    step, stay device memory in the list that held them on the host. A tensor made between
    watched steps, unseen, takes the kind its slot's tensors had as the last watched step
    ended (host before the first: ``__init__`` made them): a replay buffer refilled from
    the host every step stays host memory.

    Example::

        kinds = SlotKinds(refilled_slots(module))
        kinds.window_opens(memory)     # unseen tensors placed
        ...                            # the watched step
        kinds.window_closes(memory)    # each slot's kind, and the tensors seen
    """

    def __init__(self, slots: list[tuple[Any, str]]) -> None:
        self.slots = slots
        self._host = {i: True for i in range(len(slots))}  # each slot's kind
        self._seen = WeakIdKeyDictionary()  # tensors in a slot when a watched step ended

    def window_opens(self, memory: HostMemory) -> None:
        for i, (owner, name) in enumerate(self.slots):
            unseen = [t for t in tensors_in(getattr(owner, name, None)) if t not in self._seen]
            memory._put(unseen, self._host[i])

    def window_closes(self, memory: HostMemory) -> None:
        for i, (owner, name) in enumerate(self.slots):
            held = tensors_in(getattr(owner, name, None))
            if held:
                self._host[i] = not any(memory.on_device(t) for t in held)
            for t in held:
                self._seen[t] = True


def held_host_devices(module: torch.nn.Module) -> list[torch.device]:
    """The ``torch.device("cpu")`` objects a module, its submodules and the user's helper
    objects keep under public names (a sampler's ``self.host``): made for the host."""
    out: list[torch.device] = []

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.device):
            if value.type == "cpu":
                out.append(value)
        elif depth and (isinstance(value, torch.nn.Module) or _users_object(value)):
            for name, v in vars(value).items():
                if not name.startswith("_"):
                    walk(v, depth - 1)

    for m in module.modules():
        walk(m, 2)
    return out


def tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors (not parameters) in ``value``: itself, or in its containers and the
    attributes of the user's own objects, ``depth`` levels down."""
    out: list[torch.Tensor] = []
    _walk(value, depth, lambda t, _: out.append(t), None)
    return out


def _held(module: torch.nn.Module) -> list[tuple[torch.Tensor, tuple[Any, str, bool]]]:
    """Each tensor held outside parameters, with its slot: ``(owner, attribute, refilled)``,
    ``refilled`` where it sits in a container or a helper object."""
    out: list[tuple[torch.Tensor, tuple[Any, str, bool]]] = []
    for m in module.modules():
        if type(m)._apply is not torch.nn.Module._apply:
            continue
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                own = (m, name, not isinstance(value, torch.Tensor))  # refilled: a container
                _walk(value, 3, lambda t, slot, own=own: out.append((t, slot or own)), None)
    return out


def _walk(value: Any, depth: int, found: Any, slot: tuple | None) -> None:
    """``found(tensor, slot)`` for each tensor in ``value``; ``slot`` is the helper
    object's attribute it sits under, where there is one."""
    if isinstance(value, torch.Tensor):
        if not isinstance(value, torch.nn.Parameter):
            found(value, slot)
    elif not depth:
        return
    elif isinstance(value, dict):
        for v in value.values():
            _walk(v, depth - 1, found, slot)
    elif isinstance(value, list | tuple | set | frozenset | collections.deque):
        for v in value:
            _walk(v, depth - 1, found, slot)
    elif _users_object(value):
        for name, v in vars(value).items():
            _walk(v, depth - 1, found, slot or (value, name, True))


_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "torchmetrics", "numpy")


def _users_object(value: Any) -> bool:
    """An instance of a class of the user's own (not a framework's, not a module)."""
    kind = type(value)
    if isinstance(value, type | torch.nn.Module) or not hasattr(value, "__dict__"):
        return False
    return kind.__module__.split(".")[0] not in (*_FRAMEWORKS, "builtins")


def flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


_DATA_DIR = os.path.join(TORCH_DIR, "utils", "data", "")


def excused() -> bool:
    """What the CPU simulation sees that a GPU run does not do, decided in this one place:
    the DataLoader's own work (num_workers=0), which handles host tensors on any machine.

    Reads of host tensors are not excused here: ``HostMemory.on_device`` never calls
    them device memory in the first place. Lightning's batch transfer is not excused
    either: ``lightning_compat.moves_to_the_cpu_as_to_cuda`` makes it pass the
    ``non_blocking`` it passes on CUDA, and a batch class's own ``.to`` decides as it does
    on a GPU.
    """
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_DATA_DIR):
            return True
        frame = frame.f_back
    return False


_DATA = torch._C.TensorBase.__dict__["data"]


def sets_data(func: Any) -> bool:
    """``tensor.data = other``, as the function layer sees it (a bound descriptor setter)."""
    return getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__"
