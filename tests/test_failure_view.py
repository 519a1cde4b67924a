"""The failure view on recorded-style run directories: a synthetic healthy trace plus the files
a hang (hang-1/summary.json, watch.json, ends.json) or a death (rank_error records, ends.json)
leaves, then the real analysis and the real renderers (HTML, Perfetto export, JSON)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddpdoctor import reports
from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.failed.failure_parts import stack_groups
from ddpdoctor.reports import chrome, json_report, terminal
from ddpdoctor.reports import html as html_report
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import load_run, read_trace
from ddpdoctor.trace.synthetic import SyntheticJob, append_records, write_run

STEPS = 8
DOCTOR = str(Path(reports.__file__).resolve().parent.parent / "probes" / "ddp.py")  # a ddpdoctor frame
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _base(tmp_path: Path, ranks: int = 2) -> Path:
    job = SyntheticJob(ranks=ranks, steps=STEPS, ranks_per_host=ranks, buckets=1, barrier_every=0)
    (run_dir,) = write_run(job, tmp_path / "runs")
    return run_dir


def _last(run_dir: Path, rank: int) -> tuple[float, int]:
    """(the rank's wall seconds at its last event's end, that end in trace µs)."""
    trace = read_trace(RunDir(run_dir).trace(rank))
    end = max(int(ev.end.max()) for ev in trace.events.values() if len(ev))
    return (int(trace.header["wall_ns"]) / 1e3 + end) / 1e6, end


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")


def _meta(run_dir: Path, code: int) -> None:
    meta = json.loads((run_dir / RunDir.RUN_META).read_text())
    _write(run_dir / RunDir.RUN_META, dict(meta, exit_code=code))


def _frames(*frames: tuple[str, int, str]) -> list[dict]:
    return [{"file": f, "line": line, "function": fn} for f, line, fn in frames]


def hang_run(tmp_path: Path, ranks: int = 2) -> Path:
    """The eval trap after the last step: rank 0 in the buffer broadcast of an eval forward,
    the others in a barrier, all at #SEQ; proven after 2 s, killed 0.1 s after the verdict."""
    run_dir = _base(tmp_path, ranks)
    seq = STEPS + 1
    every = range(ranks)
    wall = max(_last(run_dir, r)[0] for r in every)
    detected = wall + 2.0
    phases = {
        0: {"name": "sync_buffers", "op": "broadcast (eval)", "seq": seq, "since_s": 1.9, "group": "WORLD"},
        1: {"name": "collective", "op": "barrier", "seq": seq, "since_s": 1.9, "group": "WORLD"},
    }
    stacks = {
        0: _frames(
            (DOCTOR, 120, "forward_"),
            ("/venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", 2425, "_sync_buffers"),
            ("/home/u/train.py", 28, "evaluate"),
            ("/home/u/train.py", 66, "main"),
        ),
        1: _frames((TORCH, 5356, "barrier"), ("/home/u/train.py", 71, "main")),
    }
    phases.update({r: phases[1] for r in every if r > 1})
    stacks.update({r: stacks[1] for r in every if r > 1})
    statuses = {
        str(r): {"rank": r, "pid": 10 + r, "heartbeat_wall": detected, "step": STEPS - 1, "phase": phases[r]}
        for r in every
    }
    threads = {
        str(r): {
            "method": "py-spy",
            "threads": [
                {"name": "ddpdoctor-writer", "frames": _frames((DOCTOR, 1, "TraceWriter._run"))},
                {"name": "MainThread", "frames": stacks[r]},
            ],
        }
        for r in every
    }
    proof = f"ranks disagree on the op of collective #{seq}: rank(s) 0 broadcast vs rank(s) 1 barrier"
    summary = {
        "schema": "ddpdoctor.hang/1",
        "n": 1,
        "detected_wall": detected,
        "threshold_s": 10.0,
        "quiet_s": 1.9,
        "world_size": ranks,
        "action": "kill",
        "hang_dir": str(RunDir(run_dir).hang(1)),
        "statuses": statuses,
        "stacks": threads,
        "verdict": {"state": "proven", "proof": proof, "culprits": [0], "waiting": [0, 1]},
        "reported_wall": detected + 0.05,
        "killed_wall": detected + 0.1,
        "recovered": False,
    }
    _write(RunDir(run_dir).hang(1) / RunDir.HANG_SUMMARY, summary)
    _write(run_dir / RunDir.WATCH, {"hangs": [summary["hang_dir"]], "killed_on_hang": True})
    ends = {str(r): {"how": "signal", "signal": "SIGKILL", "at_wall": wall, "inferred": True} for r in every}
    _write(run_dir / RunDir.ENDS, {"schema": "ddpdoctor.ends/1", "ranks": ends})
    _meta(run_dir, 124)
    return run_dir


