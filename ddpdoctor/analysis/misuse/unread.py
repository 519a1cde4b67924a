"""Where a submodule's output is left out of the loss, read from the user's script: the forward
hands it back under a dict key, or at a place in a tuple, and the script reads that key only
under an ``if`` (or never), or drops that element where it calls the model. Its parameters
then get no gradient although the forward ran it (``unused.py`` asks, once the gradients have
said so). Parsed, never run; None where the source cannot say."""

from __future__ import annotations

import ast
import os
from typing import Any

from ddpdoctor.analysis.failed.source import holding, names, parsed, statement
from ddpdoctor.analysis.misuse.leftout import class_of, self_uses


def output_of(path: str, cls: str, attr: str) -> tuple[str | int, int] | None:
    """(the key of the returned dict, or the index in the returned tuple, that holds the result
    of ``self.<attr>`` in ``cls.forward``; the return's line), or None where no one return
    position holds it (directly or through names computed from it)."""
    forward = class_of(path, cls)[1]
    if forward is None:
        return None
    used = {id(n) for n in self_uses(forward, attr)}
    assigns = [st for st in ast.walk(forward) if isinstance(st, ast.Assign)]
    via: set[str] = set()  # names that hold its result, or one computed from it

    def holds(expr: ast.AST) -> bool:
        return any(id(n) in used or (isinstance(n, ast.Name) and n.id in via) for n in ast.walk(expr))

    while True:
        more = {t.id for st in assigns if holds(st.value) for t in st.targets if isinstance(t, ast.Name)}
        if more <= via:
            break
        via |= more

    found: list[tuple[str | int, int]] = []
    for ret in (n for n in ast.walk(forward) if isinstance(n, ast.Return) and n.value is not None):
        value = ret.value
        if isinstance(value, ast.Dict):
            found += [
                (k.value, ret.lineno)
                for k, v in zip(value.keys, value.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and holds(v)
            ]
        elif isinstance(value, ast.Tuple):
            found += [(i, ret.lineno) for i, e in enumerate(value.elts) if holds(e)]
    return found[0] if len({key for key, _ in found}) == 1 else None


def key_read(paths: list[str], key: str, cls: str) -> dict[str, Any] | None:
    """How the user's files read ``[key]`` outside ``cls``: {"how": "never"} where the key
    appears nowhere else, {"how": "if", "path", "line", "code"} where every read (a subscript
    by that string, loaded) is under one ``if`` (the innermost), else None (the key also used
    some other way, ``.get``, a list of names: the source does not say)."""
    reads: list[tuple[str, ast.AST]] = []
    for path in paths:
        tree = parsed(path) if os.path.isfile(path) else None
        if tree is None:
            continue
        inside = {
            id(m)
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and n.name == cls
            for m in ast.walk(n)
        }
        subs = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Subscript) and _is_key(n.slice, key) and id(n) not in inside
        ]
        keys = [n for n in ast.walk(tree) if _is_key(n, key) and id(n) not in inside]
        if len(keys) != len(subs):
            return None
        # a store under the same key is another dict's (``losses["aux"] = ...``), not a read
        reads += [(path, s) for s in subs if isinstance(s.ctx, ast.Load)]
    if not reads:
        return {"how": "never"}
    if len({path for path, _ in reads}) != 1:
        return None
    path = reads[0][0]
    chains = [holding(path, node.lineno) for _, node in reads]
    ifs = [
        node
        for node in chains[0]
        if isinstance(node, ast.If) and all(_in_body(node, read) for _, read in reads)
    ]
    if not ifs:
        return None
    node = ifs[-1]
    return {"how": "if", "path": path, "line": node.lineno, "code": f"if {ast.unparse(node.test)}:"}


def dropped_at(path: str, line: int, index: int) -> str | None:
    """The statement at ``line`` (where the model is called), when it unpacks the call's tuple and
    leaves element ``index`` unread: bound to ``_``, or to a name its function never reads."""
    chain = holding(path, line)
    stmt = next((n for n in reversed(chain) if isinstance(n, ast.Assign)), None)
    if stmt is None or len(stmt.targets) != 1 or not isinstance(stmt.value, ast.Call):
        return None
    target = stmt.targets[0]
    if (
        not isinstance(target, ast.Tuple)
        or index >= len(target.elts)
        or any(isinstance(e, ast.Starred) for e in target.elts)
    ):
        return None
    elt = target.elts[index]
    if not isinstance(elt, ast.Name):
        return None
    scope = next((n for n in reversed(chain) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if elt.id != "_" and (scope is None or elt.id in names(scope, read_only=True)):
        return None  # read somewhere in its function: kept, as far as the source says
    return statement(stmt)


def _is_key(node: ast.AST, key: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == key


def _in_body(branch: ast.If, node: ast.AST) -> bool:
    return any(node is m for part in branch.body for m in ast.walk(part))
