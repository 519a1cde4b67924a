"""The report's timeline: one row per rank, its bucket all-reduces on a lane beneath.

It stays small and responsive at scale: each phase is one WebGL line trace with NaN gaps (never
a shape per event), and when the run has more events than ``max_segments`` the timeline keeps
the slowest steps (and the first ones). Phases, their lanes, labels and colours come from the
vocabulary (``schema.PHASES``); step spans from the Diagnosis.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.slow.device import clock as device_clock
from ddpdoctor.analysis.slow.phases import phase_events
from ddpdoctor.reports.failure import draw_failure
from ddpdoctor.reports.markup import asset, esc, figure_html, json_script, template
from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import Events
from ddpdoctor.trace.reader import RankTrace

MAX_SEGMENTS = 30_000  # timeline intervals drawn (about 80 bytes each in the file)
SLOWEST_BUTTONS = 8
MAX_BUCKET_TRACES = 64
COMM_LANE_OFFSET = 0.4
LANE_OFFSETS = (0.0, COMM_LANE_OFFSET, 0.6, 0.75)  # by schema.Lane: CPU lanes, then the GPU's


@dataclass
class Segments:
    """Intervals of one phase: start and end in seconds on the common base, row, step, bucket."""

    start: np.ndarray
    end: np.ndarray
    row: np.ndarray
    step: np.ndarray
    bucket: np.ndarray  # -1 unless an all-reduce
    nbytes: np.ndarray


def _field(ev: Events, phase: str, name: str, default: int) -> np.ndarray:
    """A named integer field of a phase's events (``default`` where its kind has none)."""
    fields = schema.KINDS[schema.PHASES[phase].kind].fields
    if name in fields and len(ev):
        return np.maximum(ev.ints(fields.index(name), default=default), default)
    return np.full(len(ev), default, np.int64)


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


def collect_segments(diag: Diagnosis, rows: dict[int, int], steps: set[int] | None) -> dict[str, Segments]:
    out: dict[str, Segments] = {}
    hidden: dict[tuple[int, str], list[int]] = {}  # (rank, kind) -> ts of spans drawn as open ones
    for rank, kind, ts in diag.failure.hidden() if diag.failure is not None else ():
        hidden.setdefault((rank, kind), []).append(ts)
    chosen = None if steps is None else _step_table(steps)
    for phase, style in schema.PHASES.items():
        if chosen is not None and not style.per_step:  # not in a step (DDP init): drawn with all
            continue
        parts: list[tuple[np.ndarray, ...]] = []
        for rank, trace in diag.run.ranks.items():
            ev = phase_events(trace, phase)
            if chosen is not None:  # select before materialising times: few steps of many
                shift = 1 if style.kind == schema.DATA_WAIT else 0  # the wait before a chosen step
                ev = ev.select(_chosen(ev.step + shift, chosen))
            cut = hidden.get((rank, style.kind))
            if cut and len(ev):
                ev = ev.select(~np.isin(ev.ts, cut))
            if not len(ev):
                continue
            bucket, nbytes = _field(ev, phase, "bucket", -1), _field(ev, phase, "bytes", 0)
            start = diag.time_base.rel(rank, ev.ts) / 1e6
            parts.append((start, start + ev.dur / 1e6, np.full(len(ev), rows[rank]), ev.step, bucket, nbytes))
        if parts:
            out[phase] = Segments(*(np.concatenate([p[i] for p in parts]) for i in range(6)))
    return out


def _step_table(steps: set[int]) -> tuple[int, np.ndarray]:
    """Which steps are chosen, as (the lowest, a table from it): built once, read for every
    rank and phase (np.isin built one 13,000 times at 1,024 ranks)."""
    lo = min(steps, default=0)
    table = np.zeros(max(steps, default=-1) - lo + 1, bool)
    table[[s - lo for s in steps]] = True
    return lo, table


def _chosen(step: np.ndarray, chosen: tuple[int, np.ndarray]) -> np.ndarray:
    """The events in the chosen steps: index ranges found by bisection where the steps are in
    order (the usual kind: a few steps of tens of thousands of events), else a mask."""
    lo, table = chosen
    if len(step) > 1 and (step[1:] >= step[:-1]).all():
        wanted = np.flatnonzero(table) + lo
        starts = np.searchsorted(step, wanted, "left")
        counts = np.searchsorted(step, wanted, "right") - starts
        # each range's first index, repeated over its events, plus the event's place in it
        first = np.repeat(starts - np.cumsum(counts) + counts, counts)
        return first + np.arange(len(first))
    at = step - lo
    inside = (at >= 0) & (at < len(table))
    out = np.zeros(len(step), bool)
    out[inside] = table[at[inside]]
    return out


def rank_label(trace: RankTrace) -> str:
    return esc(f"rank {trace.rank} ({trace.host})")


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


def timeline_figure(diag: Diagnosis, rows: dict[int, int], steps: set[int] | None) -> Any:
    import plotly.graph_objects as go

    segs = collect_segments(diag, rows, steps)
    fig = go.Figure()
    n_rows = len(rows)
    width = max(2.0, min(10.0, 600.0 / max(n_rows, 1)))
    buckets = diag.bucket_layout
    for phase, seg in segs.items():
        style = schema.PHASES[phase]
        label, lane, colour = style.label, int(style.lane), style.colour
        fields = schema.KINDS[style.kind].fields
        common = "%{y}<br>step %{customdata[0]:.0f}<br>%{customdata[1]:.2f} ms"
        if "bucket" not in fields:
            with_bytes = "bytes" in fields
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
    if diag.failure is not None:
        draw_failure(fig, diag.failure, rows, LANE_OFFSETS)
    ticktext = [rank_label(diag.run.ranks[r]) for r in sorted(rows, key=rows.get)]
    height = int(n_rows * max(14.0, min(60.0, 700.0 / max(n_rows, 1))) + 150)
    fig.update_layout(
        template=template(),
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


def timeline_section(diag: Diagnosis, max_segments: int = MAX_SEGMENTS) -> str:
    run = diag.run
    rows = {rank: i for i, rank in enumerate(sorted(run.ranks))}
    spans = diag.step_spans
    total = sum(len(ev) for t in run.ranks.values() for ev in t.events.values())
    per_step = total / max(len(spans), 1)
    chosen = choose_steps(spans, per_step, max_segments)
    fig = timeline_figure(diag, rows, chosen)
    window = diag.failure.window_s if diag.failure is not None else None
    if window is not None:  # open on the last steps and the failure ("whole run": everything)
        fig.update_xaxes(range=list(window))
    elif spans and chosen is None:  # open on the training steps, not on a long init
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
    hint = (
        f"One row per rank; the thin lane under each row holds its bucket all-reduces "
        f"and buffer broadcasts, so their overlap with backward shows{gpu}. Showing {esc(scope)}. "
        "Drag to zoom, double-click to reset, hover for step, duration, bytes and parameters."
    )
    if window is not None:  # a failed run: the failure above needs the room
        hint = (
            "Hatched: spans a rank never left; dashed: the moments above; x: where a rank ended. "
            "Opens on the last steps and the failure's start; 'whole run' shows it all."
        )
    return (
        f'<section id="timeline-section"><h2>Timeline</h2><p class=hint>{hint}</p>'
        f"{controls}{figure_html(fig, 'timeline')}{json_script('step-spans', span_json)}"
        f"<script>{asset('zoom.js')}</script></section>"
    )
