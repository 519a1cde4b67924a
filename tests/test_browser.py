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


# Where the failure section and the open spans landed, against the first screen's height.
FIRST_SCREEN_PROBE = """<script>
window.addEventListener('load', function(){ setTimeout(function(){
  function top(el){ var r = el.getBoundingClientRect(); return {top: r.top, bottom: r.bottom}; }
  var failure = document.getElementById('failure');
  var bars = document.querySelectorAll('#timeline .barlayer .point path');
  var p = document.createElement('pre'); p.id = 'probe';
  p.textContent = JSON.stringify({
    problems: window.__problems,
    height: window.innerHeight,
    failure: failure ? top(failure) : null,
    verdict: failure ? failure.querySelector('.verdict').textContent : '',
    bars: Array.prototype.map.call(bars, top),
    labels: Array.prototype.map.call(document.querySelectorAll('#timeline .barlayer text'),
                                     function(t){ return t.textContent; })
  });
  document.body.appendChild(p);
}, 1000); });
</script>"""


def test_a_hang_report_shows_the_failure_and_its_open_spans_on_the_first_screen(tmp_path: Path) -> None:
    from test_failure_view import hang_run

    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.reader import load_run

    report = reports.write(diagnose(load_run([hang_run(tmp_path)])), tmp_path / "hang.html")
    text = report.read_text(encoding="utf-8")
    probed = report.with_name("probe-hang.html")
    probed.write_text(
        text.replace("<head>", "<head>" + HEAD_PROBE, 1).replace(
            "</body>", FIRST_SCREEN_PROBE + "</body>", 1
        ),
        encoding="utf-8",
    )
    proc = chromium("--window-size=1400,1000", "--dump-dom", probed.as_uri())
    match = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert match, f"the page never finished loading: {proc.stderr[-2000:]}"
    seen = json.loads(htmllib.unescape(match.group(1)))
    assert seen["problems"] == []
    assert seen["verdict"].startswith("The job hung (proven after 1.9 s)")
    assert seen["failure"]["top"] < 100, "the page opens with the failure"
    assert len(seen["bars"]) == 3, "the three open spans are drawn"
    assert all(0 < b["top"] < seen["height"] for b in seen["bars"]), (seen["bars"], seen["height"])
    assert any("did not finish" in label for label in seen["labels"])
    shot = tmp_path / "hang.png"
    chromium("--window-size=1400,1000", f"--screenshot={shot}", report.as_uri())
    assert shot.stat().st_size > 20_000
    out = os.environ.get("DDPDOCTOR_SCREENSHOT_DIR")
    if out:
        shutil.copy(shot, Path(out) / "hang-report.png")
