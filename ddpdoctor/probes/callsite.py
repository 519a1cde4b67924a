"""The user's line that issued a sync point: the first frame outside torch, ddpdoctor, the
frameworks that wrap DDP (Lightning, Accelerate...) and the standard library.

A diagnosis that says "rank 0 called barrier() at train.py:28 while rank 1 was in the
gradient all-reduce of train.py:24" needs the line, and only the probe sees it. Sites are
interned: the first time a (code, line) pair is seen it gets an id and one ``site`` metadata
record {id, file, line, func}; events carry the id. A call made by the user's own line is
found with one dict lookup on the caller's (code, instruction); a call from inside a library walks up
the frames to the first user frame (a dict lookup per frame), whose (code, instruction) is then
one more lookup: a line number is computed, and a code object hashed, once per instruction.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

from ddpdoctor.probes import guard
from ddpdoctor.trace import schema

SITE = schema.SITE
NO_SITE = -1
_FRAMEWORKS = (
    "torch",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "torchmetrics",
    "transformers",
)
_MAX_DEPTH = 64

_skip: tuple[str, ...] = ()
# Code objects are keyed by id (hashing one hashes its bytecode and constants: a fraction of a
# microsecond, more than the rest of a lookup) and kept alive in the values or in _codes, so
# that an id is never reused while it is a key.
_sites: dict[tuple[Any, int], int] = {}  # (code, line) -> id
_calls: dict[tuple[int, int], int] = {}  # (id(code), instruction) of a user frame -> its site's id
_codes: list[Any] = []  # the code objects of _calls' keys
_is_user: dict[int, tuple[bool, Any]] = {}  # id(code) -> (is it the user's (a path check, once), code)
_owner: list[Any] = [None]  # the collector the interned ids were declared to


def _prefixes() -> tuple[str, ...]:
    """Directories whose frames are not the user's (computed once, without importing anything)."""
    import torch

    packages = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.join(packages, name) + os.sep for name in _FRAMEWORKS] + [ours + os.sep]
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        dirs.append(os.path.abspath(stdlib) + os.sep)
    return tuple(dirs)


def site(collector: Any, depth: int = 2) -> int:
    """The interned id of the caller's first user frame, or NO_SITE (never raises)."""
    global _fast_site
    try:
        if _fast_site is None:
            from ddpdoctor.probes import fastpath

            fast = fastpath.module()
            _fast_site = fast.site if fast is not None else _no_fast_site
        if _owner[0] is collector:  # a site learnt before, found in C
            sid = _fast_site(depth, _calls, _is_user)
            if sid is not None:
                return sid  # type: ignore[no-any-return]
        return of_frame(collector, sys._getframe(depth))[0]
    except Exception as exc:
        guard.passthrough(exc)
        return NO_SITE


def _no_fast_site(depth: int, calls: dict, is_user: dict) -> None:
    return None


_fast_site: Any = None  # probes/_fast.c's site(depth, _calls, _is_user), or _no_fast_site


def of_frame(collector: Any, frame: Any) -> tuple[int, bool]:
    """(interned id of the first user frame from ``frame`` up, or NO_SITE; whether ``frame``
    is that user frame: then every call from its current instruction has this id, and a caller
    may keep it). Never raises."""
    global _skip
    try:
        if not _skip:
            _skip = _prefixes()
        if _owner[0] is not collector:
            _sites.clear()
            _calls.clear()
            _codes.clear()
            _owner[0] = collector
        call = (id(frame.f_code), frame.f_lasti)
        sid = _calls.get(call)  # a call the user's own code made here before: no walk
        if sid is not None:
            return sid, True
        for hop in range(_MAX_DEPTH):
            if frame is None:
                return NO_SITE, False
            code = frame.f_code
            known = _is_user.get(id(code))
            if known is None:
                name = code.co_filename
                known = _is_user[id(code)] = (not name.startswith(_skip) and not name.startswith("<"), code)
            mine = known[0]
            if mine:
                if hop:  # a library's call: its user frame's instruction may be known already
                    call = (id(code), frame.f_lasti)
                    sid = _calls.get(call)
                    if sid is not None:
                        return sid, False
                key = (code, frame.f_lineno)
                sid = _sites.get(key)
                if sid is None:
                    sid = _sites[key] = len(_sites)
                    collector.meta(
                        SITE, {"id": sid, "file": code.co_filename, "line": key[1], "func": code.co_name}
                    )
                _calls[call] = sid  # a user frame at this instruction is at this site
                _codes.append(code)
                return sid, hop == 0
            frame = frame.f_back
    except Exception as exc:
        guard.passthrough(exc)
        return NO_SITE, False
    return NO_SITE, False
