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
    versions: list[int] | None = None  # the parameters' version counters (runs since 2026-12-06)
    grad_versions: list[int] | None = None  # their gradients' (-1: none), likewise


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


class Aligned:
    """Each rank's steps lined up by the sequence number of their first gradient all-reduce. A
    rank's step count is its own: one that ran out of batches under a Join context shadows the
    others' all-reduces while its count stands still, and from then on its step N is another
    rank's step N + k; its last all-reduce is the others' last. The all-reduce each step begins
    with is the same call on every rank. Held as arrays: a fingerprint check asks about one step,
    and a run of a thousand ranks has ten million."""

    def __init__(self, firsts: dict[int, tuple[np.ndarray, np.ndarray]], lasts: dict[int, int]) -> None:
        seqs = np.unique(np.concatenate([q for _, q in firsts.values()]))
        self._steps = {rank: (s, np.searchsorted(seqs, q)) for rank, (s, q) in firsts.items()}
        self._lasts = {r: int(np.searchsorted(seqs, last, side="right")) - 1 for r, last in lasts.items()}

    def step(self, rank: int, step: int) -> int:
        """The step every rank shares for ``rank``'s own ``step``; -1 where that step made no
        gradient all-reduce."""
        steps, shared = self._steps.get(rank, (np.empty(0, np.int64), np.empty(0, np.int64)))
        i = int(np.searchsorted(steps, step))
        return int(shared[i]) if i < len(steps) and steps[i] == step else -1

    def last(self, rank: int, default: int) -> int:
        """The shared step of ``rank``'s last gradient all-reduce."""
        return self._lasts.get(rank, default)


def aligned_steps(run: Run) -> Aligned | None:
    """The ranks' steps lined up (``Aligned``); None where a rank recorded no gradient
    all-reduce (buckets untimed, or none yet): the ranks' own counts are all there is."""
    firsts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    lasts: dict[int, int] = {}
    for rank, trace in run.ranks.items():
        red = trace.kind(schema.ALLREDUCE)
        if not len(red):
            return None
        seq = np.asarray(red.ints(2))
        ok = seq >= 0
        steps, seqs = np.asarray(red.step)[ok], seq[ok]
        order = np.lexsort((seqs, steps))  # by step, then its all-reduces in order
        steps, seqs = steps[order], seqs[order]
        first = np.ones(len(steps), bool)
        first[1:] = steps[1:] != steps[:-1]
        firsts[rank] = (steps[first], seqs[first])
        lasts[rank] = int(seq.max())
    return Aligned(firsts, lasts) if firsts else None


def collect(run: Run) -> dict[tuple[int, int | None], Series]:
    """Every rank's fingerprints, by (model, optimizer); checks after optimizer steps, and at
    exit, keyed by the step every rank shares (``aligned_steps``), where the gradient
    all-reduces say it."""
    out: dict[tuple[int, int | None], Series] = {}
    if not any(trace.meta.get(schema.FINGERPRINT) for trace in run.ranks.values()):
        return out
    aligned = aligned_steps(run)
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
            versions, grads = (_ints(info.get(k), len(current)) for k in ("versions", "grad_versions"))
            if at == "step" and aligned is not None:
                step = aligned.step(rank, step)
                if step < 0:
                    continue  # a step with no gradient all-reduce of its own: not comparable
            elif at == "exit" and aligned is not None:  # its final state: after its last all-reduce
                step = aligned.last(rank, step)
            series.checks[rank][(step, AT_ORDER[at], at)] = _Check(ts, current, values, versions, grads)
            for i in info.get("unsynced") or []:
                if isinstance(i, int) and 0 <= i < len(current):
                    series.unsynced[current[i]].add(rank)
    return out


def _ints(value: object, most: int) -> list[int] | None:
    """A record's list of counters, or None where it holds none (a run before them) or another
    kind of value."""
    ok = isinstance(value, list) and len(value) <= most and all(type(v) is int for v in value)
    return value if ok else None  # type: ignore[return-value]


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


def written_in_place(series: Series, found: list[Divergence]) -> tuple[dict[int, int], int] | None:
    """Which ranks wrote the first differing parameters in place beyond their optimizer steps,
    between the last check where every rank agreed and the first where they did not. Every
    in-place write moves a parameter's version counter, an optimizer step's as much as a
    ``copy_`` under ``torch.no_grad()``; how far one optimizer step moves it is learnt from the
    first interval between checks where every rank moved it alike (before the difference, else
    after it). (each such rank's moves beyond that, the parameters written); None where the
    counters were not recorded, the rate cannot be learnt, or no rank wrote more."""
    found_ = _beyond(series, found)
    return found_ if found_ is not None and found_[0] else None


