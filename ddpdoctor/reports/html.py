"""The HTML report: one self-contained file (plotly.js embedded) that opens offline.

Sections: findings, run header, timeline (one row per rank; bucket all-reduces on a lane of
their own under it, so their overlap with backward shows), lateness at the gradient sync
(rank x step heatmap), rank x phase table, and GPU panels when metrics were recorded. The
timeline and the GPU panels have modules of their own; the page template, its CSS and its
scripts are files in ``assets/``. Every number shown comes from the Diagnosis.

It stays small and responsive at scale: each phase is one WebGL line trace with NaN gaps (never
a shape per event), the heatmap is one image, and when the run has more events than
``max_segments`` the timeline keeps the slowest steps (and the first ones) while the heatmap
and the table still cover every step.

Escaping: every string from the job (command, hosts, paths, module and parameter names,
finding text) goes through ``html.escape`` before it reaches either the page or a figure
(plotly would render tags in labels); figure JSON is written by plotly, which escapes ``<``,
``>`` and ``/`` inside the script.
"""

from __future__ import annotations

import json
import re
import shlex
import time
import warnings
from string import Template
from typing import Any

import numpy as np

import ddpdoctor
from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.misuse.models import alike_runs
from ddpdoctor.reports.failure import failure_section
from ddpdoctor.reports.gpu_panels import gpu_section
from ddpdoctor.reports.markup import asset, esc, figure_html, kv_table, template
from ddpdoctor.reports.timeline import MAX_SEGMENTS, rank_label, timeline_section
from ddpdoctor.trace import schema

MAX_HEATMAP_CELLS = 400_000  # about 3 MB of numbers in the page


