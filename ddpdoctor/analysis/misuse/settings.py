"""Optimizer settings that differ by rank: the learning rate (or momentum, weight decay...) each
rank applied, compared at the fingerprint checks every rank took and wherever a scheduler
stepped (``probes/optsettings.py`` says when a rank notes them). A scheduler stepped with each
rank's own metric (ReduceLROnPlateau on a shard's validation loss), a scheduler stepped on one
rank only, or a learning rate worked out from a rank's own data gives the ranks the same
averaged gradient and different steps: the weights part with no error. ``divergence.py`` names
this as the cause of weights that differ when it came first."""

from __future__ import annotations

import ast
import bisect
import os
from dataclasses import dataclass
from typing import Any

from ddpdoctor.analysis.failed.ledger import recorded_files, sites_of
from ddpdoctor.analysis.failed.source import (
    assigned_targets,
    called,
    fed_by,
    holding,
    parsed,
    scope_of,
    statement,
)
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

# Said first when several settings differ: the ones schedulers and rank-local code change.
ORDER = ("lr", "weight_decay", "momentum", "betas", "eps")
WORDS = {"lr": "learning rate (lr)"}

FIX = (
    "Give every rank the same optimizer settings: step a metric-driven scheduler "
    "(ReduceLROnPlateau) with a value every rank shares (dist.all_reduce the metric first, "
    "op=ReduceOp.AVG), call scheduler.step() on every rank, and work out learning rates and "
    "other settings from values every rank shares, never from the rank's own shard or counters."
)


@dataclass
class SettingDiffers:
    """The first setting that differed by rank where the ranks are compared."""

    optimizer: str  # its class, with its index when the job has several
    group: int
    name: str
    step: int
    equal_step: int | None  # the last check before where every rank's settings were equal
    by_value: list[tuple[Any, list[int]]]  # (value, ranks), most ranks first
    place: str  # file:line of the scheduler step that changed it on some rank, or of ``written``
    written: str = ""  # no scheduler step did: the script's lines that set it, or ""

    def text(self) -> str:
        values = ", ".join(f"{v!r} on rank(s) {rank_list(r)}" for v, r in self.by_value)
        equal = f"; the same on every rank at step {self.equal_step}" if self.equal_step is not None else ""
        what = WORDS.get(self.name, self.name) + (f" of param group {self.group}" if self.group else "")
        where = (
            f" (no scheduler step on record changed it: {self.written})"
            if self.written
            else f", changed by the scheduler step at {self.place}"
            if self.place
            else " (no scheduler step on record changed it: set when the optimizer was built, or "
            "written into its param_groups)"
        )
        return (
            f"the ranks' optimizer settings differ: {self.optimizer}'s {what} was {values} after "
            f"step {self.step}{where}{equal}"
        )


def first_difference(run: Run, up_to: int) -> SettingDiffers | None:
    """The first step, at or before ``up_to``, where the ranks applied different optimizer
    settings; None when every rank applied the same (or none recorded them)."""
    ranks = sorted(run.ranks)
    if len(ranks) < 2:
        return None
    notes = {r: _notes(run.ranks[r]) for r in ranks}
    if not all(notes.values()):
        return None
    # Where a rank's last note says what it applied: the checks every rank took (each noted a
    # change there), and wherever a scheduler stepped (a rank whose scheduler changed nothing
    # then, or that has none, noted no change since its last note).
    steps = set.intersection(*(_checks(run.ranks[r]) for r in ranks))
    steps |= {step for r in ranks for step, _, _, _, by in notes[r] if by == "scheduler"}
    types = {k: t for r in ranks for _, k, t, _, _ in notes[r]}
    series = {(r, key): _series(notes[r], key) for r in ranks for key in types}
    gone: dict[int, int] = {}  # optimizer -> the first step a rank noted it freed
    for r in ranks:
        for step, key, _, _, by in notes[r]:
            if by == "gone":
                gone[key] = min(gone.get(key, step), step)
    equal = None
    for step in sorted(s for s in steps if s <= up_to):
        for key in sorted(k for k in types if step <= gone.get(k, step)):
            now = {r: _at(series[r, key], step) for r in ranks}
            first = now[ranks[0]]
            if first is None or any(v is None for v in now.values()) or all(v == first for v in now.values()):
                continue
            found = _differs(now)
            if found is not None:
                group, name, by_value = found
                label = types[key] + (f" (optimizer #{key})" if len(types) > 1 else "")
                place = _place(run, key, step)
                found = SettingDiffers(label, group, name, step, equal, by_value, place)
                if not place:
                    found.place, found.written = set_in_script(run, types[key], name, equal is None)
                return found
        equal = step
    return None


