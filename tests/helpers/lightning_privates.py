"""Where code reaches a private part of Lightning: the check behind "one door".

A private part is a name with a leading underscore that Lightning's own source defines (a
method, a function, a class, an attribute it assigns), a name imported from Lightning with
one, or one of Lightning's source files named in a string or a path. A class of ours may
hold private attributes of its own: an attribute counts as ours where a class of ours that
does not derive from Lightning assigns or defines it; in a class that does derive from
one, where the Lightning classes it derives from do not define it too (overriding or
setting theirs is reaching).

Example::

    found = reaches(Path("gpu_busy").rglob("*.py"), module_of=lambda path: ...)
    assert found == []
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning

LIGHTNING = Path(lightning.__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# What Lightning's source defines: def/class names, and the names it assigns (``self._x =``,
# ``_X =`` at module or class level). Read as text: parsing its 300 files costs seconds.
_DEFINES = re.compile(r"^\s*(?:def|class)\s+(_\w+)|^\s*(?:self\.)?(_\w+)\s*(?::[^=]*)?=[^=]", re.M)


@functools.cache
def lightning_names() -> tuple[frozenset[str], frozenset[str]]:
    """The private names Lightning's source defines, and the names of its source files."""
    names, files = set(), set()
    for path in [*(LIGHTNING / "pytorch").rglob("*.py"), *(LIGHTNING / "fabric").rglob("*.py")]:
        files.add(path.name)
        names |= {a or b for a, b in _DEFINES.findall(path.read_text())}
    return frozenset(filter(_private, names)), frozenset(files - {"__init__.py"})


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """What a class's body defines: methods, class attributes, and ``self.x`` it assigns."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node in cls.body:
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and node in cls.body:
                    names.add(target.id)
                elif (
                    isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self"
                ):
                    names.add(target.attr)
    return {n for n in names if _private(n)}


@functools.cache
def _lightnings_own(cls: type) -> frozenset[str]:
    """What the Lightning classes ``cls`` derives from define (methods, ``self.x``)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("lightning."):
            continue
        names |= set(vars(base))
        try:
            tree = ast.parse(inspect.getsource(base).lstrip())
        except (OSError, TypeError, IndentationError):
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return frozenset(n for n in names if _private(n))


def reaches(paths: Iterable[Path], module_of: Callable[[Path], str]) -> list[str]:
    """``file:line: what`` for every place in ``paths`` that reaches a private part of
    Lightning. ``module_of`` names the module a path is imported as (to find its classes)."""
    privates, files = lightning_names()
    trees = {path: ast.parse(path.read_text()) for path in paths}
    ours: set[str] = set()
    said: set[str] = set()  # set or overridden by a subclass: reported once, at the class
    found = []
    for path, tree in trees.items():
        module = None
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node in tree.body:
                ours.add(node.name)
            if not isinstance(node, ast.ClassDef):
                continue
            defined = _defined_in(node)
            module = module or importlib.import_module(module_of(path))
            cls = getattr(module, node.name, None)
            theirs = _lightnings_own(cls) if isinstance(cls, type) else frozenset()
            for name in sorted(defined & theirs):
                found.append(f"{path}:{node.lineno}: {node.name} sets or overrides {name}")
            ours |= defined - theirs
            said |= defined & theirs
    for path, tree in trees.items():
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue
            if isinstance(node, ast.Attribute) and node.attr in privates - ours - said:
                found.append(f"{path}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
                found += [f"{path}:{node.lineno}: imports {a.name}" for a in node.names
                          if _private(a.name)]  # fmt: skip
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in files or "lightning/" in node.value.replace("\\", "/"):
                    found.append(f"{path}:{node.lineno}: names Lightning's file {node.value!r}")
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "join"
                and any(getattr(a, "value", None) == "lightning" for a in node.args)
            ):
                found.append(f"{path}:{node.lineno}: joins a path into Lightning's files")
    return sorted(set(found))
