"""The failure as the HTML report draws it: a section that opens the page, and the timeline's
open spans, moments and lane ends. Everything comes from the Diagnosis' ``FailureView``
(``analysis/failed/failure.py``); nothing here judges. A healthy run has no view and gets none of it.

Open spans are one horizontal bar trace (hatched, outlined in their phase's colour, labelled
"did not finish"), drawn over the lanes; the moments are dashed vertical lines with a label; a
rank that died ends in a marker that names how (signal, exception type, exit code).
"""

from __future__ import annotations

import json
from typing import Any

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.failed.failure import FailureView
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.hung.hang import group_ranks
from ddpdoctor.reports.markup import esc
from ddpdoctor.trace import schema

MARKER_COLOURS = {"verdict": "#d32f2f", "kill": "#6a1b9a", "death": "#b71c1c"}


def _colour(phase: str) -> str:
    if phase == schema.USER_CODE:
        return schema.USER_CODE_COLOUR
    style = schema.PHASES.get(phase)
    return style.colour if style is not None else "#9e9e9e"


def draw_failure(fig: Any, view: FailureView, rows: dict[int, int], lane_offsets: tuple[float, ...]) -> None:
    """Add the open spans, the moments and the dead ranks' lane ends to the timeline figure."""
    import plotly.graph_objects as go

    spans = [s for s in view.open_spans if s.rank in rows]
    if spans:
        colours = [_colour(s.phase) for s in spans]
        hover = [
            "<br>".join(
                esc(part)
                for part in (
                    f"{s.label}: {schema.DID_NOT_FINISH}",
                    f"rank {s.rank}, "
                    + (view.ranks[s.rank].step_text if s.rank in view.ranks else f"step {s.step}"),
                    f"{s.op} #{s.seq}" if s.op and s.seq is not None else "",
                    f"at {s.user_frame}" if s.user_frame else "",
                    f"{s.seconds:.3f} s until {s.ended_by}",
                )
                if part
            )
            for s in spans
        ]
        fig.add_trace(
            go.Bar(
                orientation="h",
                base=[s.start_s for s in spans],
                x=[s.seconds for s in spans],
                y=[rows[s.rank] + lane_offsets[s.lane] for s in spans],
                width=[0.34 if s.lane == schema.Lane.COMPUTE else 0.2 for s in spans],
                marker={
                    "color": "rgba(255,255,255,0.7)",
                    "line": {"color": colours, "width": 2},
                    "pattern": {"shape": "/", "fgcolor": colours, "size": 7, "solidity": 0.35},
                },
                text=[f"{esc(s.label)}: {schema.DID_NOT_FINISH}" for s in spans],
                textposition="inside",
                insidetextanchor="start",
                textfont={"color": "#222", "size": 11},
                hovertext=hover,
                hovertemplate="%{hovertext}<extra></extra>",
                name=schema.DID_NOT_FINISH,
                legendgroup="did_not_finish",
            )
        )
    for marker in view.markers:
        fig.add_vline(
            x=marker.time_s,
            line={"color": MARKER_COLOURS.get(marker.kind, "#d32f2f"), "width": 2, "dash": "dash"},
            annotation={"text": esc(marker.title or marker.kind), "textangle": 0, "font": {"size": 11}},
            annotation_position="bottom left" if marker.kind == "verdict" else "bottom right",
        )
    ends = [e for e in view.ranks.values() if e.failed and e.rank in rows]
    if ends:
        fig.add_trace(
            go.Scatter(
                x=[e.end_s for e in ends],
                y=[rows[e.rank] for e in ends],
                mode="markers+text",
                marker={"symbol": "x", "size": 13, "color": "#b71c1c", "line": {"width": 1, "color": "#fff"}},
                text=[esc(f"{e.mark}, step {e.step}") for e in ends],
                textposition="top left",
                textfont={"color": "#b71c1c", "size": 11},
                hovertext=[esc(f"rank {e.rank} {e.how_text}, {e.step_text}") for e in ends],
                hovertemplate="%{hovertext}<extra></extra>",
                name="end of rank",
            )
        )


