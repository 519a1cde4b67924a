"""What one collective is, whole: its signature, and the field on which ranks disagree.

A backend matches collectives by order within a process group; the ranks' calls at one sequence
number can complete together only when they agree on every part of the signature: the op, the
dtype, the element count (for ops whose sizes must match), the root (``src``/``dst``) and the
group's members. Both the live proof (status files, ``proof.py``) and the ledger after the run
(``ledger.py``) ask the same question of the same fields, declared once here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddpdoctor.analysis.findings import rank_list

# Ops whose per-rank sizes must agree (the others gather objects, split unevenly or are not
# group collectives at all).
SIZED_OPS = frozenset(
    {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
)
ROOTED_OPS = {
    **dict.fromkeys(("broadcast", "scatter", "broadcast_object_list", "scatter_object_list"), "src"),
    **dict.fromkeys(("reduce", "gather", "gather_object"), "dst"),
}
NEW_GROUP = "new_group"


@dataclass(frozen=True)
class Field:
    """One part of the signature: its key in a status phase or a ledger point, how it is named
    in a sentence, and when it must agree (given the op the ranks agree on)."""

    key: str
    name: Callable[[str], str]
    applies: Callable[[str], bool]
    show: Callable[[Any], str] = str


def _bytes(value: Any) -> str:
    return f"{int(value):,} bytes"


# In the order a disagreement is named: the op first (nothing else compares across ops).
FIELDS = (
    Field("dtype", lambda op: "dtype", lambda op: op != NEW_GROUP),
    Field("numel", lambda op: "element count", lambda op: op in SIZED_OPS, lambda v: f"{int(v):,} elements"),
    Field("bytes", lambda op: "size", lambda op: op in SIZED_OPS, _bytes),
    Field("root", lambda op: ROOTED_OPS.get(op, "root"), lambda op: op in ROOTED_OPS),
    Field("ranks", lambda op: "new group's ranks" if op == NEW_GROUP else "group members", lambda op: True,
          lambda v: f"[{str(v).replace(' ', ', ')}]"),
)  # fmt: skip


@dataclass(frozen=True)
class Disagreement:
    field: str  # "op", or a Field.key
    name: str  # how the field is called for this op: "src", "dtype", "element count"...
    text: str  # "ranks disagree on the broadcast's src: rank 0 src=0, rank 1 src=1"
    minority: list[int]  # the ranks on the rarer side (the lowest rank breaks ties)
    values: dict[int, Any]


def disagreement(
    at: Mapping[int, Mapping[str, Any]], op_of: Callable[[Mapping[str, Any]], str], where: str = ""
) -> Disagreement | None:
    """The first part of the signature on which the ranks' calls at one sequence number differ,
    or None. ``where`` names the call ("collective #9"). ``at``: rank -> the call's fields (a
    status phase or a ledger point as a dict); a field a rank did not record (an older trace, a
    point seen only in a stack) is not compared."""
    if len(at) < 2:
        return None
    ops = {r: op_of(p) for r, p in at.items()}
    if len(set(ops.values())) > 1:
        return Disagreement("op", "op", _op_text(ops, where), _minority(ops), ops)
    op = next(iter(ops.values()))
    for f in FIELDS:
        if not f.applies(op):
            continue
        values = {r: p.get(f.key) for r, p in at.items() if _present(f.key, p.get(f.key))}
        if len(values) < 2 or len(set(values.values())) == 1:
            continue
        name = f.name(op)
        parts = ", ".join(f"rank {r} {name}={f.show(v)}" if f.key == "root" else f"rank {r} {f.show(v)}"
                          for r, v in sorted(values.items()))  # fmt: skip
        at_where = f" at {where}" if where else ""
        text = f"ranks disagree on the {op}'s {name}{at_where}: {parts}"
        return Disagreement(f.key, name, text, _minority(values), values)
    return None


def _present(key: str, value: Any) -> bool:
    if value is None:
        return False
    if key == "dtype":
        return value != ""
    if key in ("numel", "bytes"):
        return int(value) > 0
    if key == "root":
        return int(value) >= 0
    return True  # ranks: "" is WORLD, a value like any other


def _minority(values: Mapping[int, Any]) -> list[int]:
    sides: dict[Any, list[int]] = {}
    for r, v in values.items():
        sides.setdefault(v, []).append(r)
    return sorted(min(sides.values(), key=lambda rs: (len(rs), min(rs))))


def _op_text(ops: Mapping[int, str], where: str) -> str:
    sides: dict[str, list[int]] = {}
    for r, op in ops.items():
        sides.setdefault(op, []).append(r)
    if NEW_GROUP in sides and len(sides) == 2:
        creators = sides[NEW_GROUP]
        rest = sorted(r for r in ops if r not in creators)
        other = ops[rest[0]]
        return (
            f"rank(s) {rank_list(creators)} create a process group (new_group) that rank(s) "
            f"{rank_list(rest)} do not (they are in {other}{' at ' + where if where else ''}): "
            "new_group is a collective of the "
            "default group, every rank must call it"
        )
    parts = sorted(sides.items(), key=lambda kv: min(kv[1]))
    of = f" of {where}" if where else ""
    return f"ranks disagree on the op{of}: " + " vs ".join(
        f"rank(s) {rank_list(rs)} {op}" for op, rs in parts
    )


def fix_for(differ: Disagreement, op: str) -> str:
    """What to change when the ranks disagree on one part of a collective's signature."""
    if differ.field == "root":
        return (
            f"Pass the same {differ.name} to this {op} on every rank: {differ.name} names one "
            f"rank (e.g. {differ.name}=0), not each rank's own number."
        )
    if differ.field == "op" and NEW_GROUP in differ.values.values():
        return (
            "Call dist.new_group(...) on every rank, with the same ranks and in the same order, "
            "even on ranks that will not be members of the new group."
        )
    if differ.field == "dtype":
        return (
            f"Give the {op}'s tensor one dtype on every rank: create it with an explicit dtype "
            "(torch.tensor(values, dtype=torch.float32)) or cast it (.float()) before the call. "
            "torch.tensor infers the dtype from the values: Python ints give int64, floats "
            "float32, so a rank whose values are all ints (a sum still 0 on an empty shard) "
            "sends another dtype. When one line issues several collectives in a loop, iterate "
            "in the same order on every rank."
        )
    return (
        f"Make the {op}'s {differ.name} the same on every rank: pad per-rank tensors to one size "
        "(all_gather the sizes first), cast to one dtype, and keep the group the same; when one "
        "line issues several collectives in a loop, iterate in the same order on every rank "
        "(sorted(), not a set or a dict filled in a per-rank order)."
    )
