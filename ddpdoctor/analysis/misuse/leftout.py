"""Where a model's ``forward`` leaves a submodule out, read from the user's script: a ``return``
under an ``if`` before the submodule's first use, or its every use under one ``if`` (a submodule
whose parameters got no gradient on some steps was skipped by such a branch), and what the call
of the model passes for the argument that decides it. Parsed, never run; None where the source
cannot say (``unused.py`` asks)."""

from __future__ import annotations

import ast
import os
from typing import Any

from ddpdoctor.analysis.failed.source import holding, parsed, statement


def skips_module(path: str, cls: str, attr: str) -> dict[str, Any] | None:
    """Where ``cls.forward`` in ``path`` can leave ``self.<attr>`` unused: a ``return`` under an
    ``if`` before its first use, or its every use under one ``if`` (no ``else`` using it). A
    submodule whose parameters got no gradient on some steps was skipped by such a branch.
    {"how": "return" or "guard", "line", "code", "test", "use", "forward", "params"} (the
    forward's parameters): None without the class, a use, or one such branch. "never" where
    ``__init__`` makes it and no other method reads it ("use": the line that made it);
    "elsewhere" where only methods the forward does not call read it ("use": the first such
    read, "method": its method)."""
    klass, forward = class_of(path, cls)
    if forward is None:
        return None
    used = self_uses(forward, attr)
    params = [a.arg for a in (*forward.args.posonlyargs, *forward.args.args)]
    if not used:  # read by no method but the one that makes it: the forward leaves it out always
        methods = [n for n in getattr(klass, "body", []) if isinstance(n, ast.FunctionDef)]
        made = [u for m in methods if m.name == "__init__" for u in self_uses(m, attr, ast.Store)]
        readers = [m for m in methods if m.name != "__init__" and self_uses(m, attr)]
        if not made or any(self_uses(forward, m.name) for m in readers):
            return None  # none made here, or read by a method the forward calls
        if readers:
            use = min(u.lineno for u in self_uses(readers[0], attr))
            return {"how": "elsewhere", "line": use, "code": "", "test": "", "use": use,
                    "method": readers[0].name, "forward": forward.lineno, "params": params}  # fmt: skip
        return {"how": "never", "line": forward.lineno, "code": "", "test": "", "use": made[0].lineno,
                "forward": forward.lineno, "params": params}  # fmt: skip
    first = min(n.lineno for n in used)
    ifs = [n for n in ast.walk(forward) if isinstance(n, ast.If)]
    early: dict[ast.Return, ast.If] = {}  # a return before the first use -> its innermost if
    for branch in ifs:
        for stmt in branch.body:
            for ret in ast.walk(stmt):
                inner = ret not in early or early[ret].lineno < branch.lineno
                if isinstance(ret, ast.Return) and ret.lineno < first and inner:
                    early[ret] = branch
    if len(early) == 1:
        ((ret, branch),) = early.items()
        return {"how": "return", "line": ret.lineno, "code": statement(ret), "test": ast.unparse(branch.test),
                "use": first, "forward": forward.lineno, "params": params}  # fmt: skip
    if early:
        return None
    guards = []  # an if (its body) or a conditional expression (its value if true) holding every use
    for node in ast.walk(forward):
        body = node.body if isinstance(node, ast.If) else [node.body] if isinstance(node, ast.IfExp) else None
        held = {id(m) for part in body or [] for m in ast.walk(part)}
        if body is not None and all(id(u) in held for u in used):
            guards.append((len(held), node))
    if guards:
        node = min(guards, key=lambda g: g[0])[1]
        code = f"if {ast.unparse(node.test)}:" if isinstance(node, ast.If) else ast.unparse(node)
        return {"how": "guard", "line": node.lineno, "code": code, "test": ast.unparse(node.test),
                "use": first, "forward": forward.lineno, "params": params}  # fmt: skip
    return None


def class_of(path: str, cls: str) -> tuple[ast.ClassDef | None, ast.FunctionDef | None]:
    """The class ``cls`` in ``path`` and its ``forward`` (None for what is not there)."""
    tree = parsed(path) if os.path.isfile(path) else None
    klass = (
        next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if tree
        else None
    )
    body = klass.body if klass is not None else []
    forward = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    return klass, forward


def self_uses(function: ast.AST, attr: str, ctx: type = ast.Load) -> list[ast.Attribute]:
    """``self.<attr>`` in ``function``, read (or, ``ctx=ast.Store``, assigned)."""
    return [
        n
        for n in ast.walk(function)
        if isinstance(n, ast.Attribute)
        and n.attr == attr
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and isinstance(n.ctx, ctx)
    ]


def passed_to_module(path: str, line: int, params: list[str], name: str) -> str | None:
    """What the call of a model at ``line`` (``model(x, use_aux=...)``: the module's call, whose
    forward takes ``params``, ``self`` first) passes for ``name``: by keyword, or by position where
    the line makes one call; None otherwise."""
    if name not in params[1:]:
        return None
    stmts = [n for n in holding(path, line) if isinstance(n, ast.stmt)][-1:]
    calls = [c for st in stmts for c in ast.walk(st) if isinstance(c, ast.Call)]
    for call in calls:
        for kw in call.keywords:
            if kw.arg == name:
                return ast.unparse(kw.value)
    index = params.index(name) - 1
    if (
        len(calls) == 1
        and index < len(calls[0].args)
        and not any(isinstance(a, ast.Starred) for a in calls[0].args)
    ):
        return ast.unparse(calls[0].args[index])
    return None
