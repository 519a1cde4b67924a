"""Ranks that silently disagree: model replicas whose weights or buffers are not the same.

Each rank fingerprints every tensor of every DDP model at construction, after optimizer steps
at steps common to all ranks, and at exit (``probes/fingerprint.py``). Here the fingerprints
of each check are compared across ranks, tensor by tensor; a tensor that differs is traced to
the first check where it differed and the last where it was equal, and to a cause from what
else was recorded: a parameter DDP never registered (added after construction, unfrozen after
wrapping, or outside every DDP model) never has its gradient all-reduced; weights equal after
the constructor's broadcast but different after the first optimizer step were changed after
wrapping (a ``load_state_dict`` on some ranks names the line); later divergence of a
registered parameter comes from rank-dependent updates or optimizer state, and where the
parameters' version counters moved more on some ranks, from in-place writes there. Buffers
that DDP broadcasts every forward are expected to differ between forwards; BatchNorm
statistics with ``broadcast_buffers=False`` differ by design (a note).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.misuse import settings, stepped
from ddpdoctor.analysis.misuse.buffers import buffers_differ
from ddpdoctor.analysis.misuse.fingerprints import (
    Divergence,
    Key,
    Series,
    collect,
    compare,
    grads_written,
    odd_ranks,
    sized,
    stepped_apart,
    when_checked,
    written_in_place,
)
from ddpdoctor.analysis.misuse.models import builder, ddp_models, wrapped_at
from ddpdoctor.analysis.misuse.places import (
    changed_in_forward,
    in_forward,
    in_place_anywhere,
    in_script_after,
    in_script_after_wrapping,
    in_script_grads,
    in_script_later,
    loads_of,
)
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

_FIX_LOAD = (
    "Load the checkpoint before wrapping the model in DistributedDataParallel (its constructor "
    "broadcasts rank 0's weights to every rank), on every rank; or, after loading on one rank, "
    "broadcast the state: for t in model.module.state_dict().values(): dist.broadcast(t, src=0)."
)
_FIX_DRIFT = (
    "Make every rank apply the same update (no rank-dependent in-place changes to the weights, "
    "the same optimizer state everywhere); after changing weights on one rank, broadcast them: "
    "for t in model.module.state_dict().values(): dist.broadcast(t, src=0)."
)
_FIX_GRADS = (
    "Change the gradients alike on every rank, or not at all, between backward() and "
    "optimizer.step(): clip, scale or mask them on every rank at every step; where one rank only "
    "wants their norm (for logging), read it without writing them: torch.nn.utils.get_total_norm("
    "[p.grad for p in model.parameters() if p.grad is not None]), not clip_grad_norm_."
)
_FIX_WRITE = (
    "make that change before wrapping the model in DistributedDataParallel (its constructor "
    "broadcasts rank 0's weights to every rank), or the same on every rank (one seed for an "
    "initialisation), or broadcast the weights after it: for t in "
    "model.module.state_dict().values(): dist.broadcast(t, src=0)."
)
_FIX_STEPPED = (
    "Give every rank the same step: scale, clip, mask or add noise to the gradients with values "
    "every rank shares (a count all_reduce'd first, the loss scaled before backward, noise from a "
    "generator seeded alike on every rank), never a number or a random draw of the rank's own "
    "after DDP's all-reduce; keep optimizer state the same on every rank."
)
_FIX_FORWARD = (
    "Keep the forward from changing the weights in place: each rank changes them by its own "
    "batch. Make the change after optimizer.step(), the same on every rank and to the whole "
    "tensor (under torch.no_grad()), or not at all."
)
_FIX_MAX_NORM = (
    " nn.Embedding's max_norm renormalises only the rows the batch looked up: drop it and "
    "renormalise the whole table after each step."
)
_FIX_OPTIMIZER = (
    "Load the optimizer state on every rank (each rank keeps its own copy), or broadcast it "
    "from rank 0 before training resumes."
)


@detector
def replicas_differ(run: Run) -> Iterable[Finding]:
    if len(run.ranks) < 2:
        return
    models = ddp_models(run)
    seen = False  # weights found apart: what made them so is said there
    for (model, opt), series in sorted(collect(run).items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        found = compare(series)
        info = models[model] if 0 <= model < len(models) else {}
        label = str(info.get("module", "model")) if model >= 0 else f"optimizer #{opt}"
        registered = set(info.get("param_names") or [])
        init = next(iter(series.init_names.values()), ())
        unsynced = {n: r for n, r in series.unsynced.items()}
        if model < 0 or unsynced:
            yield from _not_synced(series, found, unsynced, model, label, init)
        skip = set(unsynced)
        weights = [d for d in found if not d.buffer and d.name not in skip]
        if weights:
            seen = True
            yield _weights(run, series, weights, model, label, registered)
        buffers = [d for d in found if d.buffer]
        if buffers and not info.get("options", {}).get("broadcast_buffers", True):
            owner = builder(run)  # the rank ``models`` came from
            written = in_place_anywhere(run, [d.name for d in buffers])
            yield buffers_differ(
                series, buffers, label, info, wrapped_at(owner, info) if owner else "", written
            )
    if not seen and (behind := stepped.behind_finding(run)) is not None:
        yield behind


_NOT_SYNCED = {
    "outside_ddp": (
        "the optimizer trains them but they belong to no DistributedDataParallel model (a module "
        "left out of DDP)",
        "Wrap the whole model in one DistributedDataParallel (put every trained submodule inside the "
        "module you wrap), or wrap the other module in its own DistributedDataParallel.",
    ),
    "added_after_wrapping": (
        "they were added to the model after DistributedDataParallel was constructed, so DDP never "
        "registered them for the gradient all-reduce",
        "Create every parameter before wrapping the model in DistributedDataParallel, or rebuild the "
        "wrapper after adding them: model = DDP(model.module, ...).",
    ),
    "requires_grad_after_wrapping": (
        "they did not require grad when DistributedDataParallel was constructed (requires_grad was "
        "turned on after wrapping), so DDP never registered them for the gradient all-reduce",
        "Set requires_grad before wrapping, or rebuild the wrapper after unfreezing: "
        "model = DDP(model.module, ...) (DDP registers only the parameters that require grad).",
    ),
}


def _not_synced(
    series: Series, found: list[Divergence], unsynced: dict[str, set[int]], model: int, label: str,
    init: tuple[str, ...],
) -> Iterable[Finding]:  # fmt: skip
    """Parameters that train outside every gradient bucket, one finding per cause."""
    differ = {d.name: d for d in found}
    by_cause: dict[str, list[str]] = defaultdict(list)
    for name in unsynced:
        cause = (
            "outside_ddp"
            if model < 0
            else "added_after_wrapping"
            if name not in init
            else "requires_grad_after_wrapping"
        )
        by_cause[cause].append(name)
    for cause, names in by_cause.items():
        why, fix = _NOT_SYNCED[cause]
        diverged = [n for n in names if n in differ]
        ranks = sorted(set().union(*(unsynced[n] for n in names)))
        first = min((differ[n].first for n in diverged), default=None)
        since = f"; the ranks' values differ since {when_checked(first)}" if first else ""
        total = sum(series.numels.get(n, 0) for n in names)
        yield Finding(
            "gradients_not_synced",
            "error" if diverged else "warning",
            ranks,
            f"{label}: {len(names)} parameter(s) train on rank(s) {rank_list(ranks)} outside every "
            f"gradient bucket, so their gradients are never all-reduced: "
            f"{sized(names, series.numels)}{f' ({total:,} elements in all)' if len(names) > 1 else ''}: "
            f"{why}{since}",
            fix=fix,
            details={
                "model": model,
                "cause": cause,
                "parameters": names,
                "numels": {n: series.numels.get(n) for n in names},
                "diverged": diverged,
                "since_step": first[0] if first else None,
                "ranks": ranks,
            },
        )


def _weights(
    run: Run, series: Series, found: list[Divergence], model: int, label: str, registered: set[str]
) -> Finding:
    found.sort(key=lambda d: d.first)
    head = found[0]
    at_init = head.first[2] == "init"
    loads = loads_of(run, model, "model")
    opt_loads = loads_of(run, model, "optimizer")
    lo = -1 if head.last_equal is None else _ts_bound(series, head.last_equal)
    hi = _ts_bound(series, head.first, upper=True)
    loaders = {r: [e for e in events if lo <= e[0] <= hi] for r, events in loads.items()}
    loaders = {r: e for r, e in loaders.items() if e}
    odd = odd_ranks(head.groups, set(loaders))
    all_ranks = sorted(r for g in head.groups for r in g)
    opt_odd = set(opt_loads) and set(opt_loads) != set(all_ranks)
    place, setting = "", None
    apart = stepped_apart(series, found)  # the counters say no rank wrote them beyond its steps
    skipped = stepped.skipped_steps(run, head.last_equal[0] if head.last_equal else -1, head.first[0])
    if loaders and set(loaders) != set(all_ranks):
        rank = min(loaders)
        place = loaders[rank][0][2]
        cause = "weights_loaded_after_wrapping"
        why = f"rank(s) {rank_list(loaders)} loaded weights after wrapping (load_state_dict at {place})"
        fix = _FIX_LOAD
    elif _unreduced(run, head.first[0]):
        cause, fix = "gradients_not_reduced", "Fix the unused parameters (see unused_parameters)."
        why = "a step's gradient all-reduce never finished (parameters got no gradient, see "
        why += "unused_parameters), so each rank stepped with its own gradients"
    elif at_init:
        cause, fix = "not_broadcast", _FIX_LOAD
        why = "they already differed right after DDP's constructor (parameters DDP does not broadcast)"
    elif unsynced := stepped.unsynced_steps(run):
        cause, fix, why = "stepped_without_sync", stepped.FIX_UNSYNCED, stepped.unsynced_text(unsynced)
        odd = odd_ranks(head.groups, set(unsynced))
        place, decided = stepped.decided_at(run, unsynced)
        why += decided
    elif (edited := changed_in_forward(run, model)) and all(d.name in edited for d in found):
        cause = "changed_in_forward"
        fix = _FIX_FORWARD + (_FIX_MAX_NORM if any("max_norm" in edited[d.name] for d in found) else "")
        owners = sorted({f"{n} ({edited[n]})" if edited[n] else n for n in (d.name for d in found)})
        why = "the forward changes them in place, each rank by its own batch (the model's first "
        why += f"forward moved the version counter of {', '.join(owners)})"
        if (wrote := in_forward(run, {d.name: edited[d.name] for d in found})) is not None:
            place, said = wrote
            why += f"; the script does it at {said}"
            fix = f"Start at {said}. " + fix
    elif not opt_odd and not skipped and (setting := settings.first_difference(run, head.first[0])):
        cause, fix, why = "optimizer_settings_differ", settings.FIX, setting.text()
        place = setting.place
        fix = f"Start at {place}. {fix}" if setting.written else fix
        odd = odd_ranks([ranks for _, ranks in setting.by_value], set())
    elif (grads := grads_written(series, found)) is not None:
        odd, key = sorted(grads[0]), grads[1]
        cause, fix = "gradients_written_on_rank", _FIX_GRADS
        wrote = sorted({n for names in grads[0].values() for n in names})
        why = f"rank(s) {rank_list(odd)} wrote their gradients in place after DDP's all-reduce "
        why += f"({when_checked(key)}, the version counters of the gradients of {sized(wrote, {}, 3)} "
        why += "had moved further there than on the other ranks, where the reduced gradients are written "
        why += "alike): a clip, a scale or a mask there alone, so those ranks stepped with other gradients"
    elif head.last_equal is not None and head.last_equal[2] == "init" and head.first[0] <= 0 and not apart:
        cause, fix = "changed_after_wrapping", _FIX_LOAD
        why = "they were equal after DDP's constructor broadcast and changed before the first optimizer "
        why += "step ended: weights loaded or changed on some rank after wrapping"
        writes = written_in_place(series, found)
        if writes is not None and set(writes[0]) != set(all_ranks):  # whose counters say it wrote them
            odd = sorted(writes[0])
            moves = ", ".join(f"{n} on rank {r}" for r, n in sorted(writes[0].items()))
            why += (
                f" (rank(s) {rank_list(odd)}: the version counters moved beyond the optimizer step, {moves})"
            )
        if (wrote := in_script_after_wrapping(run, model, [d.name for d in found])) is not None:
            place, text = wrote
            why += f"; the script writes them after wrapping: {text}"
            fix = f"Start at {place}: " + _FIX_WRITE
    elif opt_odd:
        cause, fix = "optimizer_state_differs", _FIX_OPTIMIZER
        odd, place = sorted(opt_loads), opt_loads[min(opt_loads)][0][2]
        why = f"rank(s) {rank_list(opt_loads)} loaded optimizer state the others did not "
        why += f"(load_state_dict at {place})"
    elif skipped:
        cause, fix, why = "optimizer_steps_skipped", stepped.FIX, stepped.why(skipped)
        odd = odd_ranks(head.groups, set(skipped))
    elif (short := stepped.behind(run)) is not None:
        cause, fix = "optimizer_steps_skipped", stepped.FIX_BEHIND
        why = stepped.behind_text(*short) + ", so its optimizer state fell behind and the same averaged "
        why += "gradients moved the replicas apart"
        odd = sorted(short[0])
    elif (writes := written_in_place(series, found)) is not None:
        excess, written = writes
        odd, rest = sorted(excess), sorted(set(all_ranks) - set(excess))
        cause, fix = "written_on_rank", _FIX_DRIFT
        moves = ", ".join(f"{n} on rank {r}" for r, n in sorted(excess.items()))
        counters = f"(their version counters moved more than the optimizer steps account for: {moves})"
        if rest:
            why = (
                f"rank(s) {rank_list(odd)} wrote {written} of them in place beyond the optimizer steps "
                f"every rank took, and rank(s) {rank_list(rest)} did not {counters}: a write on "
                f"rank(s) {rank_list(odd)} alone (a copy_, a reset or a rollback under torch.no_grad())"
            )
        else:
            why = (
                f"every rank wrote {written} of them in place beyond its optimizer steps, each its own "
                f"way {counters}: writes each rank decided alone (a reset, a re-draw or a rollback "
                "decided on its own data)"
            )
        if (later := in_script_later(run, model)) is not None:
            place, lines = later
            why += f"; the script writes them under a condition at {lines}"
            fix = f"Start at {lines}. " + fix
        elif (later := in_script_after(run, model, [d.name for d in found])) is not None:
            place, lines = later
            why += f"; the script writes them at {lines}"
            fix = f"Start at {lines}. " + fix
    elif apart:
        cause, fix = "stepped_apart", _FIX_STEPPED
        why = "no rank wrote them beyond its optimizer steps (their version counters), so the steps "
        why += "themselves parted them: the ranks stepped with other gradients (scaled, clipped or "
        why += "divided by a number of the rank's own after backward, once DDP's all-reduce had "
        why += "averaged them) or other optimizer state"
        if (wrote := in_script_grads(run, model)) is not None:
            place, lines, only = wrote
            why += f"; the script writes gradients after the wrapping at {lines}"
            fix = f"Start at {lines}. " + fix
            odd = [only] if only is not None and only in all_ranks else odd
    else:
        cause, fix = "diverged_during_training", _FIX_DRIFT
        why = "a rank-dependent update changed them during training (every gradient was all-reduced)"
    names = [d.name for d in found]
    trainable = [n for n in names if n in registered]
    who = (
        f"on rank(s) {rank_list(odd)} from the other ranks"
        if len(odd) < len(all_ranks)
        else f"across ranks {rank_list(all_ranks)} (each holds its own values)"
    )
    since = ("since " if head.first[2] == "step" else "") + when_checked(head.first)
    summary = (
        f"{label}: {len(names)} parameter(s) differ {who} {since} (equal "
        f"{when_checked(head.last_equal)}): {sized(names, series.numels)}: {why}"
    )
    still = [d.name for d in found if d.still]
    if not still:
        summary += "; equal again at the last check"
    root = odd[0] if len(odd) == 1 else None
    severity = "error" if trainable or not registered else "warning"
    if cause == "gradients_not_reduced":  # a consequence: the cause has its own finding
        severity, summary = "info", f"(a consequence of unused_parameters) {summary}"
    return Finding(
        "weights_diverged",
        severity,
        odd,
        summary,
        fix=fix,
        details={
            "model": model,
            "parameters": names,
            "per_parameter": {
                d.name: {
                    "since_step": d.first[0],
                    "since": d.first[2],
                    "last_equal_step": d.last_equal[0] if d.last_equal else None,
                    "groups": d.groups,
                    "numel": series.numels.get(d.name),
                    "still_differs": d.still,
                }
                for d in found
            },
            "since_step": head.first[0],
            "since": when_checked(head.first),
            "last_equal": when_checked(head.last_equal),
            "cause": cause,
            "setting": {"name": setting.name, "step": setting.step, "values": setting.by_value}
            if setting is not None
            else None,
            "place": place or None,
            "root_rank": root,
            "ranks_by_value": head.groups,
        },
    )


def _unreduced(run: Run, step: int) -> bool:
    """Some rank had parameters without a gradient, with find_unused_parameters off, by ``step``:
    DDP never finished that step's reduction (and raises at the next forward)."""
    for trace in run.ranks.values():
        for _, at, info in trace.meta.get(schema.UNUSED, []):
            if info.get("scope") == "local" and at <= step:
                return True
        if any(i.get("error") == "unfinished_reduction" for _, _, i in trace.meta.get(schema.DDP_ERROR, [])):
            return True
    return False


def _ts_bound(series: Series, key: Key, upper: bool = False) -> int:
    """The earliest (or latest) time any rank took the check ``key``."""
    times = [c[key].ts for c in series.checks.values() if key in c]
    return (max if upper else min)(times) if times else (2**62 if upper else -1)
