"""The whole judgement of one run: a plain object every renderer takes."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.failed import causes
from ddpdoctor.analysis.failed.failure import FailureView, RankEnd, failure_view
from ddpdoctor.analysis.findings import Finding, find_all
from ddpdoctor.analysis.misuse import frameworks
from ddpdoctor.analysis.misuse.models import ddp_models
from ddpdoctor.analysis.slow import gpu, gpu_findings, views
from ddpdoctor.analysis.slow.gradsync import bucket_layout, bucket_stats, untimed_by_cost
from ddpdoctor.analysis.slow.phases import rank_phases, step_time_stats
from ddpdoctor.analysis.slow.views import Lateness
from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import distinct
from ddpdoctor.trace.merge import TimeBase, time_base
from ddpdoctor.trace.reader import Run


@dataclass
class Diagnosis:
    run: Run
    phases: dict[int, dict[str, dict[str, Any]]]
    steps: dict[int, int]
    step_time_s: dict[int, dict[str, float]]
    batch_size: dict[str, int | None]
    ddp: dict[str, Any]  # the first DDP model's constructor record
    buckets: list[dict[str, Any]] = field(default_factory=list)  # gradient sync per bucket
    findings: list[Finding] = field(default_factory=list)
    gpus: gpu.GpuView | None = None  # the supervisor's NVML samples, when a node took any
    ddp_models: list[dict[str, Any]] = field(default_factory=list)  # every DDP model, in order
    time_base: TimeBase | None = None  # every rank on rank 0's clock
    lateness: Lateness | None = None  # at the gradient sync, rank x step
    bucket_layout: dict[int, dict[str, Any]] = field(default_factory=dict)  # index -> params, bytes
    framework: str | None = None  # "lightning", "accelerate", or None for plain DDP
    failure: FailureView | None = None  # a hung or failed run, drawn where it happened
    notes: list[str] = field(default_factory=list)  # what the recording lacks, and why

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def step_spans(self) -> dict[int, tuple[float, float]]:
        """Each training step's extent across ranks, s on the common base: computed on first use
        (the HTML timeline, a failure's window), not for ``diagnose``, which shows none of it
        (0.7 s at 1,024 ranks x 10,000 steps)."""
        return {} if self.time_base is None else run_step_spans(self.run, self.time_base)


def run_step_spans(run: Run, tb: TimeBase) -> dict[int, tuple[float, float]]:
    """``views.step_spans``, once per run."""
    return run.once("step_spans", lambda r: views.step_spans(r, tb))


def diagnose(run: Run) -> Diagnosis:
    """Statistics and findings for a run (pure: reads only the Run)."""
    with fewer_collections():
        return _diagnose(run)


# The analysis makes hundreds of thousands of small objects that live until it ends (each
# rank's ledger: 230,000 sync points at 1,024 ranks): at the default threshold (700) the
# collector runs a thousand times over them, half the ledgers' build time. None of them is
# garbage until the diagnosis is dropped; large arrays are freed by reference counting alone.
GC_THRESHOLD = 50_000


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector less often while the analysis runs (its first
    threshold raised to ``GC_THRESHOLD``), and restore the thresholds after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], GC_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _diagnose(run: Run) -> Diagnosis:
    # First: its (ranks, steps, buckets) cube is the largest transient, best built before the
    # straggler table (kept for the report's heatmap) exists.
    buckets = bucket_stats(run)
    phases = {rank: t.view(rank_phases) for rank, t in sorted(run.ranks.items())}
    steps = {rank: t.steps for rank, t in sorted(run.ranks.items())}
    tb = time_base(run)
    step_time_s: dict[int, dict[str, float]] = {}
    for rank, trace in sorted(run.ranks.items()):
        st = trace.view(step_time_stats)
        if st is not None:
            step_time_s[rank] = dict(st)
    framework = frameworks.detect(run)
    findings = fold_consequences(gpu_findings.join_stragglers(run, find_all(run)))
    causes.annotate(run, findings)
    frameworks.adapt(findings, framework)
    failure = failure_view(run, findings, tb, lambda: run_step_spans(run, tb))
    _one_step_rule(findings, failure)
    return Diagnosis(
        run=run,
        phases=phases,
        steps=steps,
        step_time_s=step_time_s,
        batch_size=batch_sizes(run),
        ddp=ddp_config(run),
        ddp_models=ddp_models(run),
        time_base=tb,
        lateness=views.lateness(run, tb),
        bucket_layout=bucket_layout(run),
        buckets=buckets,
        findings=findings,
        gpus=gpu.gpu_view(run),
        framework=framework,
        failure=failure,
        notes=[n for n in (untimed_by_cost(run),) if n],
    )


def _one_step_rule(findings: list[Finding], failure: FailureView | None) -> None:
    """The first failure's step as the failure view counts it (a rank that raises before step
    7's forward died at step 7), so the finding and the report's failure section agree; the
    last step the rank started stays in ``last_step_started``. The other ranks likewise, where
    their own records say where they stopped: the watcher's last look at their status files may
    be a publish interval old ("in ddp_init" while the rank waited in step 6)."""
    if failure is None:
        return
    for f in findings:
        rank = f.details.get("first_rank") if f.kind == "rank_failure" else None
        end = failure.ranks.get(rank) if isinstance(rank, int) else None
        if end is None or "at_step" not in f.details:
            continue
        old = f.details["at_step"]
        f.details.update(last_step_started=old, at_step=end.step)
        said = f"at step {old}" if isinstance(old, int) and old >= 0 else "before its first recorded step"
        f.summary = f.summary.replace(said, end.step_text, 1)
        others = f.details.get("others") or {}
        ends = [failure.ranks.get(int(r)) for r in others]
        told = {str(e.rank): _where_stopped(e) for e in ends if e is not None and (e.open_point or e.failed)}
        if told and ". Others then: " in f.summary:
            others.update(told)
            doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(others.items(), key=lambda kv: int(kv[0])))
            f.summary = f.summary[: f.summary.rindex(". Others then: ")] + f". Others then: {doing}"


def _where_stopped(end: RankEnd) -> str:
    text = end.step_text
    if end.open_point and end.open_point not in text:
        text += f", in {end.open_point}"
    if end.how == "exception":
        text += f", then raised {end.mark or 'an exception'}"
    elif end.failed:
        text += f", then {end.how_text}"
    return text


# Findings that report a symptom (another rank's error, the live hang verdict), not a cause.
_FOLDED = ("rank_failure",)
_LABELLED = ("hang",)


def fold_consequences(findings: list[Finding]) -> list[Finding]:
    """When the ledgers name a cause at error level, the other ranks' failures are its
    consequences: kept in its evidence, not beside it as causes. The live hang verdict stays
    (it is what ``run`` printed) and says which cause it is a consequence of."""
    from ddpdoctor.analysis.failed.causes import CAUSE_KINDS

    periodic = {r for f in findings if f.kind == "periodic_rank_work" for r in f.ranks}
    findings = [f for f in findings if not (f.kind == "straggler_occasional" and set(f.ranks) <= periodic)]
    causes = [f for f in findings if f.kind in CAUSE_KINDS and f.severity == "error"]
    if not causes:
        return findings
    cause = causes[0]
    root = cause.details.get("root_rank")
    label = f"{cause.kind}" + (f" on rank {root}" if root is not None else "")
    kept = []
    for f in findings:
        if f.kind in _FOLDED or (
            cause.kind == "awaited_work" and f.kind == "rank_only_work" and f.ranks == cause.ranks
        ):  # the same wait, already charged to the awaited work
            cause.details.setdefault("consequences", []).append(f"{f.kind}: {f.summary}")
            continue
        if f.kind in _LABELLED:
            f.details["consequence_of"] = {"kind": cause.kind, "root_rank": root}
            if f.details.get("pattern") == "backend_stuck":  # a rank is implicated: not the backend
                f.summary = f.summary.split(": the backend itself is stuck")[0] + "."
            # the pattern's own template is about the symptom: the cause's fix is the one to apply
            f.details["pattern_fix"] = f.fix
            f.fix = f"Fix the cause above ({label}): this hang follows from it."
            f.summary = f"(a consequence of {label}) {f.summary}"
        if f is not cause:
            kept.append(f)
    return [cause, *kept]  # the cause first: it is what to fix


def training_loader(trace: Any) -> dict[str, Any] | None:
    """The DataLoader that fed most batches on a rank (its last recorded pass)."""
    waits = trace.kind(schema.DATA_WAIT)
    loaders = trace.meta.get(schema.LOADER, [])
    if not loaders:
        return None
    ids, n = distinct(waits.ints(0), counts=True)
    counts = dict(zip(ids.tolist(), n.tolist(), strict=True))
    busiest = max(loaders, key=lambda rec: counts.get(rec[2].get("id"), 0))
    return busiest[2]


def batch_sizes(run: Run) -> dict[str, int | None]:
    """Per-process batch size (the training loader's) and the global one across ranks."""
    per_rank = {}
    for rank, trace in run.ranks.items():
        loader = training_loader(trace)
        if loader and isinstance(loader.get("batch_size"), int):
            per_rank[rank] = loader["batch_size"]
    if not per_rank:
        return {"per_process": None, "global": None}
    sizes = set(per_rank.values())
    per_process = sizes.pop() if len(sizes) == 1 else None
    complete = len(per_rank) == run.world_size
    global_size = (
        sum(per_rank.values())
        if complete
        else (per_process * run.world_size if per_process is not None else None)
    )
    return {"per_process": per_process, "global": global_size}


def ddp_config(run: Run) -> dict[str, Any]:
    """The first DDP model's constructor record, as rank 0 (or the lowest rank) saw it."""
    models = ddp_models(run)
    return models[0] if models else {}
