"""The HTML report: written after `run`, rebuilt by `report`, escaped, bounded at scale."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import JOBS, job_env, run_doctor, torchrun

from ddpdoctor import reports
from ddpdoctor.analysis import Finding, diagnose
from ddpdoctor.analysis.slow.views import LATENESS_AT_LAST_BUCKET
from ddpdoctor.reports import html, markup, terminal
from ddpdoctor.reports.timeline import _chosen, _step_table, choose_steps
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.synthetic import SyntheticJob, write_run

XSS = "</script><img src=x onerror=alert(1)>"


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True, timeout=120, env=job_env()
    )


@pytest.mark.e2e
def test_run_writes_report_and_prints_its_path(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"))
    assert job.returncode == 0, job.stderr
    report = job.run_dir / "report.html"
    assert f"report: {report}" in job.stderr
    text = report.read_text(encoding="utf-8")
    assert "rank 0 (" in text and "rank 1 (" in text
    assert "Plotly.newPlot" in text
    assert not re.search(r"<script[^>]+src=", text), "the report must not fetch scripts"
    assert not list(job.run_dir.glob(".report.html.*")), "temporary file left behind"
    # `report` rebuilds it elsewhere; `diagnose` points at the one in the run dir.
    out = tmp_path / "again.html"
    proc = doctor("report", str(job.run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 1_000_000  # plotly.js is embedded
    proc = doctor("diagnose", str(job.run_dir))
    assert f"report: {report}" in proc.stdout


def test_report_exits_2_on_unreadable_input(tmp_path: Path) -> None:
    assert doctor("report", str(tmp_path / "missing")).returncode == 2
    assert doctor("report", str(tmp_path)).returncode == 2  # a directory with no trace
    assert doctor("export", str(tmp_path)).returncode == 2


def _xss_diag(tmp_path: Path):
    job = SyntheticJob(
        ranks=4,
        steps=6,
        ranks_per_host=2,
        host_name="h{}" + XSS,
        param_name="p{}." + XSS,
        command=["torchrun", XSS, "train.py", "--name", "'\"&<>%{x}"],
    )
    diag = diagnose(load_run(write_run(job, tmp_path)))
    diag.findings.append(
        Finding("x" + XSS, "warning", [1], "summary " + XSS, fix="fix " + XSS, details={"e": XSS})
    )
    diag.run.notes.append("note " + XSS)
    return diag


def test_no_job_string_reaches_the_page_as_markup(tmp_path: Path) -> None:
    text = html.render(_xss_diag(tmp_path))
    assert "<img" not in text.lower()
    # Every </script> closes one of our own scripts.
    assert len(re.findall(r"</script", text, re.I)) == len(re.findall(r"<script", text, re.I))
    # The strings did arrive, escaped: in the page and in the figure data.
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in text  # header, findings
    assert "rank 1 (h0&lt;\\u002fscript&gt;" in text  # a plotly axis label
    assert "%&#123;x&#125;" in text  # braces too: plotly would read %{...} as a template


def test_large_run_keeps_slowest_steps_and_every_step_in_heatmap(tmp_path: Path) -> None:
    job = SyntheticJob(ranks=16, steps=300, straggler=5, straggler_extra_us=20_000)
    diag = diagnose(load_run(write_run(job, tmp_path)))
    text = html.render(diag, max_segments=2_000)
    assert re.search(r"Showing \d+ of 300 steps", text)
    late = diag.lateness
    assert late is not None and late.definition == LATENESS_AT_LAST_BUCKET
    assert late.steps == list(range(1, 300)) and late.ms.shape == (16, 299)  # step 0 has no sync before
    assert int(np.argmax(np.nanmean(late.ms, axis=1))) == 5  # the straggler is the latest row
    assert np.nanmin(late.ms) == 0
    # The heatmap's latest rank and the straggler finding's are one rank, by one definition.
    (finding,) = [f for f in diag.findings if f.kind == "straggler"]
    assert finding.ranks == [5] and max(late.mean_ms(), key=late.mean_ms().get) == 5
    spans = diag.step_spans
    chosen = choose_steps(spans, per_step=100, budget=2_000)
    slowest = max(spans, key=lambda s: spans[s][1] - spans[s][0])
    assert chosen is not None and len(chosen) <= 20 and slowest in chosen


def test_timeline_picks_the_events_of_the_chosen_steps_in_order_or_not() -> None:
    """Bisection where a kind's steps are in order, a mask where not: the same events."""
    rng = np.random.default_rng(3)
    for trial in range(500):
        step = rng.integers(-2, 30, rng.integers(0, 80))
        if trial % 3:
            step = np.sort(step)
        steps = set(rng.integers(-1, 33, rng.integers(1, 6)).tolist())
        picked = _chosen(step, _step_table(steps))
        index = np.flatnonzero(picked) if picked.dtype == bool else picked
        assert index.tolist() == np.flatnonzero(np.isin(step, list(steps))).tolist()


