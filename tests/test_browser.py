"""Open generated reports in headless Chromium: no JavaScript error, the rank rows render,
and no job-supplied markup runs. Skips only when chromium is absent outside CI."""

from __future__ import annotations

import html as htmllib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from test_reports import _xss_diag

from ddpdoctor import reports

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (apt-get install -y chromium)", allow_module_level=True)

# Injected into a copy of the report: record errors, alerts and what rendered into the DOM.
HEAD_PROBE = """<script>
window.__problems = [];
window.addEventListener('error', function(e){ __problems.push('error: ' + e.message); });
window.addEventListener('unhandledrejection', function(e){ __problems.push('rejection: ' + e.reason); });
window.alert = function(m){ __problems.push('alert: ' + m); };
var __ce = console.error; console.error = function(){ __problems.push('console.error: ' +
  Array.prototype.join.call(arguments, ' ')); __ce.apply(console, arguments); };
</script>"""
TAIL_PROBE = """<script>
window.addEventListener('load', function(){ setTimeout(function(){
  var p = document.createElement('pre'); p.id = 'probe';
  p.textContent = JSON.stringify({
    problems: window.__problems,
    imgs: document.getElementsByTagName('img').length,
    plots: document.querySelectorAll('.js-plotly-plot').length,
    ticks: Array.prototype.map.call(document.querySelectorAll('#timeline .ytick text'),
                                    function(t){ return t.textContent; })
  });
  document.body.appendChild(p);
}, 1000); });
</script>"""


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM, "chromium is required under CI"
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--virtual-time-budget=15000",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )


def probe(report: Path) -> dict:
    text = report.read_text(encoding="utf-8")
    instrumented = report.with_name("probe-" + report.name)
    instrumented.write_text(
        text.replace("<head>", "<head>" + HEAD_PROBE, 1).replace("</body>", TAIL_PROBE + "</body>", 1),
        encoding="utf-8",
    )
    proc = chromium("--dump-dom", instrumented.as_uri())
    match = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"the page never finished loading: {proc.stderr[-2000:]}"
    return json.loads(htmllib.unescape(match.group(1)))


def test_report_renders_without_errors_and_no_markup_runs(tmp_path: Path) -> None:
    report = reports.write(_xss_diag(tmp_path / "runs"), tmp_path / "report.html")
    result = probe(report)
    assert result["problems"] == []
    assert result["imgs"] == 0, "job-supplied <img> became an element"
    assert result["plots"] == 2
    assert len(result["ticks"]) == 4
    assert all(t.startswith(f"rank {i} (h") for i, t in enumerate(result["ticks"]))
    assert "</script><img src=x onerror=alert(1)>" in result["ticks"][0]  # shown as text
    shot = tmp_path / "report.png"
    chromium("--window-size=1400,1800", f"--screenshot={shot}", report.as_uri())
    assert shot.stat().st_size > 20_000
    out = os.environ.get("DDPDOCTOR_SCREENSHOT_DIR")
    if out:  # CI keeps it as an artifact
        shutil.copy(shot, Path(out) / "report.png")