def stepped_apart(series: Series, found: list[Divergence]) -> bool:
    """The counters say no rank wrote the first differing parameters beyond its optimizer steps
    (recorded, the rate learnt, nothing more): the steps themselves parted them, with other
    gradients or other settings on some rank, not a load or a write of the weights."""
    found_ = _beyond(series, found)
    return found_ is not None and not found_[0]


def _beyond(series: Series, found: list[Divergence]) -> tuple[dict[int, int], int] | None:
    """``written_in_place``'s moves, ({}, 0) where no rank moved more; None where unknown."""
    head = min(found, key=lambda d: d.first)
    if head.last_equal is None:
        return None
    ranks = sorted(r for g in head.groups for r in g)
    keys = sorted(set.intersection(*(set(series.checks[r]) for r in ranks)))
    if head.last_equal not in keys or head.first not in keys:
        return None
    excess: dict[int, int] = defaultdict(int)
    written = judged = 0
    for d in found:
        if d.buffer or d.first != head.first or d.last_equal != head.last_equal:
            continue
        judged += 1
        moved = {r: _moved(series, r, d.name, head.last_equal, head.first) for r in ranks}
        rate = _rate(series, ranks, d.name, [k for k in keys if k <= head.last_equal])
        if rate is None:  # no interval before it (changed right after wrapping): one after it
            rate = _rate(series, ranks, d.name, [k for k in keys if k >= head.first])
        if rate is None or any(n is None for n in moved.values()):
            return None
        steps = head.first[0] - head.last_equal[0]
        beyond = {r: n - rate * steps for r, n in moved.items() if n is not None}
        for r, n in beyond.items():
            if n > 0:
                excess[r] += n
        written += any(n > 0 for n in beyond.values())
    return (dict(excess), written) if judged else None


def grads_written(series: Series, found: list[Divergence]) -> tuple[dict[int, list[str]], Key] | None:
    """Which ranks wrote their gradients in place after DDP's all-reduce, at a check up to the
    first where the parameters differed: there every rank held the same reduced gradients, each
    written alike (the all-reduce's copy), so a gradient whose version counter moved further on
    some ranks was scaled, clipped or masked there alone. ({rank: the parameters whose
    gradients it wrote more}, the check); None where no check says (counters not recorded, equal,
    or no check fell on a step where it happened)."""
    head = min(found, key=lambda d: d.first)
    names = {d.name for d in found if not d.buffer}
    ranks = sorted(r for g in head.groups for r in g)
    keys = sorted(set.intersection(*(set(series.checks[r]) for r in ranks)))
    for key in (k for k in keys if k <= head.first and k[2] != "init"):
        checks = {r: series.checks[r][key] for r in ranks}
        if any(c.grad_versions is None or c.names != checks[ranks[0]].names for c in checks.values()):
            continue
        more: dict[int, list[str]] = defaultdict(list)
        for i, name in enumerate(checks[ranks[0]].names[: len(checks[ranks[0]].grad_versions or [])]):
            seen = {r: c.grad_versions[i] for r, c in checks.items() if c.grad_versions}
            if name not in names or min(seen.values()) < 0 or len(set(seen.values())) == 1:
                continue
            for r, v in seen.items():
                if v > min(seen.values()):
                    more[r].append(name)
        if more and len(more) < len(ranks):
            return dict(more), key
    return None


def _moved(series: Series, rank: int, name: str, a: Key, b: Key) -> int | None:
    """How far ``name``'s version counter moved on ``rank`` from check ``a`` to check ``b``."""
    lo, hi = series.checks[rank][a], series.checks[rank][b]
    if lo.versions is None or hi.versions is None or name not in lo.names or name not in hi.names:
        return None
    i, j = lo.names.index(name), hi.names.index(name)
    if i >= len(lo.versions) or j >= len(hi.versions):
        return None
    return hi.versions[j] - lo.versions[i]


def _rate(series: Series, ranks: list[int], name: str, keys: list[Key]) -> int | None:
    """Moves of ``name``'s counter per optimizer step: from the first interval between checks
    in ``keys`` where every rank moved it alike, by a whole number per step."""
    for a, b in zip(keys, keys[1:]):
        steps = b[0] - a[0]
        moved = {_moved(series, r, name, a, b) for r in ranks}
        if steps > 0 and len(moved) == 1 and (n := moved.pop()) is not None and n % steps == 0:
            return n // steps
    return None


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


def sized(names: list[str], numels: dict[str, int], limit: int = 6) -> str:
    """Tensor names with their sizes where known, the first ``limit`` of them."""
    shown = [f"{n} ({numels[n]:,} elements)" if n in numels else n for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more
