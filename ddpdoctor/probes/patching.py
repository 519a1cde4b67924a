"""Monkeypatching that keeps every original.

Methods are patched on the existing classes (never replaced classes), so ``isinstance`` and
names imported before us keep working.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_ORIGINAL = "__ddpdoctor_original__"


def patch(owner: Any, name: str, make_wrapper: Callable[[Any], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` by ``make_wrapper(original)``; False if missing or already ours."""
    original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if original is None or _own(original) is not None:
        return False
    wrapper = make_wrapper(original)
    if callable(original) and not isinstance(original, (staticmethod, classmethod)):
        functools.update_wrapper(wrapper, original)
    setattr(wrapper, _ORIGINAL, original)
    setattr(owner, name, wrapper)
    return True


def _own(func: Any) -> Any:
    """What ``func`` wraps if it is ours, else None. A C probe's bound ``call`` carries it on
    the probe (``__self__``): a builtin method takes no attributes."""
    found = getattr(func, _ORIGINAL, None)
    if found is None and type(func).__name__ == "builtin_function_or_method":
        found = getattr(getattr(func, "__self__", None), _ORIGINAL, None)
    return found


def original(func: Any) -> Any:
    """The function under our wrapper (or ``func`` itself if it is not ours)."""
    found = _own(func)
    return func if found is None else found