Note = tuple[int, int, str, list[dict[str, Any]], str]  # step, optimizer, its class, groups, by


def _notes(trace: RankTrace) -> list[Note]:
    """The rank's notes of its settings, in order."""
    out = []
    for _, step, info in trace.meta.get(schema.OPT_SETTINGS, []):
        key, groups = info.get("optimizer"), info.get("groups")
        if isinstance(key, int) and isinstance(groups, list):
            out.append((step, key, str(info.get("type", "optimizer")), groups, str(info.get("by"))))
    return out


def _place(run: Run, key: int, step: int) -> str:
    """Where a scheduler step changed optimizer ``key``'s settings at ``step``, on the lowest rank
    whose scheduler did."""
    for _, trace in sorted(run.ranks.items()):
        for _, at, info in trace.meta.get(schema.OPT_SETTINGS, []):
            if at == step and info.get("optimizer") == key and isinstance(info.get("site"), int):
                return sites_of(trace).get(info["site"], "")
    return ""


def _checks(trace: RankTrace) -> set[int]:
    """The steps of the rank's fingerprint checks after an optimizer step and at exit: a rank
    notes its settings at each one when they changed, so its last note before one is what it
    applied."""
    meta = trace.meta.get(schema.FINGERPRINT, [])
    return {step for _, step, info in meta if info.get("at") in ("step", "exit")}


def _series(notes: list[Note], key: int) -> tuple[list[int], list[list]]:
    """Optimizer ``key``'s notes on a rank: their steps (in order) and settings."""
    mine = sorted(((n[0], i) for i, n in enumerate(notes) if n[1] == key))
    return [step for step, _ in mine], [notes[i][3] for _, i in mine]


def _at(series: tuple[list[int], list[list]], step: int) -> list | None:
    """The settings of the last note at or before ``step``; None before the first."""
    steps, groups = series
    i = bisect.bisect_right(steps, step)
    return groups[i - 1] if i else None


def _differs(now: dict[int, list]) -> tuple[int, str, list[tuple[Any, list[int]]]] | None:
    """(group, setting, ranks by value) of the first setting not equal on every rank; settings a
    rank lacks are not compared."""
    first = next(iter(now.values()))
    if any(len(groups) != len(first) for groups in now.values()):
        return None  # param groups added on some ranks: not a setting
    for g in range(len(first)):
        names = set.intersection(*(set(groups[g]) for groups in now.values()))
        for name in sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
            by: dict[str, tuple[Any, list[int]]] = {}
            for r, groups in sorted(now.items()):
                by.setdefault(repr(groups[g][name]), (groups[g][name], []))[1].append(r)
            if len(by) > 1:
                return g, name, sorted(by.values(), key=lambda vr: (-len(vr[1]), vr[1]))
    return None