def raise_run(tmp_path: Path, doctor: str = DOCTOR, old: bool = False) -> Path:
    """Rank 1 raises in its own code before step STEPS's forward; rank 0, already in that step's
    backward, raises 0.9 s later when gloo notices (its backward is recorded as raised; ``old``:
    as a span cut short, as traces did before ``raised`` records).
    ``doctor``: the probe's file in rank 0's traceback (the install that recorded the run)."""
    run_dir = _base(tmp_path)
    wall1, end1 = _last(run_dir, 1)
    _, end0 = _last(run_dir, 0)
    t1 = end1 + 3_000
    error1 = {
        "type": "ValueError",
        "message": "bad batch",
        "traceback": "...",
        "frames": [["/home/u/train.py", 80, "<module>"], ["/home/u/train.py", 60, "main"]],
        "thread": "MainThread",
        "wall_ns": int((wall1 + 0.003) * 1e9),
    }
    fwd = ["forward", end0 + 500, 2_000, STEPS, 1, 1, -1, -1]
    bwd = ["backward", end0 + 2_600, 900_000, STEPS]
    if not old:
        raised = {"kind": "backward", "fields": [0], "dur_us": 905_000}
        bwd = [schema.RAISED, end0 + 2_600, 905_000, STEPS, raised]
    header0 = read_trace(RunDir(run_dir).trace(0)).header
    t0 = end0 + 2_600 + 905_000
    error0 = {
        "type": "RuntimeError",
        "message": "Connection closed by peer",
        "traceback": "...",
        "frames": [["/home/u/train.py", 62, "main"], [doctor, 257, "backward_"]],
        "thread": "MainThread",
        "wall_ns": (int(header0["wall_ns"]) // 1000 + t0) * 1000,
    }
    append_records(RunDir(run_dir).trace(1), [[schema.RANK_ERROR, t1, 0, STEPS - 1, error1]])
    append_records(RunDir(run_dir).trace(0), [fwd, bwd, [schema.RANK_ERROR, t0, 0, STEPS, error0]])
    _meta(run_dir, 1)
    return run_dir


def test_a_hang_is_drawn_to_the_kill_with_its_moments_and_stacks(tmp_path: Path) -> None:
    diag = diagnose(load_run([hang_run(tmp_path)]))
    view = diag.failure
    assert view is not None and view.kind == "hang"
    assert "The job hung (proven after 1.9 s) and ddpdoctor stopped it" in view.verdict
    kinds = {m.kind: m.time_s for m in view.markers}
    assert set(kinds) == {"verdict", "kill"} and abs(kinds["kill"] - kinds["verdict"] - 0.1) < 1e-3
    spans = {(s.rank, s.label): s for s in view.open_spans}
    assert set(spans) == {
        (0, "forward (no grad)"),
        (0, f"buffer broadcast #{STEPS + 1}"),
        (1, f"barrier #{STEPS + 1}"),
    }
    for span in spans.values():
        assert abs(span.end_s - kinds["kill"]) < 1e-6, "drawn to the end of the record: the kill"
        assert 1.85 < span.seconds < 2.05  # entered 1.9 s before the verdict
        assert span.ended_by == "killed by ddpdoctor"
    assert spans[(0, f"buffer broadcast #{STEPS + 1}")].lane == schema.Lane.COMM
    assert spans[(1, f"barrier #{STEPS + 1}")].phase == "barrier"
    assert spans[(0, "forward (no grad)")].user_frame == "evaluate() train.py:28"
    end = view.ranks[1]
    assert end.open_point == f"barrier #{STEPS + 1}" and end.user_frame == "main() train.py:71"
    # In a sync point after the last step's backward: that step, and the point it was in.
    assert (end.step, end.step_text) == (
        STEPS - 1,
        f"at step {STEPS - 1}, in barrier #{STEPS + 1} after its backward",
    )
    assert end.how_text == "killed by ddpdoctor (--on-hang kill) while hung" and end.failed
    # An evaluation forward is no step of its own: rank 0 stopped in it after the same step.
    assert view.ranks[0].step == STEPS - 1 and "after its backward" in view.ranks[0].step_text
    # The terminal says the same, ranks that stopped alike on one line.
    text = terminal.render(diag)
    assert "Where each rank stopped (the report opens on it):" in text
    assert f"barrier #{STEPS + 1} did not finish (2 s)" in " ".join(text.split())
    # Stacks: one group per distinct stack, ddpdoctor's frames and threads left out.
    assert [g.ranks for g in view.stacks] == [[0], [1]]
    assert view.stacks[0].frames[0] == "torch/nn/parallel/distributed.py:2425 _sync_buffers"
    assert view.stacks[0].frames[view.stacks[0].user] == "u/train.py:28 evaluate"
    assert not any("ddpdoctor" in line or "TraceWriter" in line for g in view.stacks for line in g.frames)
    # The parting point: #SEQ, both ranks in it and neither left it.
    parting = view.parting
    assert parting["seq"] == STEPS + 1 and parting["seqs"][-1] == STEPS + 1
    cells = parting["rows"][str(STEPS + 1)]
    assert cells["0"]["op"] == "buffer broadcast" and cells["1"]["op"] == "barrier"
    assert cells["0"]["in_flight"] and cells["1"]["in_flight"]
    assert not any(c["in_flight"] for c in parting["rows"][str(STEPS)].values() if c)
    # It opens on the last steps and the start of the stuck period, which runs on to the right:
    # drawn to the kill, a long hang would leave the steps a few pixels wide.
    lo, hi = view.window_s
    first = diag.step_spans[STEPS - 3][0]  # the last 3 steps, and a margin of 3%
    assert first - 0.04 * (hi - first) < lo < first
    stuck = max(s.start_s for s in view.open_spans)
    assert stuck < hi < kinds["kill"] and (stuck - lo) / (hi - lo) > 0.6


def test_identical_stacks_make_one_group() -> None:
    frames = _frames((TORCH, 5356, "barrier"), ("/home/u/train.py", 71, "main"))
    groups = stack_groups(
        {0: frames, 1: list(frames), 2: frames[1:]}, {0: "barrier #3", 1: "barrier #3", 2: "x"}
    )
    assert [(g.ranks, len(g.frames)) for g in groups] == [([0, 1], 2), ([2], 1)]


@pytest.mark.parametrize(
    ("recorder", "old"), [("this install", False), ("another install", False), ("this install", True)]
)
def test_a_raise_is_drawn_where_it_happened_with_the_step_counted_as_the_loop_counts(
    tmp_path: Path, recorder: str, old: bool
) -> None:
    """The same whether the run is read by the ddpdoctor that recorded it or by another one (a
    run dir copied off a cluster): the probe in rank 0's traceback is ddpdoctor's either way;
    and from a trace of a version before ``raised`` records (the span cut short redrawn)."""
    doctor = DOCTOR if recorder == "this install" else "/opt/cluster/ddpdoctor/ddpdoctor/probes/ddp.py"
    run = load_run([raise_run(tmp_path, doctor, old)])
    if old:
        run.ranks[0].header["schema"] = schema.JSONL_SCHEMA
    diag = diagnose(run)
    view = diag.failure
    assert view is not None and view.kind == "failure" and view.first_rank == 1
    assert view.verdict.startswith(
        f"The job failed: rank 1 raised ValueError: bad batch, at step {STEPS}, before its forward"
    )
    assert [(m.kind, m.rank) for m in view.markers] == [("death", 1)]
    assert view.markers[0].label == "first death: rank 1 raised ValueError: bad batch"
    r0, r1 = view.ranks[0], view.ranks[1]
    assert (r1.step, r1.mark, r1.open_point) == (STEPS, "ValueError", "")
    assert (r0.step, r0.step_text) == (STEPS, f"at step {STEPS}, in its backward")
    assert r0.how_text == "raised RuntimeError: Connection closed by peer"
    spans = {s.rank: s for s in view.open_spans}
    assert spans[1].kind == schema.USER_CODE and spans[1].user_frame == "main() train.py:60"
    # The survivor's wait for its dead peer is its backward, cut short: redrawn, not 'backward'.
    assert spans[0].kind == schema.BACKWARD and (spans[0].recorded_ts is not None) == old
    assert abs(spans[0].seconds - 0.905) < 1e-3 and spans[0].ended_by == "raised RuntimeError"
    assert view.hidden() == ({(0, schema.BACKWARD, spans[0].recorded_ts)} if old else set())
    # They parted at the collective after the last one both completed: rank 0's gradient
    # all-reduce, in its backward that never ended; rank 1 never issued it.
    parting = view.parting
    last = max(int(s) for s in parting["rows"] if all(parting["rows"][s].values()))
    assert parting["seq"] == last + 1 and parting["seqs"][-1] == last + 1
    row = parting["rows"][str(last + 1)]
    assert row["0"]["op"] == "gradient all-reduce" and row["0"]["in_flight"] and row["1"] is None


def test_the_renderers_draw_the_view_and_only_draw_it(tmp_path: Path) -> None:
    diag = diagnose(load_run([raise_run(tmp_path)]))
    page = html_report.render(diag)
    order = [page.index(f'id="{s}"') for s in ("failure", "timeline-section", "findings", "run")]
    assert order == sorted(order), "failure, its timeline, then the findings and the rest"
    assert "did not finish" in page and "first death: rank 1" in page
    assert page.count('"name":"did not finish"') == 1, "one trace of open spans"
    # Perfetto: the open spans as complete events to the death, the moments as instant events.
    events = chrome.document(diag)["traceEvents"]
    open_x = [e for e in events if e["ph"] == "X" and e["args"].get("did_not_finish")]
    assert {(e["pid"], e["cat"]) for e in open_x} == {(0, "backward"), (1, schema.USER_CODE)}
    backward = next(e for e in open_x if e["cat"] == "backward")
    span = next(s for s in diag.failure.open_spans if s.kind == "backward")
    assert backward["ts"] + backward["dur"] == round(span.end_s * 1e6)
    recorded = [e for e in events if e["ph"] == "X" and e["cat"] == "backward" and e["pid"] == 0]
    assert len(recorded) == STEPS + 1, "the cut-short backward is exported once, as did-not-finish"
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["s"], e["cat"]) for e in instants] == [("g", "death"), ("p", "rank_end"), ("p", "rank_end")]
    # diagnose --json: the same view, in its documented schema.
    doc = json.loads(json.dumps(json_report.document(diag)))["failure"]
    assert doc["schema"] == "ddpdoctor.failure/1" and doc["first_rank"] == 1
    assert set(doc["ranks"]) == {"0", "1"} and doc["ranks"]["1"]["step"] == STEPS
    assert all(s["did_not_finish"] and "recorded_ts" not in s for s in doc["open_spans"])


