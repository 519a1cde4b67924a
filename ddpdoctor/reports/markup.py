"""Shared pieces of the HTML report: escaping, plotly figures as fragments, packaged assets."""

from __future__ import annotations

import html
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
