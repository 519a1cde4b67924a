"""The report's GPU panels: NVML samples on the timeline's clock, and a per-GPU table."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpdoctor.analysis import Diagnosis
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.reports.markup import asset, esc, figure_html, template

GPU_PANELS = (  # (metric, panel title, scale)
    ("util", "utilisation %", 1.0),
    ("mem_used", "memory used GiB", 2.0**-30),
    ("sm_clock_mhz", "SM clock MHz", 1.0),
    ("power_w", "power W", 1.0),
)
MAX_GPU_POINTS = 5_000  # per GPU and panel; longer runs are thinned evenly


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
        template=template(),
        height=120 + 150 * max(len(panels), 1),
        margin={"l": 10, "r": 10, "t": 30, "b": 40},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        hovermode="x unified",
    )
    fig.update_xaxes(title_text="seconds since the first event (aligned to rank 0's clock)", row=len(panels))
    return fig


def gpu_table(diag: Diagnosis) -> str:
    from ddpdoctor.analysis.slow.gpu import device_stats

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
        f"{missing}{gpu_table(diag)}{figure_html(gpu_figure(diag), 'gpu-panels')}"
        f"<script>{asset('gpu_sync.js')}</script></section>"
    )
