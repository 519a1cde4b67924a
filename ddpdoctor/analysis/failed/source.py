"""What the user's own code says around a line the ledger names: the branch (an ``if`` or an
``except``) that leaves a loop's iteration after a forward (where a rank skipped its backward),
the lines that decide whether a forward runs under ``no_sync()`` (a gradient accumulation
schedule), the loop a waiting rank is still inside, the ``if`` one rank took and another went
past, and where a name got its value. (A model's ``forward`` that leaves a submodule out:
``misuse/leftout.py``.)

The trace says which forward ran without its gradient all-reduce; it cannot say which lines the
rank then executed. The script itself can: read (when it is still on disk) and parsed, never
run. Every answer is empty (None, or no lines) when the file is gone or the code has no such
shape.
"""

from __future__ import annotations

import ast
import os
from functools import lru_cache

_EXITS = (ast.Continue, ast.Break, ast.Return, ast.Raise)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)


@lru_cache(maxsize=16)
def parsed(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def holding(path: str, line: int) -> list[ast.AST]:
    """The nodes that hold ``line``, outermost first."""
    tree = parsed(path) if os.path.isfile(path) else None
    if tree is None:
        return []
    chain: list[ast.AST] = []
    node: ast.AST = tree
    while True:
        inner = next(
            (
                child
                for child in ast.iter_child_nodes(node)
                if getattr(child, "lineno", None) is not None
                and child.lineno <= line <= (child.end_lineno or child.lineno)  # type: ignore[attr-defined]
            ),
            None,
        )
        if inner is None:
            return chain
        chain.append(inner)
        node = inner


def _walk_here(node: ast.AST) -> list[ast.AST]:
    """Nodes under ``node`` in the same loop iteration: not inside a nested loop or function."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (*_SCOPES, *_LOOPS)):
            continue
        out.append(child)
        out += _walk_here(child)
    return out


def exits_after(path: str, line: int) -> list[int]:
    """The ``if`` or ``except`` after ``line`` in the innermost loop holding it that can leave
    the iteration (continue, break, return, raise), and the line that leaves: [its line, the
    exit's line], or []. An ``except`` counts: a step skipped because its loss raised is a
    branch the rank took alone."""
    loops = [n for n in holding(path, line) if isinstance(n, _LOOPS)]
    if not loops:
        return []
    for stmt in _walk_here(loops[-1]):
        if not isinstance(stmt, (ast.If, ast.ExceptHandler)) or stmt.lineno <= line:
            continue
        exits = [n for n in _walk_here(stmt) if isinstance(n, _EXITS)]
        if exits:
            return [stmt.lineno, exits[0].lineno]
    return []


def names(node: ast.AST | None, read_only: bool = False) -> set[str]:
    """The plain names in ``node`` (``read_only``: those it reads, not those it binds)."""
    if node is None:
        return set()
    return {
        n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and (not read_only or isinstance(n.ctx, ast.Load))
    }


def rank_of(test: ast.AST) -> int | None:
    """The one rank an ``if`` test holds for: `rank == 0`, `dist.get_rank() == 1`, or such a
    comparison among the terms of an ``and`` (`rank == 0 and step % 10 == 0`); None otherwise
    (an ``or``, a ``not``, a name that may hold anything)."""
    terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    for t in terms:
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
            continue
        sides = [t.left, t.comparators[0]]
        ranks = [
            s
            for s in sides
            if (isinstance(s, ast.Name) and s.id in ("rank", "global_rank"))
            or (isinstance(s, ast.Call) and called(s) == "get_rank")
        ]
        values = [s.value for s in sides if isinstance(s, ast.Constant) and type(s.value) is int]
        if ranks and values:
            return values[0]
    return None


def assigned_targets(stmt: ast.AST) -> list[ast.AST]:
    """The targets a plain assignment statement (``=``, ``+=``, annotated) writes; none for others."""
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    return [stmt.target] if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) else []


def assigned_names(stmt: ast.AST) -> set[str]:
    """The names a plain assignment statement (``=``, ``+=``, annotated) sets; none for others."""
    if isinstance(stmt, ast.Assign):
        return set().union(*(names(t) for t in stmt.targets))
    if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
        return names(stmt.target)
    return set()


def _assigned(function: ast.AST, name: str, before: int) -> ast.AST | None:
    """The last plain assignment of ``name`` in the function above line ``before``."""
    found = None
    for node in ast.walk(function):
        if getattr(node, "lineno", before) >= before or name not in assigned_names(node):
            continue
        if found is None or node.lineno > found.lineno:
            found = node
    return found


def no_sync_schedule(path: str, line: int, depth: int = 3) -> list[int]:
    """The lines that decide whether the forward at ``line`` runs under ``no_sync()``: the
    ``with`` that enters it, then where the names of its condition are assigned (and theirs,
    ``depth`` levels up), in the order they are read back from the ``with``; [] when the forward
    is under no ``no_sync()``."""
    chain = holding(path, line)
    functions = [n for n in chain if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not functions:
        return []
    # the with's context, or what the name it enters was last assigned (`ctx = ... no_sync()`)
    contexts = []
    for n in chain:
        if isinstance(n, (ast.With, ast.AsyncWith)):
            expr = n.items[0].context_expr
            made = _assigned(functions[-1], expr.id, n.lineno) if isinstance(expr, ast.Name) else None
            contexts.append((n, made, getattr(made, "value", None) if made is not None else expr))
    withs = [c for c in contexts if _enters_no_sync(c[2])]
    if not withs:
        return []
    with_node, made, expr = withs[-1]
    if isinstance(expr, ast.IfExp):
        condition: ast.AST | None = expr.test
    else:  # `if <not boundary>: with model.no_sync(): ...`
        ifs = [n for n in chain if isinstance(n, ast.If) and n.lineno < with_node.lineno]
        condition = ifs[-1].test if ifs else None
    lines = [with_node.lineno] + ([made.lineno] if made is not None else [])
    frontier = names(condition)
    seen: set[str] = set()
    for _ in range(depth):
        nxt: set[str] = set()
        for name in sorted(frontier - seen):
            seen.add(name)
            node = _assigned(functions[-1], name, with_node.lineno)
            if node is None or node.lineno in lines:
                continue
            lines.append(node.lineno)
            nxt |= names(getattr(node, "value", None))
            returned = returned_by(path, node)  # a boundary test of its own: the line that decides
            if returned is not None and returned.lineno not in lines:
                lines.append(returned.lineno)
        frontier = nxt
    return lines


def _enters_no_sync(expr: ast.AST | None) -> bool:
    found = ast.walk(expr) if expr is not None else ()
    return any(isinstance(a, ast.Attribute) and a.attr == "no_sync" for a in found)


def branch_passed(path: str, func: str, line: int, other: int) -> tuple[int, str] | None:
    """(the line, the test) of the innermost ``if`` holding ``line`` that ends before ``other``,
    both lines in one function: a rank at ``other`` went past that ``if`` without the call a
    rank at ``line`` made inside it. ``func`` is the function as the run's stack named it
    (py-spy: ``Class.method``): a file whose function there has another name was edited since,
    and gives no answer; so does a missing file or an ``if`` holding both lines."""
    mine, theirs = holding(path, line), holding(path, other)
    scope, where = scope_of(path, mine), scope_of(path, theirs)
    if scope is None or where is not scope or not _named(scope, func):
        return None
    inner = mine[mine.index(scope) + 1 :] if scope in mine else mine
    ifs = [n for n in inner if isinstance(n, ast.If) and (n.end_lineno or n.lineno) < other]
    return (ifs[-1].lineno, f"if {ast.unparse(ifs[-1].test)}:") if ifs else None


def went_past(path: str, func: str, line: int, other: int) -> bool:
    """A rank at ``other`` went past ``line``, both lines in one function: the outermost statement
    there that holds ``line`` and not ``other`` ends before ``other`` (a loop that rank left)."""
    mine = holding(path, line)
    scope = scope_of(path, mine)
    if scope is None or scope_of(path, holding(path, other)) is not scope or not _named(scope, func):
        return False
    inner = mine[mine.index(scope) + 1 :] if scope in mine else mine
    apart = [
        n for n in inner if isinstance(n, ast.stmt) and not n.lineno <= other <= (n.end_lineno or n.lineno)
    ]
    return bool(apart) and (apart[0].end_lineno or apart[0].lineno) < other


def if_holding(path: str, func: str, line: int) -> tuple[int, str] | None:
    """(the line, the test) of the innermost ``if`` of ``func`` (as the run's stack names it) whose
    branches hold ``line``; None without one, or for a missing or edited file."""
    chain = holding(path, line)
    scope = scope_of(path, chain)
    if scope is None or not _named(scope, func):
        return None
    inner = chain[chain.index(scope) + 1 :] if scope in chain else chain
    ifs = [n for n in inner if isinstance(n, ast.If) and n.lineno < line]
    return (ifs[-1].lineno, f"if {ast.unparse(ifs[-1].test)}:") if ifs else None


def _named(scope: ast.AST, func: str) -> bool:
    """``scope`` is the function the stack calls ``func`` (py-spy: ``Class.method``)."""
    name = "<module>" if isinstance(scope, ast.Module) else getattr(scope, "name", None)
    return func.rsplit(".", 1)[-1] == name


def loop_left(path: str, func: str, line: int, other: int | None) -> tuple[int, str] | None:
    """(the line, "`break` at train.py:98, under `if <test>:` (train.py:97)") of the way out of
    the loop that holds ``line``
    but not ``other``, both lines in one function (``other`` None: a rank that has left the
    function, and so its every loop): a rank at ``other`` left the loop the ranks at ``line``
    still run. The one ``break`` of that loop's own iteration (or, for a rank that left the
    function, the one ``return`` of its loops' iterations), or a ``while`` loop's condition;
    None for a ``for`` loop without one (it ended when its items did), several ways out (which
    one, the trace cannot say), a missing or edited file."""
    mine = holding(path, line)
    scope = scope_of(path, mine)
    if scope is None or (other is not None and scope_of(path, holding(path, other)) is not scope):
        return None
    if not _named(scope, func):
        return None
    inner = mine[mine.index(scope) + 1 :] if scope in mine else mine
    holds_other = [n for n in inner if other is not None and n.lineno <= other <= (n.end_lineno or 0)]
    left = [n for n in inner if isinstance(n, _LOOPS) and n not in holds_other]
    if not left:
        return None
    loop = left[0]
    breaks = [n for n in _walk_here(loop) if isinstance(n, ast.Break)]
    # A rank that left the function may have left by a ``return`` from any of its loops.
    returns = [n for lp in left for n in _walk_here(lp) if isinstance(n, ast.Return)] if other is None else []
    if len(breaks) == 1 and not returns or len(returns) == 1 and not breaks:
        out = (breaks or returns)[0]
        ifs = [n for n in holding(path, out.lineno) if isinstance(n, ast.If) and n.lineno > loop.lineno]
        file = os.path.basename(path)
        under = f", under `if {ast.unparse(ifs[-1].test)}:` ({file}:{ifs[-1].lineno})" if ifs else ""
        return out.lineno, f"`{'break' if breaks else 'return'}` at {file}:{out.lineno}{under}"
    if not breaks and not returns and isinstance(loop, ast.While):
        return (
            loop.lineno,
            f"`while {ast.unparse(loop.test)}:` ending ({os.path.basename(path)}:{loop.lineno})",
        )
    return None


def in_their_loop(path: str, line: int, other: int) -> bool | None:
    """Whether ``line`` lies in the innermost loop holding ``other``, both in one function: a
    rank at ``line`` has not left the loop the ranks at ``other`` still run. None without the
    file, a loop, or one function holding both."""
    theirs = holding(path, other)
    scope = scope_of(path, theirs)
    if scope is None or scope_of(path, holding(path, line)) is not scope:
        return None
    inner = theirs[theirs.index(scope) + 1 :] if scope in theirs else theirs
    loops = [n for n in inner if isinstance(n, _LOOPS)]
    if not loops:
        return None
    return loops[-1].lineno <= line <= (loops[-1].end_lineno or loops[-1].lineno)


def scope_of(path: str, chain: list[ast.AST]) -> ast.AST | None:
    """The innermost function in ``chain``, else the module; None without the file."""
    functions = [n for n in chain if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return functions[-1] if functions else (parsed(path) if chain else None)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def loop_over(path: str, func: str, line: int) -> tuple[int, str, ast.AST, ast.AST] | None:
    """(its line, its header, what it iterates, the function) of the innermost ``for`` loop or
    comprehension that holds ``line`` in the function the stack names ``func``; None without
    one, or for a missing or edited file."""
    chain = holding(path, line)
    scope = function_at(path, func, line)
    if scope is None:
        return None
    inner = chain[chain.index(scope) + 1 :] if scope in chain else chain
    for node in reversed(inner):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return (
                node.lineno,
                f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}:",
                node.iter,
                scope,
            )
        if isinstance(node, _COMPREHENSIONS):
            it = node.generators[0]
            return node.lineno, f"for {ast.unparse(it.target)} in {ast.unparse(it.iter)}", it.iter, scope
        if isinstance(node, _SCOPES):
            return None
    return None


def set_at(scope: ast.AST, expr: ast.AST, before: int) -> ast.AST | None:
    """The assignment where ``expr``, a name read at line ``before``, was last assigned in
    ``scope`` above it; None for anything else (an expression computes its value where it is
    read), or a name the function does not assign (a parameter, a global)."""
    return _assigned(scope, expr.id, before) if isinstance(expr, ast.Name) else None


def fed_by(scope: ast.AST, assignment: ast.AST) -> list[ast.AST]:
    """The assignments in ``scope`` above ``assignment`` of the names its value reads (one
    level: `order = [worst] + rest` is fed by `worst = max(...)`), in line order."""
    value = getattr(assignment, "value", None)
    if value is None:
        return []
    found = [_assigned(scope, name, assignment.lineno) for name in sorted(names(value, read_only=True))]
    return sorted((n for n in found if n is not None), key=lambda n: n.lineno)


def returned_by(path: str, assignment: ast.AST) -> ast.AST | None:
    """Where an assignment's value is a call of a function of the same file (`f(...)`,
    `self.f(...)`) with one ``return``: that return."""
    value = getattr(assignment, "value", None)
    tree = parsed(path) if os.path.isfile(path) else None
    if not isinstance(value, ast.Call) or tree is None:
        return None
    name = called(value)
    defs = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    ]
    returns = [r for r in _walk_here(defs[0]) if isinstance(r, ast.Return)] if len(defs) == 1 else []
    return returns[0] if len(returns) == 1 and returns[0].value is not None else None


def statement(node: ast.AST) -> str:
    """A statement's first line, as code (without its comments)."""
    return ast.unparse(node).splitlines()[0]


def argument(path: str, line: int, callee: ast.AST, name: str) -> ast.AST | None:
    """The expression a call at ``line`` passes ``callee`` (a function) for its parameter
    ``name``; None where no call of it there says (a ``*args``, a call of another name)."""
    if not isinstance(callee, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    params = [a.arg for a in (*callee.args.posonlyargs, *callee.args.args)]
    if name not in params:
        return None
    method = params[0] in ("self", "cls")
    for node in [n for n in holding(path, line) if isinstance(n, ast.stmt)][-1:]:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if called(call) != callee.name:
                continue
            for kw in call.keywords:
                if kw.arg == name:
                    return kw.value
            index = params.index(name) - (1 if method and isinstance(call.func, ast.Attribute) else 0)
            starred = any(isinstance(a, ast.Starred) for a in call.args[: index + 1])
            if 0 <= index < len(call.args) and not starred:
                return call.args[index]
    return None


def function_at(path: str, func: str, line: int) -> ast.AST | None:
    """The function (or the module) holding ``line`` that the stack names ``func``; None for a
    missing or edited file."""
    scope = scope_of(path, holding(path, line))
    return scope if scope is not None and _named(scope, func) else None


def called(call: ast.Call) -> str:
    """The name a call calls: ``f`` of `f(...)` and of `obj.f(...)`; "" otherwise."""
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
