"""The lines that wrote a parameter after DDP wrapped the model, read from the user's script.

The fingerprints say which parameters changed on which rank between DDP's constructor (which
broadcast rank 0's weights) and the first optimizer step; the version counters say the rank
wrote them in place. Neither says where. The script does, when it is still on disk: after the
line that wrapped the model, in the same function and before its first loop, the statement that
writes those parameters (an in-place method such as ``copy_``, an ``nn.init`` function, an
assignment to ``.data``; the load probe records ``load_state_dict`` with its line), directly or
through a function of the same file it calls. Parsed, never run; no answer unless exactly one
statement there writes them.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

from ddpdoctor.analysis.failed.source import (
    assigned_targets,
    called,
    holding,
    parsed,
    rank_of,
    scope_of,
    statement,
)

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_FLAGS = {"requires_grad_", "share_memory_"}  # in-place methods that leave the values alone


@dataclass
class Wrote:
    """A statement after the wrapping that writes the changed parameters."""

    line: int  # the statement in the wrapping's function
    code: str
    under: tuple[int, str] | None  # the innermost ``if`` holding it there: (line, "if <test>:")
    write: tuple[int, str] | None  # the write itself, where it is in a function the line calls
    rank: int | None = None  # the one rank ``under`` holds for (`if rank == 0 and ...:`), if any

    def text(self, path: str, wrapped: int) -> str:
        name = os.path.basename(path)
        said = f"`{self.code}` at {name}:{self.line}"
        if self.under is not None:
            said += f", under `{self.under[1]}` ({name}:{self.under[0]})"
        said += f", after the model was wrapped at {name}:{wrapped}"
        if self.write is not None:
            said += f"; it writes them at {name}:{self.write[0]} (`{self.write[1]}`)"
        return said


def wrote_after_wrapping(path: str, wrapped: int, params: list[str]) -> Wrote | None:
    """The one statement after ``wrapped`` (the DDP constructor's line), before the first loop
    of that function, that writes any of ``params`` (dotted names as the model names them)."""
    tree = parsed(path) if os.path.isfile(path) else None
    scope = scope_of(path, holding(path, wrapped))
    if tree is None or scope is None:
        return None
    body, at = _block_of(scope, wrapped)
    if body is None:
        return None
    functions = {n.name: n for n in tree.body if isinstance(n, _DEFS)}
    owners = {_owner(p) for p in params}
    found: list[Wrote] = []
    for stmt in body[at + 1 :]:
        if isinstance(stmt, _LOOPS):
            break
        for node, under in _statements(stmt, None):
            if _writes(node, owners):
                found.append(Wrote(node.lineno, statement(node), under, None))
                continue
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
            for name in (c.func.id for c in calls if isinstance(c.func, ast.Name)):
                callee = functions.get(name)
                inner = _write_in(callee, owners, _leaves(params)) if callee is not None else None
                if inner is not None:
                    found.append(Wrote(node.lineno, statement(node), under, (inner.lineno, statement(inner))))
                    break
    return found[0] if len(found) == 1 else None


def written_later(path: str, wrapped: int) -> list[Wrote]:
    """The statements inside the loops after ``wrapped`` in its function (the weights parted
    after training steps, not at the first check) that write the model's weights under a
    condition, in line order: directly (``model.head.weight.copy_(...)``), or
    through a same-file function or method they hand the model or its parameters to, which
    writes in place (``ema.copy_to(params)``, whose ``p.copy_(s)`` writes them). A write every
    rank makes at every step (an average's update of its own copy) holds no ``if`` and is left
    out: the ranks' version counters say one rank wrote more, so the write is conditional."""
    tree = parsed(path) if os.path.isfile(path) else None
    scope = scope_of(path, holding(path, wrapped))
    made = [n for n in holding(path, wrapped) if isinstance(n, ast.stmt)][-1:]
    if tree is None or scope is None or not made:
        return []
    # the wrapper's names and the module it wraps (`model = DDP(net, device_ids=[rank])`: not rank)
    targets = getattr(made[0], "targets", [])
    value = getattr(made[0], "value", None)
    model = {t for target in targets for t in _names(target)}
    if isinstance(value, ast.Call) and value.args:
        model.add(_root(value.args[0]))
    aliases = model | {
        t for n in ast.walk(scope) if isinstance(n, ast.Assign) and _names(n.value) & model
        for target in n.targets for t in _names(target)
    }  # fmt: skip
    defs = _defs(tree)
    found: list[Wrote] = []
    for node in _simple_after(scope, wrapped):
        chain = holding(path, node.lineno)
        chain = chain[chain.index(scope) + 1 :] if scope in chain else chain
        if not any(isinstance(n, _LOOPS) for n in chain):
            continue  # before the loop: the weights would part at the first check, not later
        ifs = [n for n in chain if isinstance(n, ast.If) and n.lineno < node.lineno]
        under = (ifs[-1].lineno, f"if {ast.unparse(ifs[-1].test)}:") if ifs else None
        if _writes(node, aliases):
            if under is not None:
                found.append(Wrote(node.lineno, statement(node), under, None))
            continue
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            callee = defs.get(called(call), [])
            handed = [*call.args, *(k.value for k in call.keywords)]
            if isinstance(call.func, ast.Attribute):
                handed.append(call.func.value)
            if len(callee) != 1 or not any(_names(a) & aliases for a in handed):
                continue
            inner = _in_place(callee[0])
            if inner is not None and (under is not None or inner[1]):
                found.append(
                    Wrote(node.lineno, statement(node), under, (inner[0].lineno, statement(inner[0])))
                )
                break
    return sorted(found, key=lambda w: w.line)


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, *_DEFS, ast.ClassDef)


def written_after(path: str, wrapped: int, params: list[str]) -> list[Wrote]:
    """The statements after ``wrapped`` in its function, in its loops or between them, with a
    condition or without, that write ``params`` (dotted names as the model names them):
    directly, or through the one same-file function or method of that name they call
    (`model.module.start_finetune()`, whose `self.head.reset_parameters()` writes them). Where
    every rank wrote them, each its own way (its own random draw), no ``if`` tells that write
    from the others."""
    tree = parsed(path) if os.path.isfile(path) else None
    scope = scope_of(path, holding(path, wrapped))
    owners = {_owner(p) for p in params} - {""}
    if tree is None or scope is None or not owners:
        return []
    defs = _defs(tree)
    found: list[Wrote] = []
    for node in _simple_after(scope, wrapped):
        if _writes(node, owners):
            found.append(Wrote(node.lineno, statement(node), None, None))
            continue
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            callee = defs.get(called(call), [])
            inner = _write_in(callee[0], owners, _leaves(params)) if len(callee) == 1 else None
            if inner is not None:
                found.append(Wrote(node.lineno, statement(node), None, (inner.lineno, statement(inner))))
                break
    return sorted(found, key=lambda w: w.line)


def grads_written_after(path: str, wrapped: int) -> list[Wrote]:
    """The statements after ``wrapped`` in its function that write gradients, directly or
    through the one same-file function of that name they call: an in-place method on a
    ``.grad`` (`p.grad.div_(n)`), an assignment to one, or torch's clipping (``clip_grad_norm_``,
    ``clip_grad_value_``). After DDP's all-reduce every rank holds the same averaged gradient;
    a factor of the rank's own applied there parts the replicas at the next step."""
    tree = parsed(path) if os.path.isfile(path) else None
    scope = scope_of(path, holding(path, wrapped))
    if tree is None or scope is None:
        return []
    defs = _defs(tree)
    found: list[Wrote] = []
    for node in _simple_after(scope, wrapped):
        chain = holding(path, node.lineno)
        ifs = [n for n in chain[chain.index(scope) + 1 :] if isinstance(n, ast.If)] if scope in chain else []
        under = (ifs[-1].lineno, f"if {ast.unparse(ifs[-1].test)}:") if ifs else None
        rank = rank_of(ifs[-1].test) if ifs else None
        if _writes_grads(node):
            found.append(Wrote(node.lineno, statement(node), under, None, rank))
            continue
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            callee = defs.get(called(call), [])
            inner = (
                [s for s in ast.walk(callee[0]) if isinstance(s, ast.stmt) and _writes_grads(s)]
                if len(callee) == 1
                else []
            )
            if len(inner) == 1:
                write = (inner[0].lineno, statement(inner[0]))
                found.append(Wrote(node.lineno, statement(node), under, write, rank))
                break
    return sorted(found, key=lambda w: w.line)


_CLIPS = {"clip_grad_norm_", "clip_grad_value_"}


def _writes_grads(stmt: ast.stmt) -> bool:
    if isinstance(stmt, _COMPOUND):
        return False
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and called(node) in _CLIPS:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            in_place = method.endswith("_") and not method.startswith("_") and method not in _FLAGS
            if in_place and "grad" in _names(node.func.value):
                return True
    return any("grad" in _names(t) and not isinstance(t, ast.Name) for t in assigned_targets(stmt))


def _defs(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """The file's functions and methods by name (a name defined twice: both)."""
    defs: dict[str, list[ast.AST]] = {}
    for n in ast.walk(tree):
        if isinstance(n, _DEFS):
            defs.setdefault(n.name, []).append(n)
    return defs


def _simple_after(scope: ast.AST, line: int) -> list[ast.stmt]:
    """The statements of ``scope`` after ``line`` that hold no block, nested ones included."""
    return [
        n
        for n in ast.walk(scope)
        if isinstance(n, ast.stmt) and n.lineno > line and not isinstance(n, _COMPOUND)
    ]


def _in_place(function: ast.AST) -> tuple[ast.stmt, bool] | None:
    """The first statement of ``function`` that writes a tensor in place (an in-place method of
    a tensor, a ``reset_parameters()``, an ``nn.init`` function, a ``.data`` assignment; not a
    library's in-place function such as ``nn.utils.clip_grad_norm_``, which writes gradients),
    and whether an ``if`` of the function holds it."""

    def visit(node: ast.AST, held: bool) -> tuple[ast.stmt, bool] | None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) and not isinstance(child, _COMPOUND) and _writes_tensor(child):
                return child, held
            nested = isinstance(child, (*_DEFS, ast.ClassDef))
            if isinstance(child, (ast.stmt, ast.excepthandler)) and not nested:
                found = visit(child, held or isinstance(child, ast.If))
                if found is not None:
                    return found
        return None

    return visit(function, False)


_LIBRARIES = {"torch", "nn", "F", "np", "numpy", "math", "functional"}


def _writes_tensor(stmt: ast.stmt) -> bool:
    if not _writes(stmt, {""}):
        return False
    receivers = [
        c.func.value
        for c in ast.walk(stmt)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr.endswith("_")
    ]
    roots = {_root(r) for r in receivers}
    return (
        not receivers
        or any(r not in _LIBRARIES for r in roots)
        or any("init" in _names(r) for r in receivers)
    )


def _root(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _block_of(scope: ast.AST, line: int) -> tuple[list[ast.stmt] | None, int]:
    """The statement list of ``scope`` (not nested deeper) holding ``line``, and its index."""
    body = getattr(scope, "body", None)
    if not isinstance(body, list):
        return None, -1
    for i, stmt in enumerate(body):
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            return body, i
    return None, -1


Under = tuple[int, str] | None  # the innermost ``if`` holding a statement: (line, "if <test>:")


def _statements(node: ast.stmt, under: Under) -> list[tuple[ast.stmt, Under]]:
    """``node`` and, inside its ``if``s and ``with``s, the statements it holds, each with the
    innermost ``if`` holding it."""
    if isinstance(node, ast.If):
        here = (node.lineno, f"if {ast.unparse(node.test)}:")
        return [s for child in (*node.body, *node.orelse) for s in _statements(child, here)]
    if isinstance(node, (ast.With, ast.AsyncWith, ast.Try)):
        return [s for child in node.body for s in _statements(child, under)]
    return [(node, under)]


def _write_in(function: ast.AST, owners: set[str], leaves: set[str] | None = None) -> ast.stmt | None:
    """The one statement of ``function`` that writes a parameter of ``owners``; of several, the
    one that names the parameter itself (``leaves``: "weight" of "head.weight"), where one does
    (`xavier_uniform_(head.weight)`, not `head.bias.copy_(...)` beside it)."""
    hits = [s for s in ast.walk(function) if isinstance(s, ast.stmt) and _writes(s, owners)]
    hits = [s for s in hits if not any(s is not h and _holds(s, h) for h in hits)]
    if len(hits) > 1 and leaves:
        hits = [s for s in hits if _names(s) & leaves]
    return hits[0] if len(hits) == 1 else None


def _holds(outer: ast.stmt, inner: ast.stmt) -> bool:
    return any(n is inner for n in ast.walk(outer))


def _writes(stmt: ast.stmt, owners: set[str]) -> bool:
    """``stmt`` itself (not a nested block) writes a parameter of ``owners`` (module names;
    "" for the whole model): an in-place method on it, an ``nn.init`` function given it, an
    assignment to its ``.data``."""
    if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, *_DEFS)):
        return False
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, target = node.func.attr, node.func.value
            in_place = (method.endswith("_") and not method.startswith("_") and method not in _FLAGS) or (
                method == "reset_parameters"
            )
            if in_place and _mentions(target, owners):
                return True
            if "init" in _names(target) and node.args and _mentions(node.args[0], owners):
                return True
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == "data" and _mentions(t.value, owners):
                    return True
                # rows written by index (`self.ent.weight[idx] = ...`): a module named, not any tensor
                if isinstance(t, ast.Subscript) and "" not in owners and _mentions(t.value, owners):
                    return True
    return False


