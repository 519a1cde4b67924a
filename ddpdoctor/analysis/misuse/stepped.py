"""Optimizer steps a rank skipped that the others took, and steps no gradient all-reduce preceded.

A rank-local decision to skip the update (a loss-spike guard on the rank's own loss, a check of
its own batch) leaves the replicas apart while every collective still matches: DDP's backward
all-reduced the gradients, so nothing hangs and nothing raises; only the update differs. Each
rank's optimizer steps are in its trace (``optimizer`` events, one per ``optimizer.step()``),
so the steps one rank skipped are facts, not a guess.

A rank can also reduce gradients without stepping while its own step count stands still: under
a Join context the rank that ran out of batches shadows the others' all-reduces. Then the
counts themselves say it (``behind``): the same gradient all-reduces, fewer optimizer steps.

And a rank can step on gradients DDP never reduced: every backward under ``no_sync()`` (an
accumulation boundary that never holds). The step count, which a forward after a synced one
advances, then stands still while the optimizer steps (``unsynced_steps``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ddpdoctor.analysis.failed.ledger import sites_of
from ddpdoctor.analysis.failed.source import no_sync_schedule
from ddpdoctor.analysis.findings import Finding, rank_list
from ddpdoctor.analysis.misuse.models import ddp_models
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

FIX = (
    "Decide on every rank alike whether to step: a skip decided from the rank's own loss or batch "
    "must be agreed first (dist.all_reduce a skip flag with ReduceOp.MAX, or the loss, and let "
    "every rank skip together), or decide from the gradients after backward (all-reduced, so the "
    "same on every rank). Every rank must call optimizer.step() at the same steps; then broadcast "
    "rank 0's weights and optimizer state to repair the replicas."
)


def skipped_steps(run: Run, after: int, upto: int) -> dict[int, list[int]]:
    """rank -> the steps in (after, upto] where it ran fewer optimizer steps than another rank,
    up to the last step every rank's record reaches (a rank that died stepped no further)."""
    counts: dict[int, Counter[int]] = {}
    reach = upto
    for rank, trace in run.ranks.items():
        steps = trace.kind(schema.OPTIMIZER).step
        reach = min(reach, int(trace.kind(schema.FORWARD).step.max(initial=-1)))
        counts[rank] = Counter(steps[steps > after].tolist())
    if len(counts) < 2:
        return {}
    every = {s for c in counts.values() for s in c if s <= reach}
    most = {s: max(c.get(s, 0) for c in counts.values()) for s in every}
    out = {r: sorted(s for s in every if c.get(s, 0) < most[s]) for r, c in counts.items()}
    return {r: s for r, s in out.items() if s}


def why(skipped: dict[int, list[int]]) -> str:
    """What the skips were: 'rank 1 skipped optimizer.step() at 5 step(s) the others took (22,
    31, 40, 49, 58): ...'."""
    parts = []
    for rank, steps in sorted(skipped.items()):
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        took = f"{len(steps)} step(s) the others took"
        parts.append(f"rank {rank} skipped optimizer.step() at {took} ({shown})")
    ranks = rank_list(sorted(skipped))
    return (
        "; ".join(parts) + f": from the first skip, rank(s) {ranks} updated differently (every gradient "
        "was all-reduced, every collective matched; only the update differed)"
    )


@dataclass
class Unsynced:
    """A rank's optimizer steps taken on gradients no all-reduce had produced."""

    steps: int  # such optimizer steps
    of: int  # all its optimizer steps
    at: int  # the step number the first stood at
    forwards: int  # training forwards at that step number
    site: str  # the user's line of a forward there ("" unknown)


