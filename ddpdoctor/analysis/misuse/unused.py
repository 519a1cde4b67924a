"""Unused parameters: which parameters got no gradient, on which ranks and steps, and the branch
of the model's forward that left their submodule out (read from the source); a parameter no
rank ever trains (hidden by find_unused_parameters=True); and the flag set where every
parameter always gets a gradient (a graph walk per step for nothing)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.failed.ledger import build
from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.misuse.leftout import passed_to_module, skips_module
from ddpdoctor.analysis.misuse.models import ddp_models, label, model_of, wrapped_at
from ddpdoctor.analysis.misuse.unread import dropped_at, key_read, output_of
from ddpdoctor.analysis.slow.phases import step_times
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

_FIX_UNUSED = (
    "Either stop computing outputs that do not reach the loss (e.g. drop the unused head, or "
    "add it to the loss), or pass find_unused_parameters=True to DistributedDataParallel "
    "(it costs an autograd-graph walk after every forward)."
)


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" (+{len(steps) - limit} more)" if len(steps) > limit else "")


@detector
def unused_parameters(run: Run) -> Iterable[Finding]:
    per_param_steps: dict[str, set[int]] = defaultdict(set)
    per_param_ranks: dict[str, set[int]] = defaultdict(set)
    sizes: dict[str, int] = {}  # name -> elements, from the constructor's record
    wrapped = ""  # where the model was wrapped in DDP (the user's line), from the same record
    scope = "local"
    errors: dict[int, list[str]] = {}
    trained: set[str] = set()  # with find_unused_parameters: used on some rank in some step
    for rank, trace in sorted(run.ranks.items()):
        for _, step, info in trace.meta.get(schema.UNUSED, []):
            model = model_of(trace, info)
            wrapped = wrapped or wrapped_at(trace, model)
            names = list(model.get("param_names", []))
            sizes.update(zip(names, model.get("param_numels") or [], strict=False))
            scope = info.get("scope", scope)
            used = info.get("used_on_ranks") or []
            for j, i in enumerate(info.get("params", [])):
                name = names[i] if 0 <= i < len(names) else f"#{i}"
                per_param_steps[name].add(step)
                per_param_ranks[name].add(rank)
                if j < len(used) and used[j]:
                    trained.add(name)  # some rank gave it a gradient in this step
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
    sized = [f"{n} ({sizes[n]:,} elements)" if n in sizes else n for n in params[:6]]
    shown = ", ".join(sized) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    details = {
        "parameters": params,
        "steps": steps,
        "per_parameter": {
            name: {
                "ranks": sorted(per_param_ranks[name]),
                "steps": sorted(per_param_steps[name]),
                "numel": sizes.get(name),
            }
            for name in params
        },
        "ddp_error": bool(errors),
        "find_unused_parameters": scope == "global",
    }
    branch = _skipping_branch(run, params)
    if scope == "global":
        found = _unused_found(params, steps, total_steps, trained, ranks, details, wrapped)
        if branch is not None:
            found.summary += branch["text"]
            found.details.setdefault("place", branch["place"])
            if not branch.get("some_steps"):  # a branch that skips it is what the flag is for
                found.fix = branch["fix"] + found.fix
        yield found
        return
    where = f"at step(s) {_steps_text(steps)}" if steps else "before the crash"
    summary = (
        f"{len(params)} parameter(s) received no gradient {where} on rank(s) {rank_list(ranks)}: {shown}"
    )
    if errors:
        summary += "; DDP then raised 'Expected to have finished reduction in the prior iteration'"
    fix = _FIX_UNUSED
    if branch is not None:
        summary += branch["text"]
        details["place"] = branch["place"]
        fix = branch["fix"] + fix
    yield Finding("unused_parameters", "error", ranks, summary, fix=fix, details=details)


def _skipping_branch(run: Run, params: list[str]) -> dict[str, str] | None:
    """Where the user's files (those the run's records name) leave the unused parameters'
    submodule out: a branch of the model's forward (``leftout.skips_module``), or its output
    left out of the loss (``unread``). {"text" for the summary, "place", "fix" (its first
    sentence), "some_steps" where a branch skips it on some steps}."""
    attrs = {n.split(".", 1)[0] for n in params if "." in n}
    owners = [m for m in ddp_models(run) if set(params) <= set(m.get("param_names") or [])]
    if len(attrs) != 1 or not owners:
        return None
    (attr,) = attrs
    cls = str(owners[0].get("module", ""))
    paths = sorted({path for lg in build(run).values() for path in lg.files.values() if path})
    for path in paths:
        found = skips_module(path, cls, attr)
        if found is None:
            left = _left_out(run, paths, path, cls, attr)
            if left is not None:
                return left
            continue
        name = os.path.basename(path)
        place = f"{name}:{found['line']}"
        use = f"self.{attr} ({name}:{found['use']})"
        if found["how"] == "never":
            made = f"{name}:{found['use']}"
            text = f"; {cls}.forward ({place}) never uses self.{attr}, which __init__ makes at {made}"
            return {
                "text": text,
                "place": place,
                "fix": f"Use self.{attr} in the forward ({place}) or remove it. ",
            }
        if found["how"] == "elsewhere":
            method = f"{cls}.{found['method']}"
            text = f"; {cls}.forward never uses self.{attr}; only {method} does ({place})"
            fix = (
                f"Keep self.{attr} out of the module DDP wraps (only {method}() uses it, {place}), "
                "or freeze it with requires_grad_(False) before wrapping. "
            )
            return {"text": text, "place": place, "fix": fix}
        if found["how"] == "guard":
            how = f"every use of {use} is under `{found['code']}` ({place})"
        else:
            how = f"`{found['code']}` under `if {found['test']}:` ({place}) returns before {use}"
        text = f"; in {cls}.forward ({name}:{found['forward']}), {how}"
        for site in _forward_sites(run):  # the test is a parameter: what the model's call passed
            spath, line = _site_path(run, site)
            passed = passed_to_module(spath, line, found["params"], found["test"]) if spath else None
            if passed is not None:
                text += f", and `{found['test']}` is `{passed}` where the model is called ({site})"
                place = site
                break
        fix = f"Start at {place}, which leaves self.{attr} out on some steps. "
        return {"text": text, "place": place, "fix": fix, "some_steps": "yes"}
    return None


def _left_out(run: Run, paths: list[str], path: str, cls: str, attr: str) -> dict[str, str] | None:
    """``cls.forward`` in ``path`` runs ``self.<attr>`` and hands its output back, and the script
    leaves that output out of the loss: the dict key read only under an ``if`` or never, the
    tuple element dropped where the model is called (``unread``)."""
    out = output_of(path, cls, attr)
    if out is None:
        return None
    key, returned = out
    given = f"{cls}.forward returns self.{attr}'s output"
    at = f"{os.path.basename(path)}:{returned}"
    if isinstance(key, int):
        for site in _forward_sites(run):
            spath, line = _site_path(run, site)
            code = dropped_at(spath, line, key) if spath else None
            if code is not None:
                text = f"; {given} as element {key} of a tuple ({at}), which `{code}` drops ({site})"
                fix = f"Start at {site}, which drops self.{attr}'s output: add it to the loss, or stop "
                return {
                    "text": text,
                    "place": site,
                    "fix": fix + f"computing it (remove self.{attr}, or freeze it). ",
                }
        return None
    read = key_read(paths, key, cls)
    if read is None:
        return None
    if read["how"] == "never":
        text = f'; {given} as ["{key}"] ({at}), which the script never reads'
        fix = f'Add ["{key}"] to the loss, or stop computing it (remove self.{attr}, or freeze it). '
        return {"text": text, "place": at, "fix": fix}
    place = f"{os.path.basename(read['path'])}:{read['line']}"
    text = f'; {given} as ["{key}"] ({at}), which the script reads only under `{read["code"]}` ({place})'
    fix = (
        f'Start at {place}: while its test is false, ["{key}"] does not reach the loss and self.{attr} '
        "gets no gradient; build it only when the term is on, or freeze it with requires_grad_(False). "
    )
    return {"text": text, "place": place, "fix": fix}


def _unused_found(
    params: list[str],
    steps: list[int],
    total_steps: int,
    trained: set[str],
    ranks: list[int],
    details: dict[str, Any],
    wrapped: str = "",
) -> Finding:
    """With find_unused_parameters=True DDP copes with parameters that get no gradient; one that
    no rank trained in any step is still a waste (or a bug: a head cut off from the loss). The
    place is the DDP constructor's line, where the flag that hides it is set."""
    per = details["per_parameter"]
    never = [p for p in params if p not in trained and len(per[p]["steps"]) >= total_steps]
    shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    if never and total_steps > 0:
        named = ", ".join(never[:6]) + (f" and {len(never) - 6} more" if len(never) > 6 else "")
        at = f" (set where the model is wrapped, at {wrapped})" if wrapped else ""
        if wrapped:
            details = {**details, "place": wrapped}
        return Finding(
            "unused_parameters",
            "warning",
            ranks,
            f"{len(never)} parameter(s) never trained: no rank gave them a gradient in any of the "
            f"{total_steps} steps ({named}); find_unused_parameters=True{at} hides it (DDP skips "
            "them), at the cost of an autograd-graph walk every step",
            fix="If they should be trained, connect them to the loss (e.g. add the unused head's "
            "output to it); if not, remove them (or freeze them with requires_grad_(False)) and "
            "turn find_unused_parameters off.",
            details={**details, "never_trained": never},
        )
    return Finding(
        "unused_parameters",
        "info",
        ranks,
        f"{len(params)} parameter(s) got no gradient on some ranks in {len(steps)} of {total_steps} "
        f"steps ({shown}); find_unused_parameters=True lets DDP go on without them",
        fix="Nothing to do unless these parameters should be trained in those steps; if they "
        "should never be used, remove them and turn find_unused_parameters off.",
        details=details,
    )


