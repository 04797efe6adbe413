"""One Lightning per process: ``pytorch_lightning`` is ``lightning.pytorch``, and
``lightning_fabric`` is ``lightning.fabric``, so that the one copy of the callbacks and of
``lightning_compat`` serves a script written against either name, or both.

Lightning publishes its code twice, as ``lightning`` (``lightning.pytorch``) and as
``pytorch-lightning`` (``pytorch_lightning``): the same source at the same version, whose
classes are nonetheless distinct (a ``pytorch_lightning.Trainer`` takes a
``lightning.pytorch`` ``ModelCheckpoint`` for a plain callback). Lightning's own checkpoint
loader treats the two names as one (``_RedirectingUnpickler``,
``utilities/migration/utils.py``); this does the same for imports. ``import gpu_busy``
installs a finder that imports nothing itself: from then on, importing a module under one
name gives the module of the other name where that one is the package in use, so each
class exists once.

Which name is the real package: ``lightning.pytorch``, unless ``pytorch_lightning`` was
imported before ``gpu_busy`` and ``lightning.pytorch`` was not (then the other way round).
The two stay apart, and ``apart()`` says why, where their versions differ or both were
imported as two packages before ``gpu_busy``.

Example::

    import pytorch_lightning as pl      # before or after `import gpu_busy`: one package
    import gpu_busy
    trainer = pl.Trainer(**gpu_busy.defaults())
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

# The name gpu_busy imports (from the distribution "lightning"), the other name, and the
# distributions that ship the other (lightning_fabric comes with pytorch-lightning too).
PAIRS = (
    ("lightning.pytorch", "pytorch_lightning", ("pytorch-lightning",)),
    ("lightning.fabric", "lightning_fabric", ("lightning-fabric", "pytorch-lightning")),
)

_why_apart: list[str] = []


def apart() -> str | None:
    """Why a pair of names is two packages in this process; None where each is one."""
    return _why_apart[0] if _why_apart else None


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class _Existing:  # a loader (importlib.abc.Loader's two methods; the ABC costs 7 ms)
    """Hands the import system a module that already exists under another name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's; the module keeps its own


class _OneName:  # a meta path finder: find_spec is all the import system asks
    """Imports of ``alias`` and its submodules give the modules of ``real``, where the
    distributions in ``pair`` are at one version."""

    def __init__(self, alias: str, real: str, pair: tuple[str, str, tuple[str, ...]]) -> None:
        self.alias, self.real, self.pair = alias, real, pair
        self._one_version: bool | None = None

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        if not self._versions_agree():
            return None  # two packages, as without us
        real_name = self.real + fullname[len(self.alias) :]
        try:
            module = importlib.import_module(real_name)
        except ModuleNotFoundError as e:
            if e.name != real_name:
                raise
            return self._own_file(fullname)  # one distribution's alone (__about__): its own
        if fullname == self.alias:
            _share_logger(self.alias, self.real)
        return importlib.util.spec_from_loader(fullname, _Existing(module))

    def _versions_agree(self) -> bool:
        # Asked at the first import of the alias, not at `import gpu_busy`: importlib.metadata
        # costs 30 ms that `import gpu_busy.prefetch` need not pay.
        if self._one_version is None:
            ours, other, distributions = self.pair
            theirs_version = next(filter(None, map(_version, distributions)), None)
            ours_version = _version("lightning")
            self._one_version = theirs_version == ours_version
            if not self._one_version and theirs_version and ours_version:
                _why_apart.append(f"{other} is version {theirs_version} and {ours} is "
                                  f"{ours_version}: install one version of both")  # fmt: skip
        return self._one_version

    def _own_file(self, fullname: str):
        own = importlib.machinery.PathFinder.find_spec(self.alias.split(".")[0])
        if own is None or not own.submodule_search_locations:
            return None
        *folders, _ = fullname.split(".")[1:]
        where = [os.path.join(root, *folders) for root in own.submodule_search_locations]
        return importlib.machinery.PathFinder.find_spec(fullname, where)


def _share_logger(alias: str, real: str) -> None:
    """``logging.getLogger(alias)`` is the real package's logger: a script that quiets
    ``pytorch_lightning`` quiets what Lightning now logs under ``lightning.pytorch``."""
    import logging

    loggers = logging.Logger.manager.loggerDict
    if not isinstance(loggers.get(alias), logging.Logger):
        loggers[alias] = logging.getLogger(real)


def make_one() -> None:
    """Install the finders (once per process; ``import gpu_busy`` calls this)."""
    if any(isinstance(f, _OneName) for f in sys.meta_path) or _why_apart:
        return
    for pair in PAIRS:
        ours, other, _ = pair
        theirs, mine = sys.modules.get(other), sys.modules.get(ours)
        if theirs is not None and mine is not None and theirs is not mine:
            _why_apart.append(f"{ours} and {other} were both imported before gpu_busy, as two "
                              "packages: import gpu_busy first, or run the script with "
                              "python -m gpu_busy run")  # fmt: skip
            continue
        alias, real = (ours, other) if theirs is not None and mine is None else (other, ours)
        sys.meta_path.insert(0, _OneName(alias, real, pair))


def spawned_children_too() -> Callable[[], None]:
    """Processes started with the ``spawn`` method (Lightning's ``ddp_spawn``) make the two
    names one before they import the parent's script, as this process did; returns the
    undo.

    A spawned child imports ``__main__``'s file first and unpickles the Trainer after
    (CPython ``multiprocessing/spawn.py``, ``prepare`` then ``_main``): a script's
    ``import pytorch_lightning`` there would come before ``gpu_busy`` and make two packages.
    Its command (``spawn.get_command_line``) gains ``import gpu_busy`` first; the path it
    imports from is this process's, which ``prepare`` then replaces with the parent's.
    """
    from multiprocessing import spawn

    from gpu_busy.patches import patch

    original = spawn.get_command_line
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def get_command_line(**kwds: Any) -> list[str]:
        command = original(**kwds)
        if "-c" in command:
            at = command.index("-c") + 1
            first = f"import sys; sys.path.insert(0, {home!r}); import gpu_busy; "
            command[at] = first + command[at]
        return command

    return patch(spawn, "get_command_line", get_command_line)