def unsynced_steps(run: Run) -> dict[int, Unsynced]:
    """rank -> its optimizer steps that no gradient all-reduce preceded, for the ranks that took
    any. The probe numbers steps by the DDP forwards that follow a synced one, so an
    ``optimizer.step()`` followed by a training forward of the same number stepped after backward
    passes that all ran under ``no_sync()``: DDP had reduced nothing. One DDP model only: a
    second model's forwards (a GAN's discriminator) run inside the first one's step."""
    if len(ddp_models(run)) != 1:
        return {}
    out: dict[int, Unsynced] = {}
    for rank, trace in run.ranks.items():
        opt, fwd = trace.kind(schema.OPTIMIZER), trace.kind(schema.FORWARD)
        if not len(opt) or not len(fwd):
            continue
        training = np.flatnonzero(fwd.ints(0) == 1)
        f_ts, f_step = fwd.ts[training], fwd.step[training]
        o_step = opt.step
        # the next training forward after the step ended (a closure's forward runs inside it)
        after = np.searchsorted(f_ts, opt.end, side="right")
        has = after < len(f_ts)
        same = np.zeros(len(opt), bool)
        same[has] = f_step[after[has]] == o_step[has]
        if not same.any():
            continue
        first = int(np.argmax(same))
        at = int(o_step[first])
        fields = fwd.fields[int(training[after[first]])]
        site_id = fields[3] if len(fields) > 3 else None
        site = sites_of(trace).get(site_id, "") if isinstance(site_id, int) else ""
        out[rank] = Unsynced(int(same.sum()), len(opt), at, int((f_step == at).sum()), site)
    return out


def unsynced_text(unsynced: dict[int, Unsynced]) -> str:
    """'no gradient all-reduce preceded 41 of the 42 optimizer steps of ranks 0-1 (from step 0,
    which their 168 training forwards never left): ...', ranks with the same counts together."""
    alike: dict[tuple[int, int, int, int], list[int]] = {}
    for r, u in sorted(unsynced.items()):
        alike.setdefault((u.steps, u.of, u.at, u.forwards), []).append(r)
    parts = [
        f"{steps} of the {of} optimizer steps of rank(s) {rank_list(ranks)} (from step {at}, which "
        f"{'their' if len(ranks) > 1 else 'its'} {forwards} training forwards never left)"
        for (steps, of, at, forwards), ranks in alike.items()
    ]
    return (
        f"no gradient all-reduce preceded {'; '.join(parts)}: every backward before them ran under "
        "no_sync() (the step count, which a forward after a synced one advances, stood still), so "
        "each rank stepped with its own gradients"
    )


def decided_at(run: Run, unsynced: dict[int, Unsynced]) -> tuple[str, str]:
    """(file:line, "; whether ... is decided at f:L <- f:L") of the lines that decide whether the
    forward runs under no_sync() (``source.no_sync_schedule``); ("", "") where the script cannot say."""
    rank = min(unsynced)
    trace, site = run.ranks[rank], unsynced[rank].site
    name, _, line = site.rpartition(":")
    paths = (str(info.get("file")) for _, _, info in trace.meta.get(schema.SITE, []))
    path = next((p for p in paths if os.path.basename(p) == name), "")
    schedule = no_sync_schedule(path, int(line)) if path and line.isdigit() else []
    if not schedule:
        return "", ""
    lines = [f"{name}:{n}" for n in schedule]
    return lines[-1], "; whether a forward runs under no_sync() is decided at " + " <- ".join(lines)


FIX_UNSYNCED = (
    "Let the last micro-batch of every accumulation window run its forward and backward outside "
    "model.no_sync(), so that DDP all-reduces the accumulated gradients before optimizer.step(); "
    "check the test that decides the boundary (e.g. (micro_step + 1) % accum_steps == 0, the same "
    "test that decides the optimizer step)."
)


FIX_BEHIND = (
    "Give every rank the same number of batches, so that no rank joins early (a DistributedSampler "
    "pads the shards; or drop the remainder). Where uneven inputs are meant (a Join context), keep "
    "the optimizer state in step too: Join re-syncs the weights at its exit, not Adam's moments or "
    "momentum buffers, so after each Join broadcast the optimizer state from a rank that stepped "
    "every time (optimizer.state_dict(), dist.broadcast_object_list), or use an optimizer without "
    "state (plain SGD)."
)