def test_every_trace_type_drawn_has_plotly_whites_defaults() -> None:
    """The figures' template keeps plotly_white's defaults only for the trace types the report
    draws: a new type must join them, or it would be drawn without its plotly_white look."""
    sources = (Path(markup.__file__).parent).glob("*.py")
    drawn = {name.lower() for path in sources for name in re.findall(r"\bgo\.(\w+)\(", path.read_text())}
    drawn -= {"figure"}
    assert drawn and drawn <= set(markup._DRAWN)
    tmpl = markup.template()
    assert not isinstance(tmpl, str), "plotly_white's file was not found where plotly keeps it"
    assert set(tmpl.data.to_plotly_json()) == set(markup._DRAWN) and tmpl.layout.paper_bgcolor == "white"


def test_report_at_scale_stays_within_its_size_budget(tmp_path: Path) -> None:
    """A quarter of the benchmark's size (32 ranks x 500 steps) stays a page a browser opens.
    How long it takes is measured by benchmarks/report_scale.py and scale.py, not here."""
    dirs = write_run(SyntheticJob(ranks=32, steps=500, straggler=3), tmp_path)
    path = reports.write(diagnose(load_run(dirs)), tmp_path / "r.html")
    assert path.stat().st_size < 10_000_000


def test_summary_fits_80_columns_and_names_the_report(tmp_path: Path) -> None:
    diag = _xss_diag(tmp_path)
    text = terminal.render(diag, report="/r/report.html")
    assert text.splitlines()[-1] == "  report: /r/report.html"
    long = [line for line in text.splitlines() if len(line) > 80 and "onerror" not in line]
    assert not long, long


def test_report_failure_never_changes_the_summary_or_exit(tmp_path: Path, monkeypatch) -> None:
    from ddpdoctor import cli

    run_dir = write_run(SyntheticJob(ranks=2, steps=3), tmp_path)[0]

    def broken(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(html, "render", broken)
    text = cli._summary_text(run_dir)
    assert "report: not written (RuntimeError('disk on fire'))" in text
    assert "rank(s) on 1 host(s)" in text


def test_summary_counts_the_buckets_ddp_trained_with() -> None:
    """DDP rebuilds its buckets after the first step (on the H100 check: 1 at construction,
    6 after): the summary names the buckets the all-reduces used, and the constructor's count."""
    ddp = {"buckets": [402_751_488]}
    rebuilt = {i: {"bytes": 67_125_248} for i in range(6)}
    assert terminal._buckets(ddp, rebuilt) == "6 bucket(s) (1 at construction, rebuilt after the first step)"
    assert terminal._buckets(ddp, {0: {"bytes": 402_751_488}}) == "1 bucket(s)"
    assert (
        terminal._buckets(ddp, {}) == "1 bucket(s) at construction"
    )  # no bucket record (several models, old traces)


def test_wrappers_alike_are_one_line_in_the_summary_and_one_row_in_the_report(tmp_path: Path) -> None:
    """A job that wraps its module again after each error it catches built hundreds of DDP
    models: the summary and the report's header name each run of wrappers alike once, and a
    model that differs (another class, other options) on its own line."""
    diag = diagnose(load_run(write_run(SyntheticJob(ranks=2, steps=5), tmp_path)))
    net = {"module": "Net", "params": 676, "buckets": [2704], "options": {"find_unused_parameters": False}}
    models = [dict(net, index=i) for i in range(300)]
    models.append(dict(net, index=300, options={"find_unused_parameters": True}))
    models += [dict(net, index=i) for i in (301, 302)]
    diag.ddp_models = models
    lines = terminal._models(diag)
    assert [line.split(" with ")[0] for line in lines] == [
        "  DDP: Net (DDP models #0-#299, 300 wrappers alike)",
        "  DDP: Net (DDP model #300)",
        "  DDP: Net (DDP models #301-#302, 2 wrappers alike)",
    ]
    assert "find_unused_parameters=True" in lines[1]
    header = html.header_section(diag)
    assert header.count("<th>DDP</th>") == 3, header
    assert "Net (DDP models #0-#299, 300 wrappers alike): 676 parameters" in header


@pytest.mark.e2e
def test_summary_names_the_buckets_after_ddps_rebuild(tmp_path: Path, write_script) -> None:
    """Six 4 MB layers under bucket_cap_mb=8: DDP builds one bucket, then rebuilds three in
    gradient order after the first step; the summary counts the ones the all-reduces used.
    Under ``auto`` (the default) three steps are too few for the timing to be decided, and
    with it the rebuilt layout recorded: the summary says it counts the constructor's."""
    script = write_script(
        "buckets.py",
        """
        import torch, torch.distributed as dist, torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        model = DDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]), bucket_cap_mb=8)
        for _ in range(3):
            model(torch.randn(4, 1024)).sum().backward()
        dist.destroy_process_group()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script), DDPDOCTOR_BUCKET_TIMING="on")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "3 bucket(s) (1 at construction, rebuilt after the first step)" in job.stderr, job.stderr[-3000:]
    shutil.rmtree(job.run_dir)
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "with 6,297,600 parameters, 1 bucket(s) at construction," in job.stderr, job.stderr[-3000:]
