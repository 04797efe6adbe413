"""Attributes replaced while something runs, and put back as they were.

Example::

    undo = patch(torch.cuda, "synchronize", marked)
    ...
    undo()     # torch.cuda.synchronize is the original again, unless replaced meanwhile

    # a user's method: callers that read its signature (Lightning) read the user's own
    undo = patch(module, "training_step", signature_kept(module.training_step, counted))
"""

from __future__ import annotations

import functools
import inspect
import types
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


def signature_kept(original: Callable, replacement: Callable) -> Callable:
    """``replacement`` (called with the same arguments as ``original``) dressed so that
    whoever reads the signature reads ``original``'s, as it would without us.

    Lightning passes a hook only the arguments its signature takes: it unwraps one
    ``__wrapped__`` level and calls ``inspect.getfullargspec`` (``utilities/
    signature_utils.py``, ``is_param_in_hook_signature``). So the result's one unwrap gives
    what one unwrap of ``original`` gives (the user's own function, or what their decorator
    wraps), and a bound method stays a bound method of the same object, which
    ``inspect.signature`` reads without ``self``.
    """
    if inspect.ismethod(original):
        function, owner = original.__func__, original.__self__

        def method(_self: Any, *args: Any, **kwargs: Any) -> Any:
            return replacement(*args, **kwargs)

        functools.update_wrapper(method, function)
        method.__wrapped__ = getattr(function, "__wrapped__", function)
        return types.MethodType(method, owner)

    def plain(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    functools.update_wrapper(plain, original)
    plain.__wrapped__ = getattr(original, "__wrapped__", original)
    return plain
