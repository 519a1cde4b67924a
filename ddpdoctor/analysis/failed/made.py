"""Where what the ranks disagree on was made, read from the user's script: the tensor of a
collective the ranks call from one line with different sizes (the size was set where it got its
value, not at the call: a batch's padded width, a count of the rank's own items), and the data of
a loop one rank ran out of before the others (its shard was built that way). Parsed, never run;
"" where the source cannot say (no file, an expression made in the call, a name never assigned)."""

from __future__ import annotations

import ast
import os

from ddpdoctor.analysis.failed.source import (
    assigned_names,
    holding,
    loop_over,
    names,
    returned_by,
    scope_of,
    set_at,
    statement,
)
from ddpdoctor.analysis.failed.stacks import Frame


def tensor_made(path: str, line: int, op: str) -> str:
    """The assignment above ``line``, in its function, of the name the call of ``op`` there is
    given first, and the one ``return`` of the same-file function that assignment calls: "its
    tensor `prof` is made at train.py:133 (`prof = ink_profile(x)`), which returns
    `batch.mean(dim=(0, 1, 2))` (train.py:108)"."""
    chain = holding(path, line)
    scope = scope_of(path, chain)
    stmts = [n for n in chain if isinstance(n, ast.stmt)]
    if scope is None or not stmts:
        return ""
    calls = [
        c
        for c in ast.walk(stmts[-1])
        if isinstance(c, ast.Call)
        and c.args
        and (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")) == op
    ]
    if len(calls) != 1 or not isinstance(calls[0].args[0], ast.Name):
        return ""
    arg = calls[0].args[0]
    assignment = set_at(scope, arg, line)
    if assignment is None:
        return ""
    file = os.path.basename(path)
    said = f"its tensor `{arg.id}` is made at {file}:{assignment.lineno} (`{statement(assignment)}`)"
    returned = returned_by(path, assignment)
    value = getattr(returned, "value", None)
    if returned is not None and value is not None:
        said += f", which returns `{ast.unparse(value)}` ({file}:{returned.lineno})"
    return said


_MAX_STEPS = 6  # assignments followed back from a loop's iterable: a trail, not a program slice


def loop_data(stack: list[Frame]) -> str:
    """Where the data of the loop a rank is still in (its stack, outermost first) was made: from
    the loop's iterable back through the assignments of its function, down into the one
    same-file function whose result they take, where the lines that build what it returns end
    the trail; "" where the source cannot say. "the loop at train.py:108 (`for x, y in loader:`)
    iterates what train.py:99 (`loader = DataLoader(Utterances(shard))`), train.py:98 (`shard =
    shard_manifest(...)`) made, and shard_manifest() makes it at train.py:77 (`mine =
    items[rank::world]`), train.py:78 (...)"."""
    if not stack:
        return ""
    path, line, func = stack[-1]
    found = loop_over(path, func, line)
    if found is None:
        return ""
    at, header, it, scope = found
    file = os.path.basename(path)
    trail: list[ast.stmt] = []
    inner: tuple[str, list[ast.stmt]] | None = None
    queue = [(name, at) for name in _read(it)]
    while queue and len(trail) < _MAX_STEPS and inner is None:
        name, before = queue.pop(0)
        node = set_at(scope, ast.Name(id=name, ctx=ast.Load()), before)
        if node is None or any(node is n for n in trail):
            continue
        trail.append(node)
        for loop in _filled(scope, name, node.lineno, before):  # `parts = []`, then appended to
            if len(trail) < _MAX_STEPS and not any(loop is n for n in trail):
                trail.append(loop)
                queue[:0] = [(n, loop.lineno) for n in _read(loop.iter)]  # how it is made: first
        returned = returned_by(path, node)
        value = getattr(returned, "value", None)
        function = scope_of(path, holding(path, returned.lineno)) if returned is not None else None
        if value is not None and isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            read = names(value, read_only=True)
            made = [a for a in ast.walk(function) if isinstance(a, ast.stmt) and assigned_names(a) & read]
            inner = (function.name, sorted(made, key=lambda a: a.lineno) or [returned])
        else:
            queue += [(n, node.lineno) for n in _read(getattr(node, "value", None))]
    if not trail:
        return ""
    said = f"the loop at {file}:{at} (`{header}`) iterates what "
    said += ", ".join(f"{file}:{n.lineno} (`{statement(n)}`)" for n in trail) + " made"
    if inner is not None:
        said += f", and {inner[0]}() makes it at " + ", ".join(
            f"{file}:{n.lineno} (`{statement(n)}`)" for n in inner[1]
        )
    return said


def _read(node: ast.AST | None) -> list[str]:
    """The names an expression reads, in the order the line reads them (a loader's dataset before
    its generator): the trail follows the first first."""
    walked = ast.walk(node) if node is not None else ()
    found = [n for n in walked if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return list(dict.fromkeys(n.id for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))))


_FILLS = {"append", "extend", "insert", "update", "add"}


def _filled(scope: ast.AST, name: str, after: int, before: int) -> list[ast.stmt]:
    """The loops of ``scope`` between lines ``after`` and ``before`` whose body fills ``name``
    (``name.append(...)``, ``name[k] = ...``): what it holds is what they iterate."""
    loops = []
    for loop in ast.walk(scope):
        if not isinstance(loop, (ast.For, ast.AsyncFor)) or not after < loop.lineno < before:
            continue
        for n in ast.walk(loop):
            call = isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _FILLS
            target = n.func.value if call else n.targets[0] if isinstance(n, ast.Assign) else None
            if call is False and isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Name) and target.id == name:
                loops.append(loop)
                break
    return loops
