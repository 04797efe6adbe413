"""Attributes replaced while something runs, and put back as they were.

Example::

    undo = patch(torch.cuda, "synchronize", marked)
    ...
    undo()     # torch.cuda.synchronize is the original again, unless replaced meanwhile
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def patch(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``owner.name`` to ``value``; returns the undo. The undo puts back what ``owner``
    itself held (an instance without an attribute of its own sees its class's again), and
    does nothing where ``value`` was replaced since: putting ours back would undo theirs."""
    own = vars(owner)
    had, before = name in own, own.get(name)
    setattr(owner, name, value)

    def undo() -> None:
        if vars(owner).get(name) is not value:
            return
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)

    return undo