@detector
def find_unused_parameters_unneeded(run: Run) -> Iterable[Finding]:
    models = ddp_models(run)
    searching = [m for m in models if m.get("options", {}).get("find_unused_parameters")]
    if not searching:
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
        f"{', '.join(label(m, models) for m in searching)}: "
        f"find_unused_parameters=True, but every parameter got a gradient in all {steps} steps on "
        f"every rank: DDP walks the autograd graph after each forward for nothing{cost}",
        fix="Construct DistributedDataParallel without find_unused_parameters (or with "
        "static_graph=True if the graph never changes).",
        details={
            "steps": steps,
            "graph_walk_ms": round(scan_ms, 3),
            "step_ms": round(step_ms, 3),
            "models": [m.get("index", 0) for m in searching],
        },
    )


def _site_path(run: Run, site: str) -> tuple[str, int]:
    """The file and line a ``file.py:LINE`` site names, as the ranks' ledgers know it."""
    return next((w for lg in build(run).values() if (w := lg.path_of(site))[0]), ("", 0))


def _forward_sites(run: Run) -> list[str]:
    """The lines that called the model in training (grad-mode forwards), most used first."""
    counts: dict[str, int] = defaultdict(int)
    for lg in build(run).values():
        for _step, grad, _training, site in lg.forwards:
            if grad and site:
                counts[site] += 1
    return sorted(counts, key=lambda s: -counts[s])
