"""DDP misuse the seed articles warn about: unused parameters, samplers, set_epoch."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.phases import step_times
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run

_FIX_UNUSED = (
    "Either stop computing outputs that do not reach the loss (e.g. drop the unused head, or "
    "add it to the loss), or pass find_unused_parameters=True to DistributedDataParallel "
    "(it costs an autograd-graph walk after every forward)."
)


def _param_names(trace: RankTrace) -> list[str]:
    init = trace.kind(schema.DDP_INIT)
    return list(init.fields[-1][0].get("param_names", [])) if len(init) else []


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" (+{len(steps) - limit} more)" if len(steps) > limit else "")


def ddp_options(run: Run) -> dict[str, Any]:
    for _, trace in sorted(run.ranks.items()):
        init = trace.kind(schema.DDP_INIT)
        if len(init):
            return dict(init.fields[-1][0].get("options", {}))
    return {}


@detector
def unused_parameters(run: Run) -> Iterable[Finding]:
    per_param_steps: dict[str, set[int]] = defaultdict(set)
    per_param_ranks: dict[str, set[int]] = defaultdict(set)
    scope = "local"
    errors: dict[int, list[str]] = {}
    for rank, trace in sorted(run.ranks.items()):
        names = _param_names(trace)
        for _, step, info in trace.meta.get(schema.UNUSED, []):
            scope = info.get("scope", scope)
            for i in info.get("params", []):
                name = names[i] if 0 <= i < len(names) else f"#{i}"
                per_param_steps[name].add(step)
                per_param_ranks[name].add(rank)
        for _, _, info in trace.meta.get(schema.DDP_ERROR, []):
            if info.get("error") == "unfinished_reduction":
                errors[rank] = list(info.get("params", []))
    for params in errors.values():
        for name in params:
            per_param_ranks.setdefault(name, set())
    if not per_param_ranks:
        return
    params = sorted(per_param_ranks)
    steps = sorted(set().union(*per_param_steps.values())) if per_param_steps else []
    ranks = sorted(set().union(*per_param_ranks.values()) | set(errors))
    total_steps = max((t.steps for t in run.ranks.values()), default=0)
    shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    details = {
        "parameters": params,
        "steps": steps,
        "per_parameter": {
            name: {"ranks": sorted(per_param_ranks[name]), "steps": sorted(per_param_steps[name])}
            for name in params
        },
        "ddp_error": bool(errors),
        "find_unused_parameters": scope == "global",
    }
    if scope == "global":  # find_unused_parameters=True copes with it: worth knowing, not wrong
        yield Finding(
            "unused_parameters",
            "info",
            ranks,
            f"{len(params)} parameter(s) got no gradient on some ranks in "
            f"{len(steps)} of {total_steps} steps ({shown}); find_unused_parameters=True is needed",
            fix="Nothing to do unless these parameters should be trained; if they should never be "
            "used, remove them and turn find_unused_parameters off.",
            details=details,
        )
        return
    where = f"at step(s) {_steps_text(steps)}" if steps else "before the crash"
    summary = (
        f"{len(params)} parameter(s) received no gradient {where} on rank(s) {rank_list(ranks)}: {shown}"
    )
    if errors:
        summary += "; DDP then raised 'Expected to have finished reduction in the prior iteration'"
    yield Finding("unused_parameters", "error", ranks, summary, fix=_FIX_UNUSED, details=details)


@detector
def find_unused_parameters_unneeded(run: Run) -> Iterable[Finding]:
    if not ddp_options(run).get("find_unused_parameters"):
        return
    if any(t.meta.get(schema.UNUSED) for t in run.ranks.values()):
        return
    steps = min((t.steps for t in run.ranks.values()), default=0)
    if steps < 3:
        return
    scans = np.concatenate([t.kind(schema.GRAPH_SCAN).dur for t in run.ranks.values()])
    step_s = np.concatenate([step_times(t) for t in run.ranks.values()])
    scan_ms = float(np.median(scans)) / 1e3 if len(scans) else 0.0
    step_ms = float(np.median(step_s)) * 1e3 if len(step_s) else 0.0
    cost = f"; the walk takes {scan_ms:.2f} ms per step" if len(scans) else ""
    if step_ms:
        cost += f" ({100 * scan_ms / step_ms:.1f}% of a {step_ms:.1f} ms step)"
    yield Finding(
        "find_unused_parameters_unneeded",
        "warning",
        sorted(run.ranks),
        f"find_unused_parameters=True, but every parameter got a gradient in all {steps} steps on "
        f"every rank: DDP walks the autograd graph after each forward for nothing{cost}",
        fix="Construct DistributedDataParallel without find_unused_parameters (or with "
        "static_graph=True if the graph never changes).",
        details={"steps": steps, "graph_walk_ms": round(scan_ms, 3), "step_ms": round(step_ms, 3)},
    )


def training_loaders(trace: RankTrace) -> dict[int, int]:
    """Loader id -> batches it fed into a grad-mode DDP forward on this rank."""
    waits, fwd = trace.kind(schema.DATA_WAIT), trace.kind(schema.FORWARD)
    if not len(waits) or not len(fwd):
        return {}
    order = np.argsort(fwd.ts, kind="stable")
    fwd_ts = fwd.ts[order]
    grad = np.array([f[0] == 1 for f in fwd.fields], dtype=bool)[order]
    nxt = np.searchsorted(fwd_ts, waits.ts)
    counts: dict[int, int] = defaultdict(int)
    for i, j in enumerate(nxt):
        if j < len(fwd_ts) and grad[j] and waits.fields[i]:
            counts[waits.fields[i][0]] += 1
    return dict(counts)


@detector
def sampler_misuse(run: Run) -> Iterable[Finding]:
    if run.world_size < 2:
        return
    missing: dict[int, dict[str, Any]] = {}
    no_epoch: dict[int, dict[str, Any]] = {}
    for rank, trace in sorted(run.ranks.items()):
        fed = training_loaders(trace)
        passes: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for _, _, info in trace.meta.get(schema.LOADER, []):
            if info.get("id") in fed:
                passes[info.get("sampler_id", info.get("id"))].append(info)
        for infos in passes.values():
            info = infos[-1]
            if info.get("sampler") in ("RandomSampler", "SequentialSampler"):
                missing[rank] = info
            elif "DistributedSampler" in str(info.get("sampler")) and info.get("shuffle"):
                epochs = {i.get("epoch") for i in infos}
                if len(infos) >= 2 and len(epochs) == 1:
                    no_epoch[rank] = dict(info, passes=len(infos))
    if missing:
        info = next(iter(missing.values()))
        yield Finding(
            "missing_distributed_sampler",
            "warning",
            sorted(missing),
            f"the training DataLoader uses a {info['sampler']} on rank(s) {rank_list(missing)}: "
            f"every rank reads all {info.get('dataset_len', '?')} samples, so the ranks train on "
            "the same data (unless your dataset is already split per rank)",
            fix="Pass sampler=DistributedSampler(dataset) to the DataLoader (and drop shuffle=True "
            "there), then call sampler.set_epoch(epoch) at the start of every epoch.",
            details={
                "sampler": info["sampler"],
                "dataset_len": info.get("dataset_len"),
                "batch_size": info.get("batch_size"),
                "ranks": sorted(missing),
            },
        )
    if no_epoch:
        info = next(iter(no_epoch.values()))
        yield Finding(
            "missing_set_epoch",
            "warning",
            sorted(no_epoch),
            f"the shuffling DistributedSampler stayed at epoch {info.get('epoch')} for all "
            f"{info['passes']} passes over the data: every epoch replays the same order",
            fix="Call sampler.set_epoch(epoch) at the start of each epoch, before iterating the DataLoader.",
            details={"epoch": info.get("epoch"), "passes": info["passes"], "ranks": sorted(no_epoch)},
        )
