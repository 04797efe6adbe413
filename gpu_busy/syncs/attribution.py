"""Where a sync happened: the innermost frame of *your* code, the library chain between it
and the op, the fix that matches, and the syncs a user marked as deliberate.

Example::

    with allow_syncs("early stopping reads the loss once per epoch"):
        best = val_loss.item()
"""

from __future__ import annotations

import contextlib
import contextvars
import linecache
import os
import re
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from typing import Any

import torch

import gpu_busy.cuda_sync_warnings as warning_hook
from gpu_busy.syncs.rules import LIBRARY_READS


class SyncError(RuntimeError):
    """A host-device sync where ``strict`` detection allowed none."""


@dataclass(frozen=True)
class SyncEvent:
    """One operation that made (or, on a real device, would make) the host wait.

    ``filename``/``lineno``/``function``/``code`` are the innermost frame of user code;
    ``chain`` lists the library frames between it and the op, innermost first
    (``"lightning/pytorch/loops/training_epoch_loop.py:269 in _broadcast_sigterm_tensor"``).
    ``via`` is the innermost of those outside torch: the library line that asked for the
    read. ``aten`` is the aten op, when one was seen; ``hint`` what to do instead, from the
    rule that matched (``gpu_busy.syncs.rules``). ``host_ms`` and ``idle_after_ms`` are what
    it cost, on the host clock (``gpu_busy.syncs.costs``; None: not measured).
    """

    op: str
    filename: str
    lineno: int
    function: str = ""
    code: str = ""
    phase: str = "forward"
    aten: str | None = None
    chain: tuple[str, ...] = ()
    via: str | None = None
    hint: str = ""
    allowed: str | None = None  # the reason given to allow_syncs around it
    host_ms: float | None = None
    idle_after_ms: float | None = None
    # In the CPU simulation, a line in code that branches on the device: what that means
    # on a GPU (syncs.device_branches); ``cpu_only``: a GPU does not run the line at all.
    branch: str = ""
    cpu_only: bool = False

    @property
    def location(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno}"

    def __str__(self) -> str:
        where = f"{self.op} at {self.location}"
        if self.function:
            where += f" in {self.function}"
        if self.via:
            where += f" (via {self.via})"
        if self.allowed:
            where += f" [allowed: {self.allowed}]"
        if self.branch:
            where += f" [{self.branch}]"
        return f"{where}: {self.code}" if self.code else where


# -- what counts as user code --------------------------------------------------------

