"""Bench output: an 80-column terminal table, a self-contained HTML page and the JSON object.

Every string that came from the user (the model path, run dirs, findings) is escaped with
``reports.markup.esc`` before it reaches the page or a plotly label.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

from ddpdoctor.rundir import write_atomic

HTML_NAME = "bench.html"
JSON_NAME = "bench.json"
WIDTH = 80
_LABEL = {"single": "single", "dp": "DataParallel", "ddp": "DDP"}
# The breakdown rows each mode can show: (key in breakdown_s / probes, label).
_DP_ROWS = ("scatter", "replicate", "parallel_apply", "gather")
_DDP_ROWS = (
    ("forward_s", "forward"),
    ("backward_s", "backward"),
    ("allreduce_s", "all-reduce"),
    ("exposed_allreduce_s", "exposed"),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _workers(name: str, mode: dict[str, Any]) -> str:
    if name == "dp":
        n = mode.get("replicas", 1)
        return f"{n} replica" + ("s" if n != 1 else "")
    if name == "ddp":
        return f"{mode.get('world_size', 0)} procs"
    return "1 proc"


def _cells(name: str, mode: dict[str, Any]) -> tuple[str, ...]:
    """One mode's row of the results table, for the terminal and the HTML page alike."""
    speed = "-" if mode.get("speedup") is None else f"{mode['speedup']:.2f}x"
    eff = "-" if mode.get("scaling_efficiency") is None else f"{100 * mode['scaling_efficiency']:.0f}%"
    return (
        _LABEL.get(name, name),
        _workers(name, mode),
        f"{mode['samples_per_s']:.1f}",
        _ms(mode["step_time_p50_s"]),
        _ms(mode["step_time_p95_s"]),
        speed,
        eff,
        _memory(mode),
    )


def _memory(mode: dict[str, Any]) -> str:
    mem = mode.get("memory_per_gpu_bytes")
    if not mem:
        return "no GPU"
    return " ".join(f"{v / 2**20:.0f}" for _, v in sorted(mem.items())) + " MiB"


def terminal(result: dict[str, Any]) -> str:
    """The table and the notes."""
    cfg = result["config"]
    gpus = cfg.get("cuda_devices") or []
    lines = [
        f"ddpdoctor bench: {cfg['model']}, input {','.join(map(str, cfg['input_shape']))}, "
        f"global batch {cfg['global_batch']}, {cfg['steps']} steps (+{cfg['warmup']} warm-up), "
        + (f"{len(gpus)} GPU(s)" if gpus else f"CPU ({cfg.get('cpu_count')} cores)"),
        "",
    ]
    head = (
        f"  {'mode':<13}{'workers':>10}{'samples/s':>11}{'p50 ms':>9}{'p95 ms':>9}{'speedup':>8}{'eff':>6}"
        "  memory"
    )
    lines += [head, "  " + "-" * (len(head) - 2)]
    for name, mode in result["modes"].items():
        if not mode.get("ok"):
            lines.append(f"  {_LABEL.get(name, name):<13}  failed (exit code {mode.get('exit_code')})")
            continue
        label, workers, rate, p50, p95, speed, eff, memory = _cells(name, mode)
        lines.append(f"  {label:<13}{workers:>10}{rate:>11}{p50:>9}{p95:>9}{speed:>8}{eff:>6}  {memory}")
    lines += ["", "  breakdown (ms per step, mean):"]
    for name, mode in result["modes"].items():
        if not mode.get("ok"):
            continue
        b = mode.get("breakdown_s", {})
        parts = [f"forward {_ms(b.get('forward'))}"]
        if name == "dp":
            parts += [f"{k.replace('_', '-')} {_ms(b.get(k))}" for k in _DP_ROWS]
        parts += [f"backward {_ms(b.get('backward'))}", f"optimizer {_ms(b.get('optimizer'))}"]
        lines.append(f"    {_LABEL.get(name, name):<13}" + ", ".join(parts))
        probes = mode.get("probes") if name == "ddp" else None
        if probes:
            ov = probes.get("overlap")
            lines.append(
                f"    {'  probes':<13}"
                + ", ".join(f"{label} {_ms(probes.get(k))}" for k, label in _DDP_ROWS)
                + (f", overlap {100 * ov:.0f}%" if ov is not None else "")
            )
    lines.append("")
    for note in result.get("notes", []):
        lines += textwrap.wrap(note, WIDTH - 2, initial_indent="  * ", subsequent_indent="    ")
    findings = result["modes"].get("ddp", {}).get("findings") or []
    for f in findings[:5]:
        lines += textwrap.wrap(
            f"DDP run: {f['severity']} {f['kind']}: {f['summary']}",
            WIDTH - 2,
            initial_indent="  ! ",
            subsequent_indent="    ",
        )
    if result.get("html"):
        lines.append(f"  report: {result['html']}")
    lines.append(f"  run dir: {result['run_dir']}")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def _figures(result: dict[str, Any]) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    from ddpdoctor.reports.markup import esc

    modes = {k: v for k, v in result["modes"].items() if v.get("ok")}
    names = [esc(_LABEL.get(k, k)) for k in modes]
    figs: list[tuple[str, Any]] = []
    thr = go.Figure(go.Bar(x=names, y=[m["samples_per_s"] for m in modes.values()], marker_color="#4e79a7"))
    thr.update_layout(title="Throughput (samples/s, higher is better)", template="plotly_white", height=340)
    figs.append(("throughput", thr))
    dist = go.Figure()
    for name, mode in zip(names, modes.values()):
        dist.add_trace(go.Box(y=[s * 1e3 for s in mode["step_times_s"]], name=name, boxpoints="all"))
    dist.update_layout(title="Step time (ms), warm-up excluded", template="plotly_white", height=360)
    figs.append(("steps", dist))
    rows = ["forward", *_DP_ROWS, "backward", "optimizer"]
    colours = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#edc948", "#59a14f", "#b07aa1"]
    brk = go.Figure()
    for row, colour in zip(rows, colours):
        ys = [mode.get("breakdown_s", {}).get(row) for mode in modes.values()]
        if row in _DP_ROWS:  # DataParallel's stages are inside its forward: show them beside it
            ys = [y if k == "dp" else None for k, y in zip(modes, ys)]
        ms = [None if y is None else y * 1e3 for y in ys]
        brk.add_trace(go.Bar(x=names, y=ms, name=esc(row), marker_color=colour))
    brk.update_layout(
        title="Per-step breakdown (ms, mean); DataParallel's scatter .. gather are inside its forward",
        barmode="group",
        template="plotly_white",
        height=380,
    )
    figs.append(("breakdown", brk))
    probes = modes.get("ddp", {}).get("probes")
    if probes:
        keys = [k for k, _ in _DDP_ROWS]
        fig = go.Figure(
            go.Bar(
                x=[label for _, label in _DDP_ROWS],
                y=[(probes.get(k) or 0.0) * 1e3 for k in keys],
                marker_color="#59a14f",
            )
        )
        fig.update_layout(
            title="DDP, from the core probes (ms per step, mean over ranks)",
            template="plotly_white",
            height=340,
        )
        figs.append(("ddp_probes", fig))
    return figs


