"""The terminal summary printed after `ddpdoctor run` and by `ddpdoctor diagnose`: 80 columns."""

from __future__ import annotations

import textwrap
from typing import Any

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.misuse.models import alike_runs

WIDTH = 80
_MARK = {"error": "ERROR", "warning": "WARN ", "info": "info "}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def render(diag: Diagnosis, *, max_findings: int = 8, report: str | None = None) -> str:
    """The summary; ``report`` is the HTML report's path (or why none was written)."""
    run = diag.run
    lines = [f"ddpdoctor: {run.world_size} rank(s) on {len(run.hosts)} host(s)"]
    if run.exit_code is not None:
        lines[0] += f", exit code {run.exit_code}"
    if diag.framework:
        lines[0] += f", under {diag.framework.capitalize()}"
    bs = diag.batch_size
    if bs.get("per_process"):
        lines.append(f"  batch size {bs['per_process']} per process, {bs['global']} global")
    lines.extend(_models(diag))
    lines.append("")
    header = f"  {'rank':>5} {'steps':>6} {'step p50':>9} {'fwd':>8} {'bwd':>8} {'data':>8} {'opt':>8}"
    lines.append(header)
    lines.append("  " + "-" * (len(header) - 2) + "  (ms, mean)")
    attached = any(m.get("attached") for m in run.metas)  # stacks only: no step was recorded

    def steps(rank: int) -> str:
        return "?" if attached else str(diag.steps.get(rank, 0))

    for rank in sorted(run.ranks):
        ph = diag.phases.get(rank, {})
        st = diag.step_time_s.get(rank)

        def mean(name: str, ph: dict = ph) -> str:
            return _ms(ph[name]["mean_s"]) if name in ph else "-"

        lines.append(
            f"  {rank:>5} {steps(rank):>6} {(_ms(st['p50']) if st else '-'):>9} "
            f"{mean('forward'):>8} {mean('backward'):>8} {mean('data_wait'):>8} {mean('optimizer'):>8}"
        )
    lines.extend(gpu_lines(diag))
    lines.append("")
    lines.extend(failure_lines(diag))
    shown = diag.findings[:max_findings]
    if not any(f.severity in ("error", "warning") for f in diag.findings):
        lines.append("  No problems found." + (" Notes:" if shown else ""))
    for f in shown:
        ranks = f" [rank {rank_list(f.ranks)}]" if f.ranks else ""
        lines.extend(
            textwrap.wrap(
                f"{_MARK.get(f.severity, f.severity)} {f.kind}{ranks}: {f.summary}",
                WIDTH - 2,
                initial_indent="  ",
                subsequent_indent="        ",
            )
        )
        if f.fix:
            lines.extend(
                textwrap.wrap(
                    f"fix: {f.fix}", WIDTH - 2, initial_indent="        ", subsequent_indent="        "
                )
            )
    if len(diag.findings) > max_findings:
        lines.append(f"  ... and {len(diag.findings) - max_findings} more (diagnose --json)")
    for note in run.notes + diag.notes:
        lines.extend(textwrap.wrap(f"note: {note}", WIDTH - 2, initial_indent="  ", subsequent_indent="    "))
    if report:
        lines.append(f"  report: {report}")
    return "\n".join(lines)


def failure_lines(diag: Diagnosis, max_lines: int = 8) -> list[str]:
    """On a hung or failed run, where each rank stopped (ranks that stopped alike on one line):
    what the report's failure section opens with. Nothing for a healthy run."""
    view = diag.failure
    if view is None:
        return []
    from ddpdoctor.analysis.hung.hang import group_ranks

    seconds = {}
    for span in view.open_spans:
        seconds[span.rank] = max(seconds.get(span.rank, 0.0), span.seconds)
    alike = {
        e.rank: (
            e.mark or e.how_text,
            e.step_text,
            e.open_point,
            round(seconds.get(e.rank, 0.0), 1),
            e.user_frame,
        )
        for e in view.ranks.values()
    }
    lines = ["  Where each rank stopped (the report opens on it):"]
    groups = group_ranks(alike)
    for ranks, (how, step, point, secs, user) in groups[:max_lines]:
        text = f"rank {rank_list(ranks)}: {how}, {step}"
        if point:
            text += f"; {point} did not finish ({secs:g} s)"
        if user:
            text += f"  <- {user}"
        lines.extend(textwrap.wrap(text, WIDTH - 2, initial_indent="    ", subsequent_indent="      "))
    if len(groups) > max_lines:
        lines.append(f"    ... and {len(groups) - max_lines} more (diagnose --json)")
    return [*lines, ""]