# With a trailing separator: "torchmetrics/" must not pass for "torch/".
_SYNCS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The measuring package counts as a library, wherever it is installed (an editable install
# is not under site-packages); its Lightning callbacks do not: a sync one of them makes
# on a logging step is reported at its line, so it can be seen and judged.
PACKAGE_DIR = os.path.dirname(_SYNCS_DIR.rstrip(os.sep)) + os.sep
_CALLBACKS_DIR = PACKAGE_DIR + "callbacks" + os.sep
_STDLIB_DIRS = tuple(
    {os.path.abspath(p) for p in (sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib"))}
)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The route CUDA's warnings travel (the warnings module, the shared hook) is no place to
# name: a warning heard outside any call is named after the first frame beyond it.
_WARNING_ROUTE = (os.path.abspath(warning_hook.__file__), os.path.abspath(warnings.__file__))
_INSTALLED = re.compile(r"[\\/](?:site|dist)-packages[\\/]")
_is_library_cache: dict[str, bool] = {}


def is_library(filename: str) -> bool:
    """Installed packages, the standard library, frozen modules and this package.

    Installed means under ``site-packages``/``dist-packages``, or in a package whose
    distribution metadata sits beside it on another ``sys.path`` entry (``pip install
    --target DIR`` on ``PYTHONPATH``, Bazel's runfiles), not the working directory or the
    script's folder (a project's own ``*.egg-info``). A source checkout on ``PYTHONPATH``
    without metadata is user code.
    """
    known = _is_library_cache.get(filename)
    if known is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        known = (
            filename.startswith("<frozen")
            or (path.startswith(PACKAGE_DIR) and not path.startswith(_CALLBACKS_DIR))
            or bool(_INSTALLED.search(path))
            or path.startswith(_STDLIB_DIRS)
            or _installed_elsewhere(path)
        )
        _is_library_cache[filename] = known
    return known


_installed_names: dict[str, set[str]] = {}  # sys.path entry -> top-level names installed there


def _installed_elsewhere(path: str) -> bool:
    """Whether ``path`` is in a package installed outside ``site-packages``: under a
    ``sys.path`` entry that holds that package's distribution metadata (``*.dist-info``,
    ``*.egg-info``), other than the working directory and the script's own folder (where
    metadata is the user's own project's, an editable install's)."""
    if path.startswith("<"):
        return False
    roots = [os.path.abspath(p or ".") + os.sep for p in sys.path]  # "": the working dir
    entries = [e for e in roots if path.startswith(e)]
    if not entries:
        return False
    entry = max(entries, key=len)
    own = {os.getcwd() + os.sep, os.path.dirname(os.path.abspath(sys.argv[0] or ".")) + os.sep}
    if entry in own or _INSTALLED.search(entry):
        return False
    if entry not in _installed_names:
        _installed_names[entry] = _top_levels_installed_in(entry)
    return path[len(entry) :].split(os.sep)[0].removesuffix(".py") in _installed_names[entry]


def _top_levels_installed_in(folder: str) -> set[str]:
    """The top-level packages and modules the distributions installed in ``folder`` hold."""
    import importlib.metadata

    names: set[str] = set()
    for dist in importlib.metadata.distributions(path=[folder]):
        listed = (dist.read_text("top_level.txt") or "").split()
        names.update(listed or {str(f).split("/")[0].removesuffix(".py") for f in dist.files or ()})
    return names


def short_path(filename: str) -> str:
    """Path after site-packages for libraries, relative to the working directory otherwise."""
    m = _INSTALLED.search(filename)
    if m:
        return filename[m.end() :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith("..") else rel


def fix_for(chain: tuple[str, ...], hint: str, chain_hints: tuple[tuple[str, str], ...] = ()):
    """The one fix for a sync: by a function in the library chain that made it
    (``chain_hints`` first, then a library's, ``rules.LIBRARY_READS``; first match wins),
    else ``hint``, the fix of the rule that matched."""
    joined = " ".join(chain)
    for marker, fix in (*chain_hints, *LIBRARY_READS):
        if marker in joined:
            return fix
    return hint


# The phase a caller names for an optimizer step, and the one after it returns.
OPTIMIZER_STEP, AFTER_OPTIMIZER_STEP = "optimizer step", "after optimizer step"

ALLOWED: contextvars.ContextVar[str | None] = contextvars.ContextVar("allowed", default=None)


class allow_syncs(contextlib.ContextDecorator):
    """Mark the syncs in a block (or a function) as deliberate, with the reason.

    They are still recorded and counted (they cost what they cost), listed with the
    reason, and neither ``strict`` nor ``assert_no_syncs`` nor ``no_syncs`` fails on them.

    Example::

        with allow_syncs("early stopping reads the loss once per epoch"):
            best = val_loss.item()

        @allow_syncs("a debug dump, every 1000 steps")
        def dump(t): print(t)
    """

    def __init__(self, reason: str) -> None:
        if not reason:
            raise ValueError("allow_syncs needs a reason: say why this sync is fine")
        self.reason = reason
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> allow_syncs:
        self._tokens.append(ALLOWED.set(self.reason))
        return self

    def __exit__(self, *exc: Any) -> None:
        ALLOWED.reset(self._tokens.pop())


def not_allowed(events: list[SyncEvent]) -> list[SyncEvent]:
    """The events no ``allow_syncs`` covered: what strict checks fail on."""
    return [e for e in events if e.allowed is None]


def describe(events: list[SyncEvent]) -> str:
    """``"2 host-device sync(s):"`` and one indented line per event."""
    lines = "\n".join(f"  {e}" for e in events)
    return f"{len(events)} host-device sync(s):\n{lines}"


def user_frame(frame: Any) -> Any:
    """The innermost frame of user code at or outside ``frame``; None if there is none
    inside the training loop (see ``event_here``)."""
    while frame is not None and is_library(frame.f_code.co_filename):
        if _TRAINING_LOOP.search(frame.f_code.co_filename):
            return None
        frame = frame.f_back
    return frame


def _kept(chain: list[str]) -> tuple[str, ...]:
    """The chain's innermost frames, up to the twelfth outside torch: torch's own wrappers
    (``torch.unique`` runs through eleven) never crowd out the library that called them,
    whose frame names the fix (``rules.LIBRARY_READS``)."""
    outside = 0
    for i, where in enumerate(chain):
        outside += not where.startswith("torch/")
        if outside > 12:
            return tuple(chain[:i])
    return tuple(chain)


def event_here(op: str, phase: str, aten: str | None, origins: tuple = ()) -> SyncEvent:
    """The event at the innermost user frame, going outward from the op.

    A user frame reached only through a training loop (Lightning's loops or Trainer) is the
    code that started training, not what asked for the read: the event then names the
    user line one of ``origins`` finds for a library frame (see ``SyncDetector``), else
    the library line that asked (``via``), as it does when no user frame exists at all
    (the autograd engine's own thread on CUDA)."""
    chain: list[str] = []
    via = via_frame = None
    in_loop = False
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library(filename) and not in_loop:
            return _event_at(op, frame, phase, aten, _kept(chain), via)
        if not is_library(filename):
            break
        if not filename.startswith(_SYNCS_DIR) and filename not in _WARNING_ROUTE:
            where = f"{short_path(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            chain.append(where)
            if not filename.startswith(TORCH_DIR):
                frames.append((frame, where))
                if via is None:
                    via, via_frame = where, frame
            in_loop = in_loop or bool(_TRAINING_LOOP.search(filename))
        frame = frame.f_back
    found = _origin_line(frames, origins)
    if found is not None:
        filename, lineno, function, where = found
        return _event_at_line(op, filename, lineno, phase, aten, _kept(chain), where,
                              function)  # fmt: skip
    if via_frame is not None:
        return _event_at(op, via_frame, phase, aten, _kept(chain), None)
    return SyncEvent(op, "<library>", 0, "", "", phase, aten, _kept(chain), via)


def _origin_line(frames: list, origins: tuple) -> tuple[str, int, str, str] | None:
    """The user line one of ``origins`` finds for a library frame, innermost first:
    ``(filename, lineno, function, via)``."""
    for library_frame, where in frames:
        for origin in origins:
            try:
                found = origin(library_frame)
            except Exception:  # a wrong guess must not cost the event, nor the program
                found = None
            if found is not None:
                filename, lineno, function, *reader = found
                # the via names who asked for the read (an origin may say: the loop, a
                # progress bar), else the library frame that found the line
                if reader and reader[0] is not None:
                    asked, code = reader[0], reader[0].f_code
                    where = f"{short_path(code.co_filename)}:{asked.f_lineno} in {code.co_name}"
                return filename, lineno, function, where
    return None


def _event_at(op: str, frame: Any, phase: str, aten: str | None, chain: tuple, via: Any):
    return _event_at_line(op, frame.f_code.co_filename, frame.f_lineno, phase, aten, chain,
                          via, frame.f_code.co_name)  # fmt: skip


def _event_at_line(op: str, filename: str, lineno: int, phase: str, aten: str | None,
                   chain: tuple, via: Any, function: str = "") -> SyncEvent:  # fmt: skip
    code = linecache.getline(filename, lineno).strip()
    return SyncEvent(op, filename, lineno, function, code, phase, aten, chain, via)


# Where a training loop runs: a user frame outside it only started training.
_TRAINING_LOOP = re.compile(r"lightning[\\/]pytorch[\\/](?:loops|trainer)[\\/]")