def render_html(result: dict[str, Any]) -> str:
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from ddpdoctor.reports.markup import esc

    cfg = result["config"]
    shown = {k: (", ".join(map(str, v)) or "-") if isinstance(v, list) else v for k, v in cfg.items()}
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in shown.items())
    table_rows = []
    for name, mode in result["modes"].items():
        if not mode.get("ok"):
            table_rows.append(f"<tr><td>{esc(_LABEL.get(name, name))}</td><td colspan=7>failed</td></tr>")
            continue
        table_rows.append("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in _cells(name, mode)) + "</tr>")
    notes = "".join(f"<li>{esc(n)}</li>" for n in result.get("notes", []))
    findings = "".join(
        f"<li><b>{esc(f['severity'])}</b> {esc(f['kind'])}: {esc(f['summary'])}</li>"
        for f in result["modes"].get("ddp", {}).get("findings") or []
    )
    config = {"displaylogo": False, "responsive": True}
    charts = "".join(
        pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"bench-{key}", config=config)
        for key, fig in _figures(result)
    )
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ddd;padding:4px 8px;"
        "text-align:right}th{text-align:left;background:#f5f5f5}"
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "mode",
            "workers",
            "samples/s",
            "step p50 ms",
            "step p95 ms",
            "speedup",
            "efficiency",
            "memory/GPU",
        )
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ddpdoctor bench</title>"
        f"<style>{style}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        f"<h1>ddpdoctor bench: {esc(cfg['model'])}</h1><ul>{notes}</ul>"
        f"<table><tr>{head}</tr>{''.join(table_rows)}</table>{charts}"
        + (f"<h2>Findings in the DDP run</h2><ul>{findings}</ul>" if findings else "")
        + f"<h2>Configuration</h2><table>{rows}</table>"
        f"<p>DDP run directory: {esc(result['modes'].get('ddp', {}).get('run_dir', '-'))}</p></body></html>"
    )


def write(result: dict[str, Any], run_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """bench.json and bench.html in the run dir."""
    run_dir = Path(run_dir)
    html_path = run_dir / HTML_NAME
    result["html"] = str(html_path)
    json_path = write_atomic(run_dir / JSON_NAME, to_json(result))
    write_atomic(html_path, render_html(result))
    return json_path, html_path