def test_info_notes_fold_below_the_failure(tmp_path: Path) -> None:
    from ddpdoctor.analysis.findings import Finding

    diag = diagnose(load_run([hang_run(tmp_path)]))
    diag.findings.append(Finding("comm_bound", "info", [0, 1], "a note"))
    page = html_report.render(diag)
    folded = re.search(r'<details id="folded-notes">(.*?)</details></li></ul></details>', page, re.S)
    assert folded and "comm_bound" in folded.group(1)
    assert page.index('id="failure"') < page.index('id="folded-notes"')


def test_a_healthy_run_has_no_failure_view(tmp_path: Path) -> None:
    diag = diagnose(load_run([_base(tmp_path)]))
    assert diag.failure is None
    page = html_report.render(diag)
    assert 'id="failure"' not in page and "did not finish" not in page and "folded-notes" not in page
    assert not [e for e in chrome.document(diag)["traceEvents"] if e["ph"] == "i"]
    assert json_report.document(diag)["failure"] is None
    assert "Where each rank stopped" not in terminal.render(diag)


def test_the_exported_open_spans_keep_perfetto_nesting(tmp_path: Path) -> None:
    from test_export import check_structure

    for run_dir in (hang_run(tmp_path / "hang"), raise_run(tmp_path / "raise")):
        trace = chrome.document(diagnose(load_run([run_dir])))
        by_thread = check_structure(trace, [0, 1], {0: "node0", 1: "node0"})
        assert any(e["args"].get("did_not_finish") for evs in by_thread.values() for e in evs)


