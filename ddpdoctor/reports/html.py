"""The HTML report: one self-contained file (plotly.js embedded) that opens offline.

Sections: findings, run header, timeline (one row per rank; bucket all-reduces on a lane of
their own under it, so their overlap with backward shows), lateness at the gradient sync
(rank x step heatmap), rank x phase table, and GPU panels when metrics were recorded.

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

import html
import json
import os
import re
import shlex
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import ddpdoctor
from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.device import clock as device_clock
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.phases import StepGrid, training_forwards
from ddpdoctor.rundir import write_atomic
from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import TimeBase, time_base
from ddpdoctor.trace.reader import Events, RankTrace

MAX_SEGMENTS = 30_000  # timeline intervals drawn (about 80 bytes each in the file)
SLOWEST_BUTTONS = 8
MAX_BUCKET_TRACES = 64
MAX_HEATMAP_CELLS = 400_000  # about 3 MB of numbers in the page

# (label, lane, colour): lane 0 is the rank's compute row, lane 1 its communication lane,
# lanes 2 and 3 the same on the device's clock (CUDA events; only when the model was on a GPU).
PHASE_STYLE: dict[str, tuple[str, int, str]] = {
    "ddp_init": ("DDP init", 0, "#9e9e9e"),
    "data_wait": ("data wait", 0, "#f2b134"),
    "forward": ("forward", 0, "#4e79a7"),
    "backward": ("backward", 0, "#59a14f"),
    "optimizer": ("optimizer", 0, "#b07aa1"),
    "barrier": ("barrier", 0, "#e15759"),
    "collective": ("collective", 0, "#ff9da7"),
    "sync_buffers": ("buffer broadcast", 1, "#76b7b2"),
    "allreduce": ("bucket all-reduce", 1, "#edc948"),
    schema.DEV_FORWARD: ("forward (GPU)", 2, "#2b4a6b"),
    schema.DEV_BACKWARD: ("backward (GPU)", 2, "#35652f"),
    schema.DEV_OPTIMIZER: ("optimizer (GPU)", 2, "#6b4a63"),
    schema.DEV_ALLREDUCE: ("bucket all-reduce (GPU)", 3, "#a38a2f"),
}
COMM_LANE_OFFSET = 0.4
LANE_OFFSETS = (0.0, COMM_LANE_OFFSET, 0.6, 0.75)


def esc(value: Any) -> str:
    """Escape a job-supplied value for HTML text, attributes and plotly labels alike."""
    return html.escape(str(value), quote=True).replace("{", "&#123;").replace("}", "&#125;")


# ---------------------------------------------------------------------------------------------
# Data extraction (pure numpy; no plotting)


@dataclass
class Segments:
    """Intervals of one phase: start and end in seconds on the common base, row, step, bucket."""

    start: np.ndarray
    end: np.ndarray
    row: np.ndarray
    step: np.ndarray
    bucket: np.ndarray  # -1 unless an all-reduce
    nbytes: np.ndarray


def phase_events(trace: RankTrace, phase: str) -> tuple[Events, np.ndarray, np.ndarray]:
    """A phase's events on one rank, with bucket index and bytes columns (-1 / 0 if none)."""
    if phase in ("barrier", "collective"):
        coll = trace.kind(schema.COLLECTIVE)
        if not len(coll):
            return coll, np.zeros(0, np.int64), np.zeros(0, np.int64)
        keep = coll.equals(0, schema.BARRIER_OP) == (phase == "barrier")
        nbytes = np.maximum(coll.ints(1, default=0), 0)[keep]
        return coll.select(keep), np.full(int(keep.sum()), -1, np.int64), nbytes
    ev = trace.kind(phase)
    if phase in (schema.ALLREDUCE, schema.DEV_ALLREDUCE) and len(ev):
        return ev, ev.ints(0, default=-1), ev.ints(1, default=0)
    return ev, np.full(len(ev), -1, np.int64), np.zeros(len(ev), np.int64)


