"""Where what the ranks disagree on was made, read from the user's script: the tensor of a
collective the ranks call from one line with different sizes (the size was set where it got its
value, not at the call: a batch's padded width, a count of the rank's own items), and the data of
a loop one rank ran out of before the others (its shard was built that way), and the inputs of
a forward that are larger on one rank. Parsed, never run; "" where the source cannot say (no
file, an expression made in the call, a name never assigned)."""

from __future__ import annotations

import ast
import os

from ddpdoctor.analysis.failed.source import (
    assigned_names,
    called,
    holding,
    loop_over,
    names,
    returned_by,
    scope_of,
    set_at,
    statement,
)
from ddpdoctor.analysis.failed.stacks import Frame


def _made_at(path: str, line: int, op: str) -> tuple[ast.Name, ast.stmt] | None:
    """(the name the call of ``op`` at ``line`` is given first, its assignment above the line in
    the same function), or None."""
    chain = holding(path, line)
    scope = scope_of(path, chain)
    stmts = [n for n in chain if isinstance(n, ast.stmt)]
    if scope is None or not stmts:
        return None
    calls = [c for c in ast.walk(stmts[-1]) if isinstance(c, ast.Call) and c.args and called(c) == op]
    if len(calls) != 1 or not isinstance(calls[0].args[0], ast.Name):
        return None
    arg = calls[0].args[0]
    assignment = set_at(scope, arg, line)
    return (arg, assignment) if assignment is not None else None


# Calls whose result's length is set by the values in the data, not by the code: the same line
# gives each rank a tensor of another size. What fixes the size, for the fix.
DATA_SIZED = {
    "bincount": "`bincount` returns as many counts as the largest value it saw plus one: pass "
    "minlength=<the number of classes> so that every rank counts every class",
    "unique": "`unique` returns the values each rank happens to hold: count over a fixed range "
    "instead (bincount with minlength=<the number of values>)",
    "nonzero": "`nonzero` returns as many indices as the rank's data has: reduce a fixed-size "
    "mask or count instead, or pad to one length",
    "masked_select": "`masked_select` returns as many values as the rank's mask selects: reduce a "
    "fixed-size sum and count instead, or pad to one length",
}


def sized_by_data(path: str, line: int, op: str) -> str:
    """What fixes the size of the tensor given to ``op`` at ``line``, where its assignment calls
    one of ``DATA_SIZED`` without fixing the size (``minlength``); "" otherwise."""
    found = _made_at(path, line, op)
    if found is None:
        return ""
    for call in ast.walk(found[1]):
        if not isinstance(call, ast.Call):
            continue
        name = called(call)
        if name in DATA_SIZED and not any(k.arg == "minlength" for k in call.keywords):
            return f"{DATA_SIZED[name]} ({os.path.basename(path)}:{found[1].lineno})."
    return ""


def tensor_made(path: str, line: int, op: str) -> str:
    """The assignment above ``line``, in its function, of the name the call of ``op`` there is
    given first, and the one ``return`` of the same-file function that assignment calls: "its
    tensor `prof` is made at train.py:133 (`prof = ink_profile(x)`), which returns
    `batch.mean(dim=(0, 1, 2))` (train.py:108)"."""
    found = _made_at(path, line, op)
    if found is None:
        return ""
    arg, assignment = found
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
            trail += _split_by_rank(scope, node, trail + inner[1])
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


def rank_split_feeding(path: str, line: int) -> str:
    """Where each rank's own part of what the statement at ``path:line`` reads was cut: its
    names followed back through the assignments of its function (and the loop headers that set
    them), a few steps, to the first line that reads the rank. "train.py:104 (`my_sessions =
    sessions[rank * n:(rank + 1) * n]`)" for a forward whose inputs are larger on one rank;
    "" where no such line is in reach (a DistributedSampler reads the rank in torch)."""
    chain = holding(path, line)
    stmts = [n for n in chain if isinstance(n, ast.stmt)]
    scope = scope_of(path, chain)
    if not stmts or scope is None:
        return ""
    ranks = _rank_names(scope)
    loops = [n for n in chain if isinstance(n, (ast.For, ast.AsyncFor))]
    queue, seen = [(name, line) for name in _passed(stmts[-1])], set()
    while queue and len(seen) < _MAX_STEPS * 2:
        name, before = queue.pop(0)
        node = set_at(scope, ast.Name(id=name, ctx=ast.Load()), before)
        if node is None:  # a loop's target: what the loop iterates
            held = [lp for lp in reversed(loops) if name in names(lp.target) and lp.lineno <= before]
            node = held[0] if held else None
            value = getattr(node, "iter", None)
        else:
            value = getattr(node, "value", None)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if value is not None and _reads_rank(value, ranks):
            return f"{os.path.basename(path)}:{node.lineno} (`{statement(node)}`)"
        queue += [(n, node.lineno) for n in _passed(value)]
    return ""


def _passed(node: ast.AST | None) -> list[str]:
    """``_read`` without what is called: the data a line hands on, not the model or the
    function it calls (`model(x)` reads `x`; `model` was made by other lines)."""
    callees = set()
    for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)) if node is not None else ():
        root = call.func
        while isinstance(root, ast.Attribute):  # `nn.functional.cross_entropy`: nn
            root = root.value
        if isinstance(root, ast.Name):
            callees.add(root.id)
    return [n for n in _read(node) if n not in callees]


def _split_by_rank(scope: ast.AST, via: ast.stmt, trail: list[ast.stmt]) -> list[ast.stmt]:
    """Where no line of the trail reads the rank: the assignment of an argument ``via`` hands the
    function it calls that does (`my_days = day_files[rank::world]`, then `load_days(my_days)`):
    the line that gives each rank its own part, where the parts' sizes come from."""
    ranks = _rank_names(scope)
    if any(_reads_rank(n, ranks) for n in trail):
        return []
    calls = [c for c in ast.walk(via) if isinstance(c, ast.Call)]
    args = [a for c in calls for a in [*c.args, *(k.value for k in c.keywords)]]
    found: list[ast.stmt] = []
    for name in _read(ast.Tuple(elts=args, ctx=ast.Load())):
        node = set_at(scope, ast.Name(id=name, ctx=ast.Load()), via.lineno)
        if node is not None and _reads_rank(node, ranks) and not any(node is n for n in trail + found):
            found.append(node)
    return found


_RANKS = {"rank", "global_rank"}  # a rank by its usual name, as a parameter or a global


def _rank_names(scope: ast.AST) -> set[str]:
    """The names ``scope`` gives the rank: assigned from a ``get_rank()`` call (a tuple's own
    element where several are assigned at once), and the usual names."""
    out = set(_RANKS)
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        paired = isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
        pairs = zip(target.elts, value.elts, strict=False) if paired else [(target, value)]
        for t, v in pairs:
            if isinstance(t, ast.Name) and _calls(v, "get_rank"):
                out.add(t.id)
    return out


def _calls(node: ast.AST, name: str) -> bool:
    return any(isinstance(c, ast.Call) and called(c) == name for c in ast.walk(node))


def _reads_rank(stmt: ast.AST, ranks: set[str]) -> bool:
    return bool(set(_read(stmt)) & ranks) or _calls(stmt, "get_rank")


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