def behind(run: Run) -> tuple[dict[int, int], int, int] | None:
    """({rank: its optimizer steps} of the ranks that took fewer, the most any rank took, the
    gradient all-reduces each made) where every rank made as many gradient all-reduces as the
    others (each matched its peers') but some took fewer optimizer steps: they reduced
    gradients without stepping (a Join context shadows the all-reduces of a rank that ran out
    of batches, with zeros, and that rank's optimizer does not step). Step numbers cannot show
    it: such a rank's own count stands still while it shadows. Only for a job that finished: a
    rank that failed mid-step leaves a step reduced and not taken, which is its failure's story."""
    if run.exit_code:
        return None
    reduces = {r: len(t.kind(schema.ALLREDUCE)) for r, t in run.ranks.items()}
    steps = {r: len(t.kind(schema.OPTIMIZER)) for r, t in run.ranks.items()}
    if len(reduces) < 2 or len(set(reduces.values())) != 1 or not next(iter(reduces.values())):
        return None
    most = max(steps.values())
    fewer = {r: n for r, n in steps.items() if n < most}
    return (fewer, most, next(iter(reduces.values()))) if fewer and min(steps.values()) > 0 else None


def behind_text(fewer: dict[int, int], most: int, reduces: int) -> str:
    ranks = rank_list(sorted(fewer))
    took = ", ".join(f"rank {r} {n}" for r, n in sorted(fewer.items()))
    return (
        f"the ranks made the same {reduces} gradient all-reduce(s), but their optimizers took different "
        f"numbers of steps ({took}, the others {most}): rank(s) {ranks} reduced gradients without "
        "stepping (a Join context does this to the rank that ran out of batches first: it shadows "
        "the others' all-reduces and re-syncs the weights at its exit, not the optimizer state)"
    )


# An optimizer whose settings are only these, with momentum 0, keeps no state between steps.
_STATELESS = {
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "nesterov",
    "maximize",
    "foreach",
    "differentiable",
    "fused",
}


def state_kept(run: Run, rank: int) -> str:
    """What says the rank's optimizer keeps state between steps, from its recorded settings:
    "Adam (betas)", "SGD (momentum 0.9)"; "" for one that keeps none or settings not on record."""
    trace = run.ranks.get(rank)
    for _ts, _step, info in trace.meta.get(schema.OPT_SETTINGS, []) if trace is not None else []:
        for group in info.get("groups") or []:
            if not isinstance(group, dict):
                continue
            extra = sorted(set(group) - _STATELESS)
            momentum = group.get("momentum") or 0
            if extra or momentum:
                said = f"momentum {momentum}" if momentum else "betas" if "betas" in extra else extra[0]
                return f"{info.get('type') or 'its optimizer'} ({said})"
    return ""


def behind_finding(run: Run) -> Finding | None:
    """Ranks that reduced gradients without stepping while their optimizers keep state, where no
    fingerprint check compared them at a step they shared (a Join re-syncs the weights at its
    exit; between, the checks of a rank whose count stood still fall on other steps)."""
    short = behind(run)
    if short is None:
        return None
    fewer = short[0]
    kept = {r: state_kept(run, r) for r in fewer}
    if not all(kept.values()):
        return None  # no state to fall behind: the same averaged gradients, the same steps
    ranks = sorted(fewer)
    return Finding(
        "optimizer_state_behind",
        "warning",
        ranks,
        f"{behind_text(*short)}. Its optimizer keeps state ({'; '.join(sorted(set(kept.values())))}), "
        "which fell behind: the same averaged gradients then move the replicas apart until the weights "
        "are synced again (no fingerprint check fell on a step every rank shared to show it)",
        fix=FIX_BEHIND,
        details={
            "root_rank": ranks[0] if len(ranks) == 1 else None,
            "optimizer_steps": fewer,
            "most_steps": short[1],
            "gradient_allreduces": short[2],
            "state": kept,
        },
    )