def failure_section(diag: Diagnosis) -> str:
    """The page's opening section on a failed or hung run ("" for a healthy one)."""
    view = diag.failure
    if view is None:
        return ""
    title = "The job hung" if view.kind == "hang" else "The job failed"
    moments = "; ".join(
        f"<b>{m.time_s:.3f} s</b> {esc(m.label)}" for m in sorted(view.markers, key=lambda m: m.time_s)
    )
    return (
        f'<section id="failure"><h2>{title}</h2><p class="verdict">{esc(view.verdict)}</p>'
        + (f"<p class=hint>{moments} (dashed lines in the timeline below)</p>" if moments else "")
        + f'<div class="cols"><div>{_ranks_table(view)}</div><div>{_parting(view)}</div></div>'
        + _stacks(view)
        + "</section>"
    )


def _ranks_table(view: FailureView) -> str:
    """One row per set of ranks that ended alike (a thousand ranks in one barrier are one row)."""
    alike = {
        e.rank: (e.how_text, e.step_text, e.last_completed, e.open_point, e.user_frame)
        for e in view.ranks.values()
    }
    rows = "".join(
        f"<tr><td>{esc(rank_list(ranks))}</td><td>{esc(how)}</td><td>{esc(step)}</td>"
        f"<td>{esc(last or '-')}</td>"
        f'<td class="{"open" if point else ""}">{esc(point or "no sync point")}</td>'
        f"<td>{esc(user or '-')}</td></tr>"
        for ranks, (how, step, last, point, user) in group_ranks(alike)
    )
    return (
        "<h3>Each rank at the end</h3><table class=ends><tr><th>rank</th><th>how it ended</th>"
        "<th>step</th><th>last sync point completed</th><th>in (did not finish)</th>"
        f"<th>user frame</th></tr>{rows}</table>"
    )


def _stacks(view: FailureView) -> str:
    if not view.stacks:
        return ""
    parts = []
    for group in view.stacks:
        lines = [
            f"<b>{esc(line)}</b>" if k == group.user else esc(line) for k, line in enumerate(group.frames)
        ] or ["(no stack: a SIGKILL or os._exit leaves none, and no hang dump was taken)"]
        user = f" &middot; at {esc(group.frames[group.user])}" if group.user >= 0 else ""
        count = f"{len(group.frames)} frame(s)" if group.frames else "no stack left"
        parts.append(
            f"<details><summary>rank {esc(rank_list(group.ranks))} &middot; {esc(group.where)}{user} "
            f"&middot; {count}</summary><pre>{chr(10).join(lines)}</pre></details>"
        )
    return (
        "<h3>Stacks <small class=hint>(grouped by identical stack, click to unfold: main thread, "
        "innermost frame first, the user's in bold; ddpdoctor's own frames and threads left out)</small></h3>"
        + "".join(parts)
    )


def _parting(view: FailureView) -> str:
    table = view.parting
    if not table or not table.get("rows"):
        return ""
    ranks = sorted({int(r) for cells in table["rows"].values() for r in cells})
    # One column per set of ranks whose cells are all alike.
    alike = {
        r: tuple(json.dumps(table["rows"][str(q)].get(str(r)), sort_keys=True) for q in table["seqs"])
        for r in ranks
    }
    columns = [group for group, _ in group_ranks(alike)]
    head = "".join(f"<th>rank {esc(rank_list(group))}</th>" for group in columns)
    body = []
    for seq in table["seqs"]:
        cells = []
        for r in (group[0] for group in columns):
            cell = table["rows"][str(seq)].get(str(r))
            if cell is None:
                cells.append('<td class="none">never issued</td>')
                continue
            size = f", {cell['bytes']:,} B" if cell.get("bytes") else ""
            site = f" at {cell['site']}" if cell.get("site") else ""
            flag = f" ({schema.DID_NOT_FINISH})" if cell.get("in_flight") else ""
            cls = ' class="open"' if cell.get("in_flight") else ""
            cells.append(f"<td{cls}>{esc(cell['op'])}{esc(size)}{esc(site)}{flag}</td>")
        mark = " &larr; parted" if seq == table.get("seq") else ""
        body.append(f"<tr><th>#{seq}{mark}</th>{''.join(cells)}</tr>")
    return (
        "<h3>Collectives where the ranks parted</h3><table class=parting>"
        f"<tr><th>seq</th>{head}</tr>{''.join(body)}</table>"
    )
