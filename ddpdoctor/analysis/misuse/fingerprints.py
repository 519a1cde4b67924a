"""Every rank's fingerprints of a model's tensors (``probes/fingerprint.py``), compared check by
check: which tensor first differed, at which check, between which ranks, and whether it still
did at the last. ``divergence.py`` explains why; `top` (``live/replicas.py``) shows it live."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

AT_ORDER = {"init": 0, "step": 1, "exit": 2}
Key = tuple[int, int, str]  # (step, order of "at", at): the checks in the order they happened


@dataclass
class _Check:
    ts: int
    names: tuple[str, ...]
    values: list[int]


@dataclass
class Series:
    """One DDP model (or one optimizer's outside parameters) as the ranks fingerprinted it."""

    model: int  # -1: parameters an optimizer trains outside every DDP model
    optimizer: int | None = None
    checks: dict[int, dict[Key, _Check]] = field(default_factory=lambda: defaultdict(dict))  # rank ->
    init_names: dict[int, tuple[str, ...]] = field(default_factory=dict)
    n_params: dict[tuple[str, ...], int] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)
    unsynced: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))  # name -> ranks


def collect(run: Run) -> dict[tuple[int, int | None], Series]:
    """Every rank's fingerprints, by (model, optimizer)."""
    out: dict[tuple[int, int | None], Series] = {}
    for rank, trace in sorted(run.ranks.items()):
        names: dict[tuple[int, int | None], tuple[str, ...]] = {}
        for ts, step, info in trace.meta.get(schema.FINGERPRINT, []):
            model, opt = info.get("model"), info.get("optimizer")
            at, values = info.get("at"), info.get("values")
            if not isinstance(model, int) or at not in AT_ORDER or not isinstance(values, list):
                continue
            key = (model, opt if model < 0 else None)
            series = out.setdefault(key, Series(model, key[1]))
            if isinstance(info.get("names"), list):
                names[key] = tuple(str(n) for n in info["names"])
                series.n_params[names[key]] = int(info.get("n_params", len(names[key])))
                for n, size in zip(names[key], info.get("numels") or [], strict=False):
                    series.numels[n] = int(size)
                if at == "init":
                    series.init_names.setdefault(rank, names[key])
            current = names.get(key)
            if current is None or len(current) != len(values):
                continue
            series.checks[rank][(step, AT_ORDER[at], at)] = _Check(ts, current, values)
            for i in info.get("unsynced") or []:
                if isinstance(i, int) and 0 <= i < len(current):
                    series.unsynced[current[i]].add(rank)
    return out


@dataclass
class Divergence:
    """One tensor that differs across ranks."""

    name: str
    buffer: bool
    first: Key  # the first check where it differed
    last_equal: Key | None  # the last check before that where every rank agreed
    groups: list[list[int]]  # ranks by value at the first difference
    still: bool  # still different at the last check compared


def compare(series: Series) -> list[Divergence]:
    """Tensors that differ at some check where every rank recorded the same names."""
    keys = sorted(set().union(*(set(c) for c in series.checks.values())) if series.checks else set())
    first: dict[str, Divergence] = {}
    equal_at: dict[str, Key] = {}
    for key in keys:
        present = {r: c[key] for r, c in series.checks.items() if key in c}
        if len(present) < 2:
            continue
        ranks = sorted(present)
        names = present[ranks[0]].names
        ranks = [r for r in ranks if present[r].names == names]
        if len(ranks) < 2:
            continue
        matrix = np.array([present[r].values for r in ranks], dtype=np.int64)
        differs = (matrix != matrix[0]).any(axis=0)
        n_params = series.n_params.get(names, len(names))
        for i, name in enumerate(names):
            if not differs[i]:
                equal_at[name] = key
                if name in first:
                    first[name].still = False
                continue
            if name in first:
                first[name].still = True
                continue
            groups: dict[int, list[int]] = defaultdict(list)
            for row, r in enumerate(ranks):
                groups[int(matrix[row, i])].append(r)
            ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
            first[name] = Divergence(name, i >= n_params, key, equal_at.get(name), ordered, True)
    return list(first.values())


def odd_ranks(groups: list[list[int]], suspects: set[int]) -> list[int]:
    """The ranks that differ from the others: outside the largest group; on a tie, the group
    the evidence points at (a rank that loaded weights), else every rank is named."""
    if len(groups[0]) > len(groups[1]):
        return sorted(r for g in groups[1:] for r in g)
    marked = [g for g in groups if set(g) <= suspects]
    if len(marked) == 1 and len(marked[0]) < sum(map(len, groups)):
        return sorted(marked[0])
    return sorted(r for g in groups for r in g)


def when_checked(key: Key | None) -> str:
    if key is None:
        return "never compared equal"
    step, _, at = key
    return {"init": "after DDP construction", "exit": f"at exit (step {step})"}.get(
        at, f"step {step}, after its optimizer step"
    )
