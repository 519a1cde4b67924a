"""Shared pieces of the HTML report: escaping, plotly figures as fragments, packaged assets."""

from __future__ import annotations

import html
import json
import pkgutil
from functools import cache
from importlib import resources
from typing import Any


def esc(value: Any) -> str:
    """Escape a job-supplied value for HTML text, attributes and plotly labels alike."""
    return html.escape(str(value), quote=True).replace("{", "&#123;").replace("}", "&#125;")


@cache
def asset(name: str) -> str:
    """A file of ``reports/assets`` (the page template, its CSS and scripts)."""
    return resources.files("ddpdoctor.reports").joinpath("assets", name).read_text(encoding="utf-8")


# The trace types the report draws: their defaults are all of plotly_white's "data" it needs.
_DRAWN = ("bar", "heatmap", "scatter", "scattergl")


@cache
def template() -> Any:
    """plotly_white, as the report's figures use it: its layout and the defaults of the trace
    types drawn, read once from plotly's own file. Named, plotly validates its defaults for
    every trace type there is, importing each type's classes and copying them all, per figure:
    about 0.2 s of a small report's 1 s. The name where the file is not where plotly keeps it."""
    try:
        raw = pkgutil.get_data("plotly", "package_data/templates/plotly_white.json")
    except OSError:
        raw = None
    if raw is None:
        return "plotly_white"
    import plotly.graph_objects as go

    whole = json.loads(raw)
    drawn = {k: v for k, v in whole["data"].items() if k in _DRAWN}
    return go.layout.Template(layout=whole["layout"], data=drawn)


def json_script(element_id: str, value: str) -> str:
    """JSON data for the page's scripts, inert (never executed) and safe inside <script>."""
    safe = value.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="{element_id}">{safe}</script>'


def figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    config = {"displaylogo": False, "responsive": True, "scrollZoom": False}
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=config)


def kv_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'
