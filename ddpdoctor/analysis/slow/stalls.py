"""Occasional stalls: the few steps that make a rank's lateness, the training time they cost,
the DataLoader a late rank read that its training steps never read (work only it does), and
batches that are larger on the late rank (more work per step, the sampler's doing).

Kept apart from the straggler rule (straggler.py), which uses them on the ranks it finds late
now and then rather than on most steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analysis.failed.made import rank_split_feeding
from ddpdoctor.analysis.misuse.usage import training_loaders
from ddpdoctor.analysis.slow.phases import training_forwards
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

LARGER = 2.0  # a late rank's sampled batches, each larger than any other rank's, this much on average
COST_CORE = 0.8  # of an occasional straggler's lateness: the few steps that make it are the stalls

OTHER_LOADER_FIX = (
    "Only this rank does that work (an evaluation pass?) while the others wait at the next "
    "gradient sync: shard it over every rank (a DistributedSampler on that loader, then "
    "all_reduce the metric), run it less often, or run it where nobody waits (after training, "
    "or in a separate process)."
)


LARGER_FIX = (
    "Its batches hold more (longer sequences, larger images): balance the work the sampler "
    "gives each rank, not only the sample count: interleave length-sorted indices across ranks "
    "(index i to rank i % world_size), or bucket by length over the whole dataset and deal the "
    "buckets round-robin, or cap the lengths, so every rank gets a similar number of tokens per "
    "step. "
)


# Where a rank's batch sizes were counted: a DataLoader pass's first batches (the data probe),
# or the inputs of sampled training forwards (the DDP forward probe), which a job that makes
# its own batches has too.
COUNTED = {
    schema.BATCHES: "in the first batches of each pass",
    schema.INPUTS: "in its forwards' inputs at sampled steps",
}


def larger_batches(run: Run, rank: int) -> dict[str, Any] | None:
    """The rank's batches against the others', in tensor elements (``COUNTED``: the DataLoader's
    where it has them, else the forwards' inputs): when every one of its batches was larger
    than every batch of the others, by ``LARGER`` on average. None otherwise or unrecorded."""
    for kind, where in COUNTED.items():
        sizes: dict[int, list[int]] = {}
        for r, trace in run.ranks.items():
            sizes[r] = [int(i["elements"]) for _, _, i in trace.meta.get(kind, []) if i.get("elements")]
        mine, theirs = sizes.pop(rank, []), [n for v in sizes.values() for n in v]
        if not mine or not theirs or min(mine) <= max(theirs):
            continue
        ratio = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs))
        if ratio >= LARGER:
            return {
                "elements": sum(mine) / len(mine),
                "others": sum(theirs) / len(theirs),
                "ratio": round(ratio, 2),
                "counted": where,
            }
    return None


def inputs_cut_at(run: Run, rank: int) -> str:
    """Where the rank's forward inputs were cut by rank (``made.rank_split_feeding``), from the
    line that called most of its training forwards; "" where the source does not say."""
    trace = run.ranks.get(rank)
    fwd = training_forwards(trace) if trace is not None else None
    ids = fwd.ints(3, default=-1) if fwd is not None and len(fwd) else np.zeros(0, np.int64)
    ids = ids[ids >= 0]
    if trace is None or not len(ids):
        return ""
    site = int(np.bincount(ids).argmax())
    info = next((i for _, _, i in trace.meta.get(schema.SITE, []) if i.get("id") == site), None)
    if info is None or not isinstance(info.get("line"), int):
        return ""
    return rank_split_feeding(str(info.get("file")), info["line"])


def training_span_us(run: Run, steps: np.ndarray) -> float:
    """The job's training time over ``steps``: from the first of them to the start of the one
    after the last, by the slowest rank; 0 where no rank has two such starts."""
    lo, hi = int(steps[0]), int(steps[-1]) + 1
    span = 0.0
    for trace in run.ranks.values():
        fwd = training_forwards(trace)
        starts = fwd.ts[(fwd.step >= lo) & (fwd.step <= hi)]
        if len(starts) >= 2:
            span = max(span, float(starts.max() - starts.min()))
    return span


def costliest(lateness: np.ndarray, late: np.ndarray) -> np.ndarray:
    """The late steps that make ``COST_CORE`` of the lateness, with any at least a quarter as
    late as the least of those, when they are at most half of the late steps: a few long stalls
    among jitter, which a median over every late step would describe as jitter, hiding where
    the stalls' time went. Else ``late`` as it is."""
    steps = np.flatnonzero(late)
    if len(steps) < 4:
        return late
    values = lateness[steps]
    order = np.argsort(-values, kind="stable")
    share = np.cumsum(values[order]) / max(float(values.sum()), 1e-9)
    keep = int(np.searchsorted(share, COST_CORE)) + 1
    keep = int((values >= 0.25 * values[order[keep - 1]]).sum())  # and any stall of that order
    if keep < 2 or keep > len(steps) // 2:
        return late
    core = np.zeros_like(late)
    core[steps[order[:keep]]] = True
    return core


def other_loader(trace: RankTrace, steps: list[int]) -> dict[str, object] | None:
    """The DataLoader other than the training one that the rank read on ``steps`` (its data
    waits from the previous step's end to the step's sync), when most of that data wait went
    to it: work only this rank does (an evaluation pass), not a slow training loader."""
    dw, fed = trace.kind(schema.DATA_WAIT), training_loaders(trace)
    if not fed or not steps:
        return None
    ids = dw.ints(0, default=0)
    train = max(fed, key=lambda i: fed[i])
    wanted = np.asarray(steps, dtype=np.int64)
    on = np.isin(dw.step, np.concatenate([wanted - 1, wanted]))
    other = on & (ids != train)
    total = float(dw.dur[on].sum())
    if not other.any() or float(dw.dur[other].sum()) < 0.5 * total:
        return None
    by_id = {int(i): float(dw.dur[other & (ids == i)].sum()) for i in np.unique(ids[other])}
    loader = max(by_id, key=lambda i: by_id[i])
    info = next((m for _, _, m in trace.meta.get(schema.LOADER, []) if m.get("id") == loader), {})
    return {
        "id": loader,
        "sampler": info.get("sampler"),
        "dataset_len": info.get("dataset_len"),
        "stack": list(info.get("stack") or ([info["site"]] if info.get("site") else [])),
        "ms_per_step": round(by_id[loader] / len(steps) / 1e3, 3),
    }


def where_time_went(phase: str, reading: dict[str, object] | None) -> str:
    """The phase a straggler loses its time in, with the other DataLoader it reads there."""
    return f"data_wait of {loader_text(reading)}" if reading else phase


def loader_text(reading: dict[str, object]) -> str:
    """'a DataLoader its training steps do not read (SequentialSampler over 16000 samples, read
    at eval.py:67 score <- train.py:103 main)'."""
    size = reading["dataset_len"]
    what = f"{reading['sampler'] or 'a'} over {size} samples" if size else "a"
    stack = reading["stack"]
    at = f", read at {' <- '.join(stack[:2])}" if stack else ""  # type: ignore[arg-type]
    return f"a DataLoader its training steps do not read ({what}{at})"