def set_in_script(run: Run, optimizer: str, name: str, from_start: bool) -> tuple[str, str]:
    """(file:line, what they are) of the lines of the user's scripts that set optimizer setting
    ``name`` where no scheduler step did: the writes into a param group (`group["lr"] = lr` in a
    loop over ``param_groups``, `opt.param_groups[0]["lr"] *= 0.5`), or, where the ranks
    differed from the first check on (``from_start``) and no such write is there, the keyword
    that gave it to the ``optimizer``'s constructor (`SGD(..., weight_decay=wd / n)`) and what
    changed its value under an ``if`` on the rank. Read from the files the ranks' recorded lines
    are in; ("", "") where none says, or more than ``_SHOWN`` lines do."""
    writes: list[tuple[str, int, str]] = []
    given: list[tuple[str, int, str]] = []
    for path in recorded_files(run):
        tree = parsed(path)
        if tree is None:
            continue
        groups = {  # names that hold a param group: `for g in opt.param_groups:`
            t.id
            for n in ast.walk(tree)
            if isinstance(n, (ast.For, ast.comprehension)) and "param_groups" in ast.unparse(n.iter)
            for t in ast.walk(n.target)
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(tree):
            for t in assigned_targets(n):
                key = getattr(t, "slice", None)
                if not (isinstance(t, ast.Subscript) and isinstance(key, ast.Constant) and key.value == name):
                    continue
                held = isinstance(t.value, ast.Name) and t.value.id in groups
                if held or "param_groups" in ast.unparse(t.value):
                    writes.append((path, n.lineno, statement(n) + _fed(path, n)))
            if isinstance(n, ast.Call) and called(n) == optimizer:
                for k in (k for k in n.keywords if k.arg == name):
                    given.append((path, k.value.lineno, f"{name}={ast.unparse(k.value)}"))
                    given += _set_by_rank(path, k.value)
    found, how = (
        (given, f"given to {optimizer}() at") if from_start and not writes else (writes, "written at")
    )
    if not found or len(found) > _SHOWN:
        return "", ""
    lines = ", ".join(f"{os.path.basename(p)}:{line} (`{code}`)" for p, line, code in found)
    first = found[-1] if "under `if" in found[-1][2] else found[0]  # the rank's own decision first
    return f"{os.path.basename(first[0])}:{first[1]}", f"{how} {lines}"


_SHOWN = 3


def _fed(path: str, write: ast.AST) -> str:
    """What closes a written line's code and names the line that worked its value out, where the
    value is a name its function assigned above it (one level): "`, from f:L `lr = base * n / ref",
    for the caller's closing backtick."""
    if not isinstance(getattr(write, "value", None), ast.Name):
        return ""
    scope = scope_of(path, holding(path, write.lineno))
    made = fed_by(scope, write) if scope is not None else []
    return "".join(f"`, from {os.path.basename(path)}:{m.lineno} `{statement(m)}" for m in made[-1:])


def _set_by_rank(path: str, value: ast.AST) -> list[tuple[str, int, str]]:
    """The first statement above ``value`` in its function that changes a name it reads under an
    ``if`` on the rank (`if rank == 0: cfg.update(sweep.suggest())` for `lr=cfg["lr"]`): where
    one rank's setting was decided apart from the others'."""
    scope = scope_of(path, holding(path, value.lineno))
    read = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
    for node in ast.walk(scope) if scope is not None else ():
        if not isinstance(node, ast.If) or node.lineno >= value.lineno or not _on_rank(node.test):
            continue
        for stmt in (s for s in ast.walk(node) if isinstance(s, (ast.Assign, ast.AugAssign, ast.Expr))):
            changed = {r.id for t in assigned_targets(stmt) for r in ast.walk(t) if isinstance(r, ast.Name)}
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):  # `cfg.update(...)`
                changed |= {n.id for n in [call.func.value] if isinstance(n, ast.Name)}
            if changed & read:
                return [(path, stmt.lineno, f"{statement(stmt)}`, under `if {ast.unparse(node.test)}:")]
    return []


def _on_rank(test: ast.AST) -> bool:
    """A condition on the rank: it reads a name with "rank" in it, or calls ``get_rank()``."""
    return any(
        (isinstance(n, ast.Name) and "rank" in n.id.lower())
        or (isinstance(n, ast.Call) and called(n) == "get_rank")
        for n in ast.walk(test)
    )