def test_ranks_that_ended_alike_share_a_row_a_column_and_a_stack(tmp_path: Path) -> None:
    diag = diagnose(load_run([hang_run(tmp_path, ranks=8)]))
    assert [g.ranks for g in diag.failure.stacks] == [[0], list(range(1, 8))]
    page = html_report.render(diag)
    ends = re.search(r"<table class=ends>(.*?)</table>", page, re.S).group(1)
    assert ends.count("<tr>") == 3 and "<td>1-7</td>" in ends  # the header, rank 0, ranks 1-7
    parting = re.search(r"<table class=parting>(.*?)</table>", page, re.S).group(1)
    assert "<th>rank 0</th><th>rank 1-7</th>" in parting


def test_each_nodes_hang_summary_gives_its_own_ranks_open_spans(tmp_path: Path) -> None:
    node0 = hang_run(tmp_path)
    node1 = node0.parent / "node1"
    node1.mkdir()
    RunDir(node0).trace(1).rename(RunDir(node1).trace(1))
    path = RunDir(node0).hang(1) / RunDir.HANG_SUMMARY
    summary = json.loads(path.read_text())
    mine = {k: {"0": summary[k]["0"]} for k in ("statuses", "stacks")}
    theirs = {k: {"1": summary[k]["1"]} for k in ("statuses", "stacks")}
    _write(path, dict(summary, **mine))
    _write(RunDir(node1).hang(1) / RunDir.HANG_SUMMARY, dict(summary, **theirs))
    view = diagnose(load_run([node0, node1])).failure
    assert view is not None
    assert {(s.rank, s.kind) for s in view.open_spans} == {
        (0, "forward"),
        (0, "sync_buffers"),
        (1, "collective"),
    }


