"""Calls issued in an order that differs by rank: the ranks disagree at one sequence number,
each in a call of the same line, and each rank's call there is one that line makes every time.

A job's own collectives come in rounds (runs of calls with none of DDP's between them: an
epoch's report, an evaluation). When the round that broke holds, on every rank, only calls the
line made in its last round before, in the same numbers or fewer, the calls are the same and
their order is not: a loop went through its items in an order each rank worked out for itself
(sorted by its own loss, a dict in the order its keys first appeared in its own data). The
stacks say which loop, and its source what it iterates, where that was set and what fed it.
Otherwise (a size the line never issued, a first round with none before it, a line with one
kind of call) the facts do not say it is an order, and nothing is said here.

The calls may also be of different lines reached from one line of a loop (``for m in
meters.values(): m.sync()``, each item's own method): then every rank's stack holds that line,
below it each rank is in a different function, and the round before made the same calls. A
rank that skipped a call (a ``return`` in the middle of one function) is not that: below the
shared line it is in the same function as the others.
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from typing import Any

from ddpdoctor.analysis.failed.points import Ledger, Point, is_ddp
from ddpdoctor.analysis.failed.source import (
    argument,
    fed_by,
    function_at,
    loop_over,
    returned_by,
    set_at,
    statement,
)
from ddpdoctor.analysis.failed.stacks import Frame
from ddpdoctor.analysis.findings import Finding, rank_list

FIX_ORDER = (
    "Give that loop the same order on every rank: sort by something every rank holds alike (a "
    "name, a fixed index), compute the sort key from values all-reduced first, or broadcast rank "
    "0's order; a dict filled from each rank's own data iterates in each rank's insertion order, "
    "so iterate it as sorted(d)."
)

Key = tuple[str, str, int, str]  # (op, dtype, elements, line): what makes two calls pair up


def _key(point: Point) -> Key | None:
    return (point.op, point.dtype, point.numel, point.site) if point.numel > 0 and point.dtype else None


def _rounds(ledger: Ledger, seq: int, sites: set[str]) -> tuple[list[Key | None], list[Key | None]] | None:
    """(these lines' calls in the rank's round holding ``seq``, up to it; those of the last
    earlier round that called them at all), in order; None without such a round on record."""
    by_seq = {p.seq: p for p in ledger.points if p.group == "WORLD" and p.seq >= 0}
    start = seq
    while start - 1 in by_seq and not is_ddp(by_seq[start - 1]):
        start -= 1
    now = [_key(by_seq[k]) for k in range(start, seq + 1) if k in by_seq and by_seq[k].site in sites]
    k = start - 1
    while k in by_seq:
        while k in by_seq and is_ddp(by_seq[k]):
            k -= 1
        calls: list[Key | None] = []
        while k in by_seq and not is_ddp(by_seq[k]):
            if by_seq[k].site in sites:
                calls.insert(0, _key(by_seq[k]))
            k -= 1
        if calls:
            return now, calls
    return None


def order_differs(
    points: dict[int, Point], ledgers: dict[int, Ledger], seq: int, details: dict[str, Any], said: bool
) -> Finding | None:
    """The collective mismatch at ``seq`` as calls of one line in an order that differs by rank,
    when the facts for it hold (see the module's docstring); None otherwise. A rank killed inside
    the call left no size for it (the record is written as the call returns): its other calls
    of the round still count, and the backend ``said`` the ranks' calls did not match."""
    sites = {p.site for p in points.values()}
    keys = {r: _key(p) for r, p in points.items()}
    known = {k for k in keys.values() if k is not None}
    if not all(sites) or not known:
        return None
    if len(known) < 2 and not (None in keys.values() and said):
        return None
    shared = _shared_loop(ledgers, points) if len(sites) > 1 else None
    if len(sites) > 1 and shared is None:
        return None
    rounds = {r: _rounds(ledgers[r], seq, sites) for r in points}
    last = next(iter(rounds.values()))
    if last is None or None in last[1] or len(set(last[1])) < 2:
        return None
    before = last[1]
    moved = len(known) > 1  # the ranks' calls differ here, or a rank's order moved since
    for now, then in (rounds[r] or ([], []) for r in points):
        if then != before or any(n > before.count(k) for k, n in Counter(now).items() if k is not None):
            return None  # another round before, or a call the line did not make then, or more
        moved |= any(k is not None and k != was for k, was in zip(now, before, strict=False))
    if not moved:
        return None
    loop = shared or _the_loop(ledgers, points, next(iter(sites)))
    if loop is None:
        return None
    step = max(p.step for p in points.values())
    many = len(sites) > 1
    calls = "; ".join(f"rank {r}: {_call(keys[r], many)}" for r in sorted(points))
    usual = _calls(before, many)
    loop_text = f"the loop at {loop['loop']} (`{loop['header']}` in {loop['func']}())"
    if loop.get("place") == loop["loop"]:
        origin = f"The order is worked out in the header of {loop_text}"
    elif loop.get("place"):
        fed = f", from {loop['from']}" if loop.get("from") else ""
        origin = f"The order is set at {loop['place']} (`{loop['set']}`){fed}, and {loop_text} follows it"
    else:
        origin = f"T{loop_text[1:]} goes through its items in an order of each rank's own"
    whose = f"the calls made from {loop['loop']}" if many else f"{next(iter(sites))}'s calls"
    maker = "that loop makes" if many else "that line makes"
    summary = (
        f"the ranks made {whose} in a different order: at collective #{seq} (step {step}) "
        f"{calls}; {maker} the same calls every round (the round before, on every rank: "
        f"{usual}), so the calls match and their order does not. {origin}"
    )
    evidence = {"root_rank": None, "differs": "order", "place": loop.get("place") or loop["loop"]}
    return Finding(
        "collective_mismatch",
        "error",
        sorted(points),
        summary,
        fix=FIX_ORDER,
        details={**details, **evidence, "loop": loop["loop"], "round_before": usual},
    )


def _calls(keys: list[Key], lines: bool = False) -> str:
    """A round's calls: "all_reduce of 5, 2 and 2 float64 elements", or each in full (with its
    line, where they are of several)."""
    if lines or len({k[:2] for k in keys}) > 1:
        return ", ".join(_call(k, lines) for k in keys)
    op, dtype, *_ = keys[0]
    sizes = [str(k[2]) for k in keys]
    return f"{op} of {', '.join(sizes[:-1])} and {sizes[-1]} {dtype.removeprefix('torch.')} elements"


def _call(key: Key | None, line: bool = False) -> str:
    if key is None:
        return "a call whose size is not on record (it died inside it)"
    op, dtype, numel, site = key
    at = f" at {site}" if line else ""
    return f"{op} of {numel} {dtype.removeprefix('torch.')} element{'s' if numel != 1 else ''}{at}"


def _shared_loop(ledgers: dict[int, Ledger], points: dict[int, Point]) -> dict[str, str] | None:
    """The loop of the line every rank's stack passed through before each went into a function
    of its own (a different one on each rank: each item's own method), when each stack ends at
    that rank's call; None otherwise (a rank in the same function as the others, at another
    line of it, skipped a call rather than reordered one)."""
    stacks = []
    for r, p in sorted(points.items()):
        stack = ledgers[r].stack
        if not stack or f"{os.path.basename(stack[-1][0])}:{stack[-1][1]}" != p.site:
            return None
        stacks.append(stack)
    common = 0
    while all(len(s) > common + 1 and s[common] == stacks[0][common] for s in stacks):
        common += 1
    lines: dict[tuple[str, str], set[int]] = {}
    for s in stacks:
        path, line, func = s[common]
        lines.setdefault((path, func), set()).add(line)
    if common == 0 or len(lines) < 2 or any(len(at) > 1 for at in lines.values()):
        return None
    return _loop_in(stacks[0][:common])


def _the_loop(ledgers: dict[int, Ledger], points: dict[int, Point], site: str) -> dict[str, str] | None:
    """The loop the ranks' stacks were in when they made the call, the same on every rank whose
    stack ends at the call's line; None without one."""
    found = []
    for r in sorted(points):
        stack = ledgers[r].stack
        if stack and f"{os.path.basename(stack[-1][0])}:{stack[-1][1]}" == site:
            found.append(_loop_in(stack))
    if not found or any(f != found[0] for f in found):
        return None
    return found[0]


def _loop_in(stack: list[Frame]) -> dict[str, str] | None:
    """The innermost loop of a stack (outermost first), and where what it iterates was set: in
    its function, or in its caller when it iterates a parameter; and what fed that (the names
    its value reads, the function of the same file it calls)."""
    for i in range(len(stack) - 1, -1, -1):
        path, line, func = stack[i]
        found = loop_over(path, func, line)
        if found is None:
            continue
        at, header, it, scope = found
        name = os.path.basename(path)
        out = {"loop": f"{name}:{at}", "header": header, "func": func.rsplit(".", 1)[-1]}
        node = set_at(scope, it, at)
        if node is None and isinstance(it, ast.Name) and i > 0:  # a parameter: what its caller passed
            cpath, cline, cfunc = stack[i - 1]
            passed = argument(cpath, cline, scope, it.id)
            caller = function_at(cpath, cfunc, cline) if passed is not None else None
            if caller is None or passed is None:
                return out
            path, name, scope = cpath, os.path.basename(cpath), caller
            node = set_at(caller, passed, cline)
            if node is None and isinstance(passed, ast.Call):
                out.update(place=f"{name}:{cline}", set=ast.unparse(passed))
        elif node is None and isinstance(it, ast.Call) and isinstance(it.func, ast.Name):
            out.update(place=out["loop"], set=header)  # sorted(...): worked out in the loop's header
        if node is not None:
            out.update(place=f"{name}:{node.lineno}", set=statement(node))
            fed = [n for n in (returned_by(path, node), *fed_by(scope, node)) if n is not None]
            if fed:
                out["from"] = ", ".join(f"{name}:{n.lineno} (`{statement(n)}`)" for n in fed)
        return out
    return None


FIX_REPEATED = (
    "Make every rank call the collective the same number of times: loop over a fixed list of names "
    "(the same on every rank, in one order), and all-reduce a value for each on every rank, zeros "
    "where a rank has none; or stack the values into one tensor and reduce it once."
)


def repeated(points: dict[int, Point], ledgers: dict[int, Ledger], call: Point) -> str:
    """Where ranks part inside a run of one call (a loop of all_reduces over a dict of metrics):
    ": the ranks made the all_reduce at :99 a different number of times in a row (...)", with
    the loop it sits in on a rank still in it; "" where the counts agree. Which count is right,
    one round cannot say (went_past_rounds does, from earlier rounds)."""
    key = (call.op, call.site)
    counts: dict[int, int] = {}
    for r in points:
        pts = ledgers[r].points
        tail = pts if pts and (pts[-1].op, pts[-1].site) == key else pts[:-1]  # not the call it is in
        n = 0
        for q in reversed(tail):
            if (q.op, q.site) != key:
                break
            n += 1
        counts[r] = n
    if len(set(counts.values())) < 2:
        return ""
    said = ", ".join(
        f"{n} time(s) on rank(s) {rank_list([r for r in counts if counts[r] == n])}"
        for n in sorted(set(counts.values()), reverse=True)
    )
    text = f": the ranks made the {call.op} at {call.site} a different number of times in a row ({said})"
    inside = [r for r, p in points.items() if (p.op, p.site) == key and ledgers[r].stack]
    found = _loop_in(ledgers[inside[0]].stack) if inside else None
    if found is not None:
        over = (
            f", over `{found['set']}` ({found['place']})" if found.get("place") and found.get("set") else ""
        )
        text += (
            f", in the loop at {found['loop']} (`{found['header']}`){over}: what that loop goes over "
            "differs by rank (a dict or list of each rank's own: a key only some ranks have)"
        )
    return text
