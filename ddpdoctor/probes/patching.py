"""Monkeypatching that keeps every original under the wrapper (``original``).

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
    if original is None or hasattr(original, _ORIGINAL):
        return False
    wrapper = make_wrapper(original)
    if callable(original) and not isinstance(original, (staticmethod, classmethod)):
        functools.update_wrapper(wrapper, original)
    setattr(wrapper, _ORIGINAL, original)
    setattr(owner, name, wrapper)
    return True


def original(func: Any) -> Any:
    """The function under our wrapper (or ``func`` itself if it is not ours)."""
    return getattr(func, _ORIGINAL, func)