def step_spans(diag: Diagnosis, tb: TimeBase) -> dict[int, tuple[float, float]]:
    """Each training step's extent across ranks (seconds): first forward to the last event.
    Folded rank by rank on the run's step grid: memory stays O(steps)."""
    grid = StepGrid.spanning(training_forwards(t).step for t in diag.run.ranks.values())
    starts, ends = np.full(grid.n, np.inf), np.full(grid.n, -np.inf)
    for rank, trace in diag.run.ranks.items():
        fwd = training_forwards(trace)
        first, has = grid.put(fwd.step, tb.rel(rank, fwd.ts), np.minimum)
        starts = np.minimum(starts, np.where(has, first, np.inf))
        for ev in trace.events.values():
            if len(ev):
                last, has = grid.put(ev.step, tb.rel(rank, ev.end), np.maximum)
                ends = np.maximum(ends, np.where(has, last, -np.inf))
    started = np.isfinite(starts)
    begin, end = starts[started] / 1e6, np.maximum(ends, starts)[started] / 1e6
    return dict(
        zip(grid.steps[started].tolist(), zip(begin.tolist(), end.tolist(), strict=True), strict=True)
    )


def choose_steps(spans: dict[int, tuple[float, float]], per_step: float, budget: int) -> set[int] | None:
    """The steps the timeline draws: all of them (None) if they fit, else the slowest and first."""
    if not spans or per_step * len(spans) <= budget:
        return None
    room = max(1, int(budget // max(per_step, 1)))
    steps = sorted(spans)
    first = steps[: min(3, max(1, room // 4))]
    slowest = sorted(steps, key=lambda s: spans[s][1] - spans[s][0], reverse=True)
    chosen = set(first)
    for s in slowest:
        if len(chosen) >= room:
            break
        chosen.add(s)
    return chosen


def collect_segments(
    diag: Diagnosis, tb: TimeBase, rows: dict[int, int], steps: set[int] | None
) -> dict[str, Segments]:
    out: dict[str, Segments] = {}
    chosen = None if steps is None else np.array(sorted(steps), dtype=np.int64)
    for phase in PHASE_STYLE:
        parts: list[tuple[np.ndarray, ...]] = []
        for rank, trace in diag.run.ranks.items():
            ev, bucket, nbytes = phase_events(trace, phase)
            if chosen is not None:  # select before materialising times: few steps of many
                shift = 1 if phase == "data_wait" else 0  # the wait before a chosen step
                keep = np.isin(ev.step + shift, chosen, kind="table") & (phase != "ddp_init")
                ev, bucket, nbytes = ev.select(keep), bucket[keep], nbytes[keep]
            if not len(ev):
                continue
            start = tb.rel(rank, ev.ts) / 1e6
            parts.append((start, start + ev.dur / 1e6, np.full(len(ev), rows[rank]), ev.step, bucket, nbytes))
        if parts:
            out[phase] = Segments(*(np.concatenate([p[i] for p in parts]) for i in range(6)))
    return out


def lateness_matrix(diag: Diagnosis, tb: TimeBase) -> tuple[list[int], list[int], np.ndarray, str]:
    """Rank x step: ms each rank reached the gradient sync after the first rank to get there.

    Arrival is the rank's first bucket becoming ready (its backward reached the first
    all-reduce); without bucket events, the start of its backward.
    """
    ranks = sorted(diag.run.ranks)
    kind, label = schema.ALLREDUCE, "first gradient bucket ready"
    if not any(len(t.kind(kind)) for t in diag.run.ranks.values()):
        kind, label = schema.BACKWARD, "backward start"
    grid = StepGrid.spanning(diag.run.ranks[r].kind(kind).step for r in ranks)
    z = np.full((len(ranks), grid.n), np.nan)
    for i, rank in enumerate(ranks):
        ev = diag.run.ranks[rank].kind(kind)
        first, has = grid.put(ev.step, tb.rel(rank, ev.ts), np.minimum)
        z[i, has] = first[has]
    reached = ~np.isnan(z).all(axis=0)
    if not reached.all():
        z = z[:, reached]
    steps_all = grid.steps[reached]
    if z.size:
        with np.errstate(all="ignore"):
            earliest = np.nanmin(z, axis=0, keepdims=True) if np.isfinite(z).any() else 0
        z -= earliest
        z /= 1e3
    return ranks, steps_all.tolist(), z.astype(np.float32), label


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


# ---------------------------------------------------------------------------------------------
# Figures


def _rank_label(trace: RankTrace) -> str:
    return esc(f"rank {trace.rank} ({trace.host})")


def _bucket_layout(diag: Diagnosis) -> dict[int, dict[str, Any]]:
    """The latest layout of each gradient bucket, from the lowest rank that recorded one."""
    for _, trace in sorted(diag.run.ranks.items()):
        recs = trace.meta.get(schema.BUCKET, [])
        if recs:
            layout: dict[int, dict[str, Any]] = {}
            for _ts, _step, info in recs:
                if isinstance(info.get("index"), int):
                    layout[info["index"]] = info
            return layout
    return {}


def _names_summary(names: Iterable[Any], limit: int = 6) -> str:
    names = [str(n) for n in names]
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", … {len(names) - limit} more"
    return shown


def _line_trace(
    go: Any,
    seg: Segments,
    mask: np.ndarray,
    lane: int,
    name: str,
    colour: str,
    hover: str,
    *,
    width: float,
    legend: bool,
    group: str,
    with_bytes: bool = False,
) -> Any:
    n = int(mask.sum())
    x = np.empty(3 * n)
    x[0::3], x[1::3], x[2::3] = seg.start[mask], seg.end[mask], np.nan
    y = np.empty(3 * n, dtype=np.float32)
    row = seg.row[mask] + LANE_OFFSETS[lane]
    y[0::3], y[1::3], y[2::3] = row, row, np.nan
    dur_ms = (seg.end[mask] - seg.start[mask]) * 1e3
    cols = [seg.step[mask], dur_ms] + ([seg.nbytes[mask] / 2**20] if with_bytes else [])
    cd = np.empty((3 * n, len(cols)), dtype=np.float32)
    for j, col in enumerate(cols):
        cd[0::3, j], cd[1::3, j], cd[2::3, j] = col, col, np.nan
    return go.Scattergl(
        x=x,
        y=y,
        customdata=cd,
        mode="lines",
        line={"color": colour, "width": width},
        name=name,
        legendgroup=group,
        showlegend=legend,
        hovertemplate=hover,
        connectgaps=False,
    )


def timeline_figure(diag: Diagnosis, tb: TimeBase, rows: dict[int, int], steps: set[int] | None) -> Any:
    import plotly.graph_objects as go

    segs = collect_segments(diag, tb, rows, steps)
    fig = go.Figure()
    n_rows = len(rows)
    width = max(2.0, min(10.0, 600.0 / max(n_rows, 1)))
    buckets = _bucket_layout(diag)
    for phase, seg in segs.items():
        label, lane, colour = PHASE_STYLE[phase]
        common = "%{y}<br>step %{customdata[0]:.0f}<br>%{customdata[1]:.2f} ms"
        if phase != schema.ALLREDUCE:
            with_bytes = phase in ("barrier", "collective")
            extra = "<br>%{customdata[2]:.2f} MiB" if with_bytes else ""
            hover = f"{esc(label)}<br>{common}{extra}<extra></extra>"
            fig.add_trace(
                _line_trace(
                    go,
                    seg,
                    np.ones(len(seg.start), bool),
                    lane,
                    label,
                    colour,
                    hover,
                    width=width if lane == 0 else width * 0.6,
                    legend=True,
                    group=phase,
                )
            )
            continue
        indices = sorted(set(seg.bucket.tolist()))
        named = indices[:MAX_BUCKET_TRACES]
        groups = [(i, seg.bucket == i) for i in named]
        if len(indices) > len(named):
            groups.append((-2, ~np.isin(seg.bucket, named)))
        for k, (index, mask) in enumerate(groups):
            info = buckets.get(index, {})
            params = esc(_names_summary(info.get("params", []))) if info else ""
            title = f"bucket {index}" if index >= 0 else "other buckets"
            sizes = np.unique(seg.nbytes[mask])
            varies = len(sizes) != 1  # a bucket's size is constant unless DDP rebuilt it
            size = "%{customdata[2]:.2f}" if varies else f"{sizes[0] / 2**20:.2f}"
            hover = (
                f"all-reduce {title}<br>{common}<br>{size} MiB"
                + (f"<br>params: {params}" if params else "")
                + "<extra></extra>"
            )
            fig.add_trace(
                _line_trace(
                    go,
                    seg,
                    mask,
                    lane,
                    label,
                    colour,
                    hover,
                    width=width * 0.6,
                    legend=k == 0,
                    group=phase,
                    with_bytes=varies,
                )
            )
    ticktext = [_rank_label(diag.run.ranks[r]) for r in sorted(rows, key=rows.get)]
    height = int(n_rows * max(14.0, min(60.0, 700.0 / max(n_rows, 1))) + 150)
    fig.update_layout(
        template="plotly_white",
        height=max(height, 320),
        margin={"l": 10, "r": 10, "t": 30, "b": 40},
        hovermode="closest",
        dragmode="zoom",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
        xaxis={
            "title": {"text": "seconds since the first event (aligned to rank 0's clock)"},
            "zeroline": False,
        },
        yaxis={
            "tickmode": "array",
            "tickvals": list(range(n_rows)),
            "ticktext": ticktext,
            "autorange": "reversed",
            "zeroline": False,
            "showgrid": False,
            "fixedrange": n_rows <= 16,
        },
    )
    return fig


def heatmap_figure(ranks: list[int], steps: list[int], z: np.ndarray, label: str, diag: Diagnosis) -> Any:
    import plotly.graph_objects as go

    ylabels = [_rank_label(diag.run.ranks[r]) for r in ranks]
    x, z, width = bin_steps(steps, z, MAX_HEATMAP_CELLS // max(1, len(ranks)))
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
        template="plotly_white",
        height=int(min(900, max(260, 14 * len(ranks) + 120))),
        margin={"l": 10, "r": 10, "t": 10, "b": 40},
        xaxis={"title": {"text": f"step (arrival = {label})"}},
        yaxis={"autorange": "reversed", "type": "category"},
    )
    return fig


# ---------------------------------------------------------------------------------------------
# HTML


def _figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    config = {"displaylogo": False, "responsive": True, "scrollZoom": False}
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=config)


def _header_value(diag: Diagnosis, key: str) -> Any:
    for _, trace in sorted(diag.run.ranks.items()):
        if key in trace.header:
            return trace.header[key]
    return None


def _kv_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def header_section(diag: Diagnosis, tb: TimeBase) -> str:
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
    ddp = diag.ddp
    if ddp:
        opts = ", ".join(f"{esc(k)}={esc(v)}" for k, v in sorted(ddp.get("options", {}).items()))
        rows.append(
            (
                "DDP",
                f"{esc(ddp.get('module'))}: {int(ddp.get('params', 0)):,} parameters, "
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
    return f'<section id="run"><h2>Run</h2>{_kv_table(rows)}</section>'


def _steps_text(diag: Diagnosis) -> str:
    counts = sorted(set(diag.steps.values()))
    if not counts:
        return "0"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]} (ranks differ)"


def findings_section(diag: Diagnosis, notes: list[str]) -> str:
    items = []
    for f in diag.findings:
        evidence = json.dumps(f.details, indent=1, default=str, ensure_ascii=False)
        ranks = f" <span class=ranks>rank {esc(rank_list(f.ranks))}</span>" if f.ranks else ""
        items.append(
            f'<li class="finding {esc(f.severity)}"><span class="sev">{esc(f.severity)}</span> '
            f"<b>{esc(f.kind)}</b>{ranks}<p>{esc(f.summary)}</p>"
            + (f'<p class="fix"><b>fix:</b> {esc(f.fix)}</p>' if f.fix else "")
            + f"<details><summary>evidence</summary><pre>{esc(evidence)}</pre></details></li>"
        )
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


TABLE_STATS = (("mean", "mean_s"), ("p50", "p50_s"), ("p95", "p95_s"), ("total", "total_s"))


def phase_table(diag: Diagnosis) -> str:
    phases = [p for p in PHASE_STYLE if any(p in ph for ph in diag.phases.values())]
    colmax = {
        (p, key): max((diag.phases[r].get(p, {}).get(key, 0.0) for r in diag.phases), default=0.0)
        for p in phases
        for _, key in TABLE_STATS
    }
    head1 = "<th rowspan=2>rank</th><th rowspan=2>host</th><th colspan=2>step time</th>" + "".join(
        f"<th colspan={len(TABLE_STATS)}>{esc(PHASE_STYLE[p][0])}</th>" for p in phases
    )
    head2 = "<th>p50</th><th>p95</th>" + "".join(f"<th>{s}</th>" for p in phases for s, _ in TABLE_STATS)
    body = []
    for rank in sorted(diag.run.ranks):
        st = diag.step_time_s.get(rank, {})
        cells = [f"<td>{rank}</td><td>{esc(diag.run.ranks[rank].host)}</td>"]
        cells += [f"<td>{st[k] * 1e3:.1f}</td>" if k in st else "<td>-</td>" for k in ("p50", "p95")]
        for p in phases:
            ph = diag.phases.get(rank, {}).get(p)
            for _, key in TABLE_STATS:
                if not ph:
                    cells.append("<td>-</td>")
                    continue
                value, top = ph[key], colmax[(p, key)]
                alpha = 0.55 * value / top if top > 0 else 0.0
                cells.append(f'<td style="background:rgba(225,87,89,{alpha:.2f})">{value * 1e3:.1f}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<section id="phases"><h2>Time per phase and rank</h2>'
        "<p class=hint>Milliseconds per event (mean, median, 95th percentile) and in total; "
        "the darker a cell, the closer to the slowest rank in that column.</p>"
        f'<div class="scroll"><table class="phases"><thead><tr>{head1}</tr><tr>{head2}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div></section>"
    )


GPU_PANELS = (  # (metric, panel title, scale)
    ("util", "utilisation %", 1.0),
    ("mem_used", "memory used GiB", 2.0**-30),
    ("sm_clock_mhz", "SM clock MHz", 1.0),
    ("power_w", "power W", 1.0),
)
MAX_GPU_POINTS = 5_000  # per GPU and panel; longer runs are thinned evenly

GPU_SYNC_JS = """
(function(){
  var tl = document.getElementById('timeline'), g = document.getElementById('gpu-panels');
  if(!tl || !g || !tl.on){return;}
  function follow(){
    var r = tl.layout && tl.layout.xaxis && tl.layout.xaxis.range;
    if(r){Plotly.relayout(g, {'xaxis.range': [r[0], r[1]]});}
  }
  tl.on('plotly_relayout', follow);
  follow();
})();
"""


def gpu_figure(diag: Diagnosis) -> Any:
    """Stacked panels sharing the timeline's x axis (seconds on the common base): one line
    per GPU in each, so they read under the rank rows."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    view = diag.gpus
    assert view is not None
    panels = [p for p in GPU_PANELS if any(np.isfinite(d.metrics[p[0]]).any() for d in view.devices)]
    fig = make_subplots(
        rows=max(len(panels), 1),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=[esc(p[1]) for p in panels],
    )
    palette = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"]
    for k, dev in enumerate(view.devices):
        stride = max(1, -(-len(dev.t_us) // MAX_GPU_POINTS))
        t = dev.t_us[::stride] / 1e6
        who = f" rank {rank_list(dev.ranks)}" if dev.ranks else ""
        name = esc(f"{dev.label}{who}")
        for row, (metric, title, scale) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scattergl(
                    x=t,
                    y=dev.metrics[metric][::stride] * scale,
                    mode="lines",
                    name=name,
                    legendgroup=f"gpu{k}",
                    showlegend=row == 1,
                    line={"color": palette[k % len(palette)], "width": 1.5},
                    hovertemplate=f"{name}<br>%{{x:.2f}} s<br>{esc(title)} %{{y:.1f}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
    fig.update_layout(
        template="plotly_white",
        height=120 + 150 * max(len(panels), 1),
        margin={"l": 10, "r": 10, "t": 30, "b": 40},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        hovermode="x unified",
    )
    fig.update_xaxes(title_text="seconds since the first event (aligned to rank 0's clock)", row=len(panels))
    return fig


def gpu_table(diag: Diagnosis) -> str:
    from ddpdoctor.analysis.gpu import device_stats

    view = diag.gpus
    assert view is not None
    rows = []
    for dev in view.devices:
        st = device_stats(view, dev)

        def mp(key: str, scale: float = 1.0, st: dict = st) -> str:
            v = st.get(key)
            return f"{v['mean'] * scale:.1f} / {v['peak'] * scale:.1f}" if v else "-"

        total = st.get("mem_total_bytes")
        share = st.get("throttled_share")
        reasons = ", ".join(st.get("throttle_reasons") or [])
        cells = [
            esc(dev.label),
            esc(st.get("name") or ""),
            esc(rank_list(dev.ranks)) + (f" ({esc(', '.join(st['mapped_by']))})" if dev.ranks else ""),
            mp("util_pct"),
            mp("mem_used_bytes", 2.0**-30) + (f" of {total / 2**30:.0f}" if total else ""),
            mp("power_w"),
            mp("sm_clock_mhz"),
            mp("temp_c"),
            (f"{share:.0%}" if share is not None else "-") + (f" ({esc(reasons)})" if reasons else ""),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("GPU", "model", "ranks", "util %", "memory GiB", "power W", "SM MHz", "temp C", "throttled")
    )
    return (
        f'<div class="scroll"><table class="phases"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div><p class=hint>mean / peak over the run.</p>"
    )


def gpu_section(diag: Diagnosis) -> str:
    """GPU panels: filled when the trace carries GPU metrics (the NVML sampler's records)."""
    view = diag.gpus
    missing = f"<p class=hint>{esc(view.missing)}</p>" if view is not None and view.missing else ""
    if view is None or not any(len(d.t_us) for d in view.devices):
        why = missing or "<p class=hint>No GPU metrics were recorded in this run.</p>"
        return f'<section id="gpu"><h2>GPU</h2>{why}</section>'
    return (
        '<section id="gpu"><h2>GPU</h2><p class=hint>NVML samples of every GPU of the sampled '
        "node(s), on the timeline's clock: zooming the timeline zooms these panels.</p>"
        f"{missing}{gpu_table(diag)}{_figure_html(gpu_figure(diag), 'gpu-panels')}"
        f"<script>{GPU_SYNC_JS}</script></section>"
    )


CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:10px 20px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#cfd8dc}
section{background:#fff;margin:12px 16px;padding:10px 16px;border:1px solid #e0e0e0;border-radius:6px}
h2{font-size:16px;margin:4px 0 8px}.hint{color:#666;margin:2px 0 8px}
ul.findings{list-style:none;padding:0;margin:0}
li.finding{border-left:5px solid #9e9e9e;padding:4px 10px;margin:6px 0;background:#f7f7f7}
li.finding.error{border-color:#d32f2f}li.finding.warning{border-color:#f9a825}
li.finding.info{border-color:#1976d2}li.finding.ok{border-color:#43a047}
li.finding p{margin:3px 0}.sev{text-transform:uppercase;font-size:11px;color:#555}.ranks{color:#555}
pre{background:#f0f0f0;padding:6px;overflow:auto;max-height:300px;font-size:12px}
table.kv th{text-align:left;padding-right:16px;vertical-align:top;color:#555;font-weight:600}
table.kv td{vertical-align:top}code{font-size:12px;word-break:break-all}
.scroll{overflow:auto;max-height:600px}
table.phases{border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums}
table.phases th,table.phases td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
table.phases thead th{background:#eceff1;position:sticky;top:0}
.controls{margin:4px 0 8px}.controls input{width:70px}.controls button{margin-left:4px}
"""

ZOOM_JS = """
(function(){
  var spans = SPANS_JSON;
  function zoom(lo, hi){
    var div = document.getElementById('timeline');
    var ks = Object.keys(spans).map(Number).filter(function(k){return k >= lo && k <= hi;});
    if(!div || !ks.length){return;}
    var a = Math.min.apply(null, ks.map(function(k){return spans[k][0];}));
    var b = Math.max.apply(null, ks.map(function(k){return spans[k][1];}));
    var pad = (b - a) * 0.02;
    Plotly.relayout(div, {'xaxis.range': [a - pad, b + pad]});
  }
  var form = document.getElementById('stepform');
  if(form){form.addEventListener('submit', function(ev){
    ev.preventDefault();
    zoom(Number(document.getElementById('step_lo').value), Number(document.getElementById('step_hi').value));
  });}
  var all = document.getElementById('step_all');
  if(all){all.addEventListener('click', function(){
    Plotly.relayout(document.getElementById('timeline'), {'xaxis.autorange': true});
  });}
  document.querySelectorAll('button[data-step]').forEach(function(b){
    b.addEventListener('click', function(){var k = Number(b.dataset.step); zoom(k, k);});
  });
})();
"""


def timeline_section(diag: Diagnosis, tb: TimeBase, max_segments: int) -> str:
    run = diag.run
    rows = {rank: i for i, rank in enumerate(sorted(run.ranks))}
    spans = step_spans(diag, tb)
    total = sum(len(ev) for t in run.ranks.values() for ev in t.events.values())
    per_step = total / max(len(spans), 1)
    chosen = choose_steps(spans, per_step, max_segments)
    fig = timeline_figure(diag, tb, rows, chosen)
    if spans and chosen is None:  # open on the training steps, not on a long init
        a, b = min(a for a, _ in spans.values()), max(b for _, b in spans.values())
        fig.update_xaxes(range=[a - 0.02 * (b - a), b + 0.02 * (b - a)])
    elif spans:  # only some steps are drawn: open on the slowest one
        worst = max(spans, key=lambda s: spans[s][1] - spans[s][0])
        a, b = spans[worst]
        fig.update_xaxes(range=[a - 0.1 * (b - a), b + 0.1 * (b - a)])
    slowest = sorted(spans, key=lambda s: spans[s][1] - spans[s][0], reverse=True)[:SLOWEST_BUTTONS]
    buttons = "".join(
        f'<button type=button data-step="{s}">step {s} ({(spans[s][1] - spans[s][0]) * 1e3:.0f} ms)</button>'
        for s in slowest
    )
    if chosen is None:
        scope = f"all {len(spans)} training steps"
    else:
        scope = (
            f"{len(chosen)} of {len(spans)} steps (the slowest, and the first ones): drawing every "
            f"event of {total:,} would make the page slow; the heatmap and table cover every step"
        )
    lo, hi = (min(spans), max(spans)) if spans else (0, 0)
    gpu = "; darker lanes below hold the same spans timed on the GPU" if device_clock(run) == "device" else ""
    span_json = json.dumps({str(k): [round(a, 6), round(b, 6)] for k, (a, b) in spans.items()})
    controls = (
        '<form id="stepform" class="controls">zoom to steps '
        f'<input id="step_lo" type=number value="{lo}"> to <input id="step_hi" type=number value="{hi}">'
        '<button type=submit>zoom</button><button type=button id="step_all">whole run</button>'
        f"<br>slowest steps: {buttons}</form>"
    )
    js = ZOOM_JS.replace("SPANS_JSON", span_json.replace("<", "\\u003c"))
    return (
        '<section id="timeline-section"><h2>Timeline</h2>'
        f"<p class=hint>One row per rank; the thin lane under each row holds its bucket all-reduces "
        f"and buffer broadcasts, so their overlap with backward shows{gpu}. Showing {esc(scope)}. "
        "Drag to zoom, double-click to reset, hover for step, duration, bytes and parameters.</p>"
        f"{controls}{_figure_html(fig, 'timeline')}<script>{js}</script></section>"
    )


def heatmap_section(diag: Diagnosis, tb: TimeBase) -> str:
    ranks, steps, z, label = lateness_matrix(diag, tb)
    if not steps:
        return (
            '<section id="lateness"><h2>Lateness at the gradient sync</h2><p>No training steps.</p></section>'
        )
    with np.errstate(all="ignore"):
        mean_late = np.nanmean(z, axis=1) if z.size else np.zeros(0)
    worst = [ranks[i] for i in np.argsort(-np.nan_to_num(mean_late))[:3]]
    worst_text = ", ".join(f"rank {r} ({mean_late[ranks.index(r)]:.1f} ms)" for r in worst)
    return (
        '<section id="lateness"><h2>Lateness at the gradient sync</h2>'
        f"<p class=hint>How long after the first rank each rank arrived ({esc(label)}), per step. "
        f"A straggler is a dark row; latest on average: {esc(worst_text)}.</p>"
        f"{_figure_html(heatmap_figure(ranks, steps, z, label, diag), 'lateness-heatmap')}</section>"
    )


def render(diag: Diagnosis, *, max_segments: int = MAX_SEGMENTS) -> str:
    """The whole report as one HTML string."""
    from plotly.offline import get_plotlyjs

    tb = time_base(diag.run)
    run = diag.run
    title = f"ddpdoctor report: {run.world_size} rank(s), {_steps_text(diag)} step(s)"
    sub = (
        f"{len(run.hosts)} host(s) · generated {time.strftime('%Y-%m-%d %H:%M:%S')} by ddpdoctor "
        f"{ddpdoctor.__version__}"
    )
    body = "".join(
        [
            findings_section(diag, run.notes + tb.notes),
            header_section(diag, tb),
            timeline_section(diag, tb, max_segments),
            gpu_section(diag),  # under the rank rows, on the same x axis
            heatmap_section(diag, tb),
            phase_table(diag),
        ]
    )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        f"<header><h1>{esc(title)}</h1><p>{esc(sub)}</p></header>{body}</body></html>\n"
    )


def write(diag: Diagnosis, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Render to ``path`` atomically (temporary name in the same directory, then rename)."""
    return write_atomic(path, render(diag, **kwargs))