def gpu_lines(diag: Diagnosis, max_gpus: int = 8) -> list[str]:
    """One line per GPU (mean/peak), and at most one line on what NVML could not give."""
    from ddpdoctor.analysis.slow.gpu import device_stats

    view = diag.gpus
    if view is None:
        return []
    lines = []
    shown = view.devices[:max_gpus]
    many_hosts = len({d.host for d in view.devices}) > 1
    if shown:
        lines.append("")
    for dev in shown:
        st = device_stats(view, dev)

        def mp(key: str, unit: str, scale: float = 1.0, st: dict = st) -> str:
            v = st.get(key)
            return f"{v['mean'] / scale:.0f}/{v['peak'] / scale:.0f}{unit}" if v else "-"

        mem = st.get("mem_used_bytes")
        total = st.get("mem_total_bytes")
        mem_text = f"{mem['peak'] / 2**30:.1f}" if mem else "-"
        mem_text += f"/{total / 2**30:.0f} GiB" if total else " GiB"
        who = f"rank {rank_list(dev.ranks)}" if dev.ranks else "no rank"
        throttled = st.get("throttled_share")
        extra = f" throttled {throttled:.0%}" if throttled else ""
        line = (
            f"{dev.host + ' ' if many_hosts else ''}GPU {dev.index} {who}: util "
            f"{mp('util_pct', '%')} mem {mem_text} {mp('power_w', 'W')} {mp('sm_clock_mhz', 'MHz')} "
            f"{mp('temp_c', 'C')}{extra}"
        )
        lines.extend(textwrap.wrap(line, WIDTH - 2, initial_indent="  ", subsequent_indent="    "))
    if len(view.devices) > max_gpus:
        lines.append(f"  ... and {len(view.devices) - max_gpus} more GPU(s) (diagnose --json)")
    if shown:
        lines.append("  (GPUs: mean/peak over the run; mem: peak used/total)")
    if view.missing:
        text = f"GPU: {view.missing}"
        lines.extend(textwrap.wrap(text, WIDTH - 2, initial_indent="  ", subsequent_indent="    "))
    return lines


def _models(diag: Diagnosis) -> list[str]:
    """One line per DDP model, or per run of wrappers alike (``models.alike_runs``)."""
    models = diag.ddp_models or ([diag.ddp] if diag.ddp else [])
    lines = []
    for name, group in alike_runs(models):
        ddp, opts = group[0], group[0].get("options", {})
        lines.append(
            f"  DDP: {name} with {ddp.get('params', 0):,} parameters, "
            f"{_buckets(ddp, diag.bucket_layout if len(models) == 1 else {})}, "
            f"find_unused_parameters={opts.get('find_unused_parameters')}"
        )
    return lines


def _buckets(ddp: dict[str, Any], layout: dict[int, Any]) -> str:
    """The buckets the job trained with: DDP rebuilds them in gradient order after the first
    step, so the constructor's count (often 1) is not what the all-reduces used."""
    built = len(ddp.get("buckets", []))
    if not layout:  # the rebuilt layout is recorded with bucket timing, or when it is decided
        return f"{built} bucket(s) at construction"
    if len(layout) == built:
        return f"{built} bucket(s)"
    return f"{len(layout)} bucket(s) ({built} at construction, rebuilt after the first step)"