def bin_steps(steps: list[int], z: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray, int]:
    """At most ``max_columns`` columns: runs of consecutive steps averaged into one (the
    heatmap of 1,024 ranks x 10,000 steps would be 10 million numbers in the page).
    Returns (the first step of each column, the matrix, steps per column)."""
    x = np.asarray(steps, dtype=np.int64)
    width = max(1, -(-len(steps) // max(1, max_columns)))
    if width == 1:
        return x, z, 1
    n = len(steps) // width * width
    head = z[:, :n].reshape(z.shape[0], -1, width)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN bins stay NaN
        cols = [np.nanmean(head, axis=2)]
        if n < len(steps):
            cols.append(np.nanmean(z[:, n:], axis=1, keepdims=True))
    return x[::width], np.concatenate(cols, axis=1).astype(np.float32), width


def heatmap_figure(diag: Diagnosis) -> Any:
    import plotly.graph_objects as go

    late = diag.lateness
    assert late is not None
    ranks = late.ranks
    ylabels = [rank_label(diag.run.ranks[r]) for r in ranks]
    x, z, width = bin_steps(late.steps, late.ms, MAX_HEATMAP_CELLS // max(1, len(ranks)))
    per = f" (mean of {width} steps from)" if width > 1 else ""
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=x.astype(np.int32),
            y=ylabels,
            colorscale="YlOrRd",
            zmin=0,
            colorbar={"title": {"text": "ms late"}},
            hovertemplate=f"%{{y}}<br>step{per} %{{x}}<br>%{{z:.2f}} ms after the first rank<extra></extra>",
            hoverongaps=False,
        )
    )
    fig.update_layout(
        template=template(),
        height=int(min(900, max(260, 14 * len(ranks) + 120))),
        margin={"l": 10, "r": 10, "t": 10, "b": 40},
        xaxis={"title": {"text": "step"}},
        yaxis={"autorange": "reversed", "type": "category"},
    )
    return fig


def _header_value(diag: Diagnosis, key: str) -> Any:
    for _, trace in sorted(diag.run.ranks.items()):
        if key in trace.header:
            return trace.header[key]
    return None


def header_section(diag: Diagnosis) -> str:
    tb = diag.time_base
    assert tb is not None
    run = diag.run
    hosts = sorted(run.hosts, key=lambda h: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", h)])
    host_text = ", ".join(esc(h) for h in hosts[:16]) + (
        f" … {len(hosts) - 16} more" if len(hosts) > 16 else ""
    )
    cmd = run.command or list(_header_value(diag, "argv") or [])
    rows = [
        ("command", f"<code>{esc(shlex.join(str(c) for c in cmd))}</code>" if cmd else "unknown"),
        ("world size", f"{run.world_size} ({len(run.ranks)} rank trace(s) read)"),
        ("hosts", f"{len(hosts)}: {host_text}"),
        ("backend", esc(_header_value(diag, "backend") or "?")),
        ("torch", esc(_header_value(diag, "torch") or "?")),
        ("exit code", esc(run.exit_code if run.exit_code is not None else "unknown")),
        ("steps", esc(_steps_text(diag))),
    ]
    bs = diag.batch_size
    if bs.get("per_process") or bs.get("global"):
        rows.append(
            (
                "batch size",
                f"{esc(bs.get('per_process') or '?')} per process, {esc(bs.get('global') or '?')} global",
            )
        )
    for name, group in alike_runs(diag.ddp_models or ([diag.ddp] if diag.ddp else [])):
        ddp = group[0]
        opts = ", ".join(f"{esc(k)}={esc(v)}" for k, v in sorted(ddp.get("options", {}).items()))
        rows.append(
            (
                "DDP",
                f"{esc(name)}: {int(ddp.get('params', 0)):,} parameters, "
                f"{len(ddp.get('buckets', []))} bucket(s) at construction<br><small>{opts}</small>",
            )
        )
    rtts = [v for v in tb.rtt_us.values() if v]
    clock = f"max offset to rank 0: {tb.max_skew_us / 1e3:.3f} ms"
    if rtts:
        clock += f", median round trip {float(np.median(rtts)) / 1e3:.3f} ms"
    measured = sum(v is not None for v in tb.clock_offset_us.values())
    clock += f" ({measured} of {len(tb.clock_offset_us)} ranks measured)"
    rows.append(("clock alignment", esc(clock)))
    dirs = "<br>".join(f"<code>{esc(d)}</code>" for d in run.dirs)
    if len(run.dirs) > 3:
        dirs = f"<details><summary>{len(run.dirs)} directories</summary>{dirs}</details>"
    rows.append(("run dirs", dirs))
    return f'<section id="run"><h2>Run</h2>{kv_table(rows)}</section>'


def _steps_text(diag: Diagnosis, unit: bool = False) -> str:
    """ "40", or "7 to 8 (the ranks differ)"; with ``unit``, "40 steps". An attached run
    recorded no steps: "unknown (attached)", never a 0 the job did not run."""
    counts = sorted(set(diag.steps.values()))
    if any(m.get("attached") for m in diag.run.metas):
        return (
            "steps unknown (attached, nothing recorded)" if unit else "unknown (attached, nothing recorded)"
        )
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}" if counts else "0"
    text = f"{n} step{'' if n == '1' else 's'}" if unit else n
    return text + (" (the ranks differ)" if len(counts) > 1 else "")


def _finding_item(f: Any) -> str:
    evidence = json.dumps(f.details, indent=1, default=str, ensure_ascii=False)
    ranks = f" <span class=ranks>rank {esc(rank_list(f.ranks))}</span>" if f.ranks else ""
    return (
        f'<li class="finding {esc(f.severity)}"><span class="sev">{esc(f.severity)}</span> '
        f"<b>{esc(f.kind)}</b>{ranks}<p>{esc(f.summary)}</p>"
        + (f'<p class="fix"><b>fix:</b> {esc(f.fix)}</p>' if f.fix else "")
        + f"<details><summary>evidence</summary><pre>{esc(evidence)}</pre></details></li>"
    )


def findings_section(diag: Diagnosis, notes: list[str]) -> str:
    if diag.failure is not None:  # the failure comes first; its info notes wait, folded
        shown = [f for f in diag.findings if f.severity != "info"]
        folded = [f for f in diag.findings if f.severity == "info"]
        infos = (
            f'<details id="folded-notes"><summary>{len(folded)} info note(s), folded while the run '
            f'failed</summary><ul class="findings">{"".join(_finding_item(f) for f in folded)}</ul></details>'
            if folded
            else ""
        )
        note_html = "".join(f"<li>{esc(n)}</li>" for n in notes)
        return (
            f'<section id="findings"><h2>Findings ({len(diag.findings)})</h2><ul class="findings">'
            + "".join(_finding_item(f) for f in shown)
            + "</ul>"
            + infos
            + (f'<ul class="notes">{note_html}</ul>' if note_html else "")
            + "</section>"
        )
    items = [_finding_item(f) for f in diag.findings]
    if not any(f.severity in ("error", "warning") for f in diag.findings):
        items.insert(0, '<li class="finding ok">No problems found.</li>')
    note_html = "".join(f"<li>{esc(n)}</li>" for n in notes)
    return (
        f'<section id="findings"><h2>Findings ({len(diag.findings)})</h2><ul class="findings">'
        + "".join(items)
        + "</ul>"
        + (f'<ul class="notes">{note_html}</ul>' if note_html else "")
        + "</section>"
    )


# Two columns per phase (typical and tail) keep the table within a laptop's width; a phase that
# happens once (DDP init) gets one. Every statistic stays in diagnose --json.
TABLE_STATS = (("p50", "p50_s"), ("p95", "p95_s"))
ONCE_STATS = (("total", "total_s"),)
SHADE_MIN_RANKS = 3  # with two ranks one of them is always "the slower": shading would say nothing
SHADE_ABOVE = 1.2  # a cell this far above its column's median across ranks stands out


def _shown(diag: Diagnosis, phase: str) -> bool:
    """Phases that happened on some rank; device phases only when the run recorded device spans."""
    return any(ph.get(phase, {}).get("count") for ph in diag.phases.values())


def phase_table(diag: Diagnosis) -> str:
    phases = [p for p in schema.PHASES if _shown(diag, p)]
    stats = {p: TABLE_STATS if schema.PHASES[p].per_step else ONCE_STATS for p in phases}
    shade = len(diag.run.ranks) >= SHADE_MIN_RANKS
    median = {
        (p, key): float(np.median([diag.phases[r].get(p, {}).get(key, 0.0) for r in diag.phases]))
        for p in phases
        for _, key in stats[p]
    }
    head1 = "<th rowspan=2>rank</th><th rowspan=2>host</th><th colspan=2>step time</th>" + "".join(
        f"<th colspan={len(stats[p])}>{esc(schema.PHASES[p].label)}</th>" for p in phases
    )
    head2 = "<th>p50</th><th>p95</th>" + "".join(f"<th>{s}</th>" for p in phases for s, _ in stats[p])
    body = []
    for rank in sorted(diag.run.ranks):
        st = diag.step_time_s.get(rank, {})
        cells = [f"<td>{rank}</td><td>{esc(diag.run.ranks[rank].host)}</td>"]
        cells += [f"<td>{st[k] * 1e3:.1f}</td>" if k in st else "<td>-</td>" for k in ("p50", "p95")]
        for p in phases:
            ph = diag.phases.get(rank, {}).get(p)
            for _, key in stats[p]:
                if not ph or not ph.get("count"):
                    cells.append("<td>-</td>")
                    continue
                value, mid = ph[key], median[(p, key)]
                above = value / mid - 1 if mid > 0 else 0.0
                style = ""
                if shade and value > SHADE_ABOVE * mid:
                    style = f' style="background:rgba(225,87,89,{min(0.55, 0.15 + 0.4 * above):.2f})"'
                cells.append(f"<td{style}>{value * 1e3:.1f}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    shading = (
        f"a shaded cell is more than {SHADE_ABOVE - 1:.0%} above its column's median over the ranks "
        "(the darker, the further)"
        if shade
        else "with fewer than 3 ranks no cell is shaded (one of two is always the slower)"
    )
    return (
        '<section id="phases"><h2>Time per phase and rank</h2>'
        "<p class=hint>Milliseconds per event: median (p50) and 95th percentile (p95); DDP init once, "
        f"in total; {shading}. diagnose --json holds every statistic.</p>"
        f'<div class="scroll"><table class="phases"><thead><tr>{head1}</tr><tr>{head2}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div></section>"
    )


def heatmap_section(diag: Diagnosis) -> str:
    late = diag.lateness
    if late is None or not late.steps:
        return (
            '<section id="lateness"><h2>Lateness at the gradient sync</h2><p>No training steps.</p></section>'
        )
    means = late.mean_ms()
    worst = sorted(means, key=lambda r: -means[r])[:3]
    worst_text = ", ".join(f"rank {r} ({means[r]:.1f} ms)" for r in worst)
    return (
        '<section id="lateness"><h2>Lateness at the gradient sync</h2>'
        f"<p class=hint>Per step, {esc(late.definition)}. "
        f"A straggler is a dark row; latest on average: {esc(worst_text)}.</p>"
        f"{figure_html(heatmap_figure(diag), 'lateness-heatmap')}</section>"
    )


def render(diag: Diagnosis, *, max_segments: int = MAX_SEGMENTS) -> str:
    """The whole report as one HTML string."""
    from plotly.offline import get_plotlyjs

    tb = diag.time_base
    assert tb is not None
    run = diag.run
    title = f"ddpdoctor report: {run.world_size} rank(s), {_steps_text(diag, unit=True)}"
    sub = (
        f"{len(run.hosts)} host(s) · generated {time.strftime('%Y-%m-%d %H:%M:%S')} by ddpdoctor "
        f"{ddpdoctor.__version__}"
    )
    failed = diag.failure is not None  # the failure and its timeline first, then the findings
    body = "".join(
        [
            failure_section(diag),  # "" unless the run failed or hung
            timeline_section(diag, max_segments) if failed else "",
            findings_section(diag, run.notes + tb.notes + diag.notes),
            header_section(diag),
            "" if failed else timeline_section(diag, max_segments),
            gpu_section(diag),  # under the rank rows, on the same x axis
            heatmap_section(diag),
            phase_table(diag),
        ]
    )
    page = Template(asset("page.html"))
    return page.substitute(
        title=esc(title), subtitle=esc(sub), css=asset("report.css"), plotly=get_plotlyjs(), body=body
    )