def _leaves(params: list[str]) -> set[str]:
    return {p.rsplit(".", 1)[-1] for p in params}


def _owner(param: str) -> str:
    """The module that holds a parameter, by its last name: "emb" for "module.emb.weight"."""
    parts = [p for p in param.split(".") if not p.isdigit()]
    return parts[-2] if len(parts) > 1 else ""


def _names(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name)
    }


def _mentions(node: ast.AST, owners: set[str]) -> bool:
    """The expression reaches one of ``owners`` (a whole model: any expression)."""
    names = _names(node)
    return any(o == "" or o in names for o in owners)


def written_in_forward(paths: list[str], owner: str, param: str) -> list[tuple[str, int, str]]:
    """(path, line, code) of where the forward of module class ``owner`` ("PrototypeHead", or
    "Embedding(max_norm=1.0)" for torch's own) writes parameter ``param`` in place: the
    statements of that class's ``forward`` in ``paths`` that write ``self.<name>`` (an in-place
    method, a ``.data`` assignment, an indexed assignment `self.prototypes[i] = ...`); for a
    class of torch's, the calls that build it with the option named (`nn.Embedding(n, d,
    max_norm=1.0)`), since its forward is not the user's to change."""
    name = param.rsplit(".", 1)[-1]
    cls, _, option = owner.partition("(")
    option = option.split("=")[0]
    found = []
    for path in paths:
        tree = parsed(path)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ClassDef) and node.name == cls:
                forward = [f for f in node.body if isinstance(f, _DEFS) and f.name == "forward"]
                for stmt in (s for f in forward for s in ast.walk(f) if isinstance(s, ast.stmt)):
                    indexed = any(
                        isinstance(t, ast.Subscript) and _mentions(t.value, {name})
                        for t in assigned_targets(stmt)
                    )
                    if not isinstance(stmt, _COMPOUND) and (indexed or _writes(stmt, {name})):
                        found.append((path, stmt.lineno, statement(stmt)))
            elif option and isinstance(node, ast.Call) and called(node) == cls:
                found += [(path, node.lineno, ast.unparse(node)) for k in node.keywords if k.arg == option]
    return found


def written_anywhere(paths: list[str], names: list[str]) -> list[tuple[str, int, str]]:
    """(path, line, code) of the statements in ``paths``, in any function, that write these
    tensors in place by their last names (`self.moments.lerp_(batch, m)` for "norm.moments"):
    a buffer a module updates itself."""
    leaves = _leaves(names)
    found = []
    for path in paths:
        tree = parsed(path)
        for stmt in ast.walk(tree) if tree is not None else ():
            if isinstance(stmt, ast.stmt) and not isinstance(stmt, _COMPOUND) and _writes(stmt, leaves):
                found.append((path, stmt.lineno, statement(stmt)))
    return found