def test_a_training_forward_never_left_belongs_to_the_next_step(tmp_path: Path) -> None:
    run_dir = hang_run(tmp_path)
    path = RunDir(run_dir).hang(1) / RunDir.HANG_SUMMARY
    summary = json.loads(path.read_text())
    summary["statuses"]["0"]["phase"]["op"] = "broadcast"  # a training forward's buffer broadcast
    summary["statuses"]["0"]["step"] = STEPS  # the probe counts the step on entering its forward
    _write(path, summary)
    view = diagnose(load_run([run_dir])).failure
    end = view.ranks[0]
    assert (end.step, end.step_text) == (STEPS, f"at step {STEPS}, in its forward")
    assert {s.label: s.step for s in view.open_spans if s.rank == 0} == {
        "forward": STEPS,
        f"buffer broadcast #{STEPS + 1}": STEPS,
    }


def test_a_hang_left_alone_is_drawn_to_the_end_of_the_job(tmp_path: Path) -> None:
    run_dir = hang_run(tmp_path)
    path = RunDir(run_dir).hang(1) / RunDir.HANG_SUMMARY
    summary = dict(json.loads(path.read_text()), action="dump")
    summary.pop("killed_wall")
    _write(path, summary)
    _write(run_dir / RunDir.WATCH, {"hangs": [summary["hang_dir"]], "killed_on_hang": False})
    meta = json.loads((run_dir / RunDir.RUN_META).read_text())
    _write(run_dir / RunDir.RUN_META, dict(meta, ended_ns=int((summary["detected_wall"] + 5) * 1e9)))
    view = diagnose(load_run([run_dir])).failure
    assert [m.kind for m in view.markers] == ["verdict"], "no kill"
    verdict = view.markers[0].time_s
    for span in view.open_spans:  # Ctrl-C 5 s after the verdict ended the job
        assert span.end_s == pytest.approx(verdict + 5, abs=1e-3) and span.ended_by == "the end of the job"


def test_the_window_opens_on_the_last_steps_on_record_when_their_numbers_have_gaps() -> None:
    """A loop that catches an exception and goes on leaves a step cut short with no span:
    steps 7, 9 and 10 on record, none for 8. The window opens on the first of the last three
    (it raised KeyError on the missing step 8)."""
    from ddpdoctor.analysis.failed.failure import FailureView, Marker, _window

    view = FailureView("failure", "rank 0 exited", 0, markers=[Marker(12.0, "exit", "death", 0)])
    spans = {5: (1.0, 2.0), 7: (3.0, 4.0), 9: (5.0, 6.0), 10: (7.0, 8.0)}
    window = _window(spans, view)
    assert window is not None and 4.5 < window[0] < 5.0 and window[1] > 8.0


def test_the_last_steps_fill_most_of_the_axis_however_short_they_are() -> None:
    """Three steps of half a millisecond, then a hang of minutes killed: the steps still take
    most of the timeline's width (a floor of a millisecond once gave the hang 40 % of it)."""
    from ddpdoctor.analysis.failed.failure import FailureView, Marker, _window

    for step_s in (0.0005, 0.05, 2.0):
        spans = {s: (1.0 + s * step_s, 1.0 + (s + 1) * step_s) for s in range(31)}
        stuck = spans[30][1]
        view = FailureView("hang", "hung", 1, markers=[Marker(stuck + 300.0, "killed", "kill")])
        lo, hi = _window(spans, view)
        assert stuck < hi < stuck + 300.0
        assert (stuck - lo) / (hi - lo) > 0.6, (step_s, lo, hi, stuck)
