"""The failure view: a hung or failed run drawn where it happened, for every renderer.

A rank's trace holds only the spans it left: the forward it was evaluating, the broadcast or
barrier it waited in and the user code it ran when it died were never written. Their facts are
elsewhere in the run directory: the hang summary (each rank's status: sync point, op, sequence
number, since when; its stack), the supervisor's ends (signal, exception, exit code) and the
rank's own ``rank_error`` record (an exception unwinds a span, which is then recorded as if it
had ended). ``failure_view`` puts them together once, as plain data: the verdict, how each rank
ended and at which step, the spans each rank entered and never left (to the end of its record),
the moments (verdict, kill, first death), the stacks grouped by identical stack and the
collectives around the point where the ranks parted. The HTML timeline and failure section,
the Perfetto export and ``diagnose --json`` only draw it.

Steps are counted as everywhere in ddpdoctor: 0-based, the index of the training step as in
``for step in range(n)``. A rank that ends inside a step's forward or backward ended at that
step; one that ends after step k's backward (between steps, in evaluation, before the next
forward) ended at step k + 1, before its forward: a rank that raises before step 7's forward
died at step 7.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpdoctor.analysis.failed import endings
from ddpdoctor.analysis.failed import ledger as ledgers
from ddpdoctor.analysis.failed.failure_parts import StackGroup, parting_table, stack_groups
from ddpdoctor.analysis.failed.failure_spans import Clock, OpenSpan, open_spans
from ddpdoctor.analysis.failed.points import Ledger
from ddpdoctor.analysis.findings import Finding, clip
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import TimeBase
from ddpdoctor.trace.reader import RankTrace, Run

SCHEMA = "ddpdoctor.failure/1"
LAST_STEPS = 3  # the timeline opens on this many steps before the failure
STUCK_SHARE = 0.5  # ... and on this much more of what followed (their time's share)
_FAILED = ("exception", "exit_code", "signal", "vanished", "stopped_on_hang", "interrupted")
_STOPPED = ("stopped_on_hang", "interrupted")  # ended by ddpdoctor or the user, not by a failure


@dataclass
class Marker:
    """A moment drawn across every rank: the hang verdict, the kill, the first death."""

    time_s: float
    label: str
    kind: str  # "verdict" | "kill" | "death"
    rank: int | None = None
    title: str = ""  # a few words for the line's label on the timeline


@dataclass
class RankEnd:
    """How one rank's record ended and where it stood."""

    rank: int
    how: str  # endings.Ending.how
    how_text: str  # "killed by SIGKILL", "raised RuntimeError: ...", "os._exit(7)"
    step: int  # by the module's rule
    step_text: str
    end_s: float
    last_completed: str  # the last sync point it finished ("all_reduce #18 (step 6) at x.py:64")
    open_point: str  # the one it was in ("barrier #24"), or "" when in none
    user_frame: str
    failed: bool  # this rank's end is a failure (not a clean exit)
    mark: str = ""  # the end in a word or two, for the lane's end: "SIGKILL", "RuntimeError", "exit 7"


@dataclass
class FailureView:
    kind: str  # "hang" | "failure"
    verdict: str
    first_rank: int | None
    ranks: dict[int, RankEnd] = field(default_factory=dict)
    open_spans: list[OpenSpan] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    stacks: list[StackGroup] = field(default_factory=list)
    parting: dict[str, Any] = field(default_factory=dict)  # {"seq", "seqs", "rows"}: see parting_table
    window_s: tuple[float, float] | None = None  # where the timeline opens

    def hidden(self) -> set[tuple[int, str, int]]:
        """(rank, kind, ts) of recorded spans that are drawn as open spans instead."""
        return {(s.rank, s.kind, s.recorded_ts) for s in self.open_spans if s.recorded_ts is not None}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = SCHEMA
        out["ranks"] = {str(r): asdict(e) for r, e in sorted(self.ranks.items())}
        for span in out["open_spans"]:
            span.pop("recorded_ts")
            span["seconds"] = round(span["end_s"] - span["start_s"], 6)
            span["did_not_finish"] = True
        out["window_s"] = list(self.window_s) if self.window_s else None
        return out


def failure_view(
    run: Run, findings: list[Finding], tb: TimeBase, steps: Callable[[], dict[int, tuple[float, float]]]
) -> FailureView | None:
    """The failure of a hung or failed run, or None for a run that went well (or still runs).
    ``steps`` gives the steps' spans, read for a failure's window only (a healthy run's
    diagnosis computes none)."""
    hang = _live_hang(run, findings)
    if hang is None and not any(endings.how_it_ended(run, r).how in _FAILED for r in run.ranks):
        return None  # a healthy run (the common case) pays for no ledger
    books = ledgers.build(run)
    failed = {r: lg.ending for r, lg in books.items() if lg.ending.how in _FAILED}
    clock = Clock(run, tb)
    view = FailureView("hang" if hang else "failure", _verdict(findings, hang), None)
    killed = bool(hang and hang.get("action") == "kill" and any(w.get("killed_on_hang") for w in run.watches))
    stacks: dict[int, list[dict[str, Any]]] = {}
    for rank, book in sorted(books.items()):
        trace = run.ranks.get(rank)
        if trace is None:
            continue
        end_s, ended_by = _end_of(run, clock, rank, book.ending, hang, killed)
        died_in = next((p for p in book.points if p.died_in), None)
        flight = next((p for p in reversed(book.points) if p.in_flight), None)
        ending = book.ending
        spans, frames = open_spans(run, clock, rank, trace, ending, hang, end_s, ended_by, died_in, flight)
        stacks[rank] = frames
        view.open_spans.extend(spans)
        view.ranks[rank] = _rank_end(rank, trace, book, spans, end_s)
        supervisor = run.ends.get(rank) or {}
        if book.ending.how == "vanished" and supervisor.get("how") == "os_exit":
            code = supervisor.get("code")
            view.ranks[rank].how_text = f"exited with code {code} (os._exit)"
            view.ranks[rank].mark = f"exit {code}"
        if killed and ended_by:
            view.ranks[rank].how_text = "killed by ddpdoctor (--on-hang kill) while hung"
            view.ranks[rank].mark = "killed on hang"
    if hang is not None:
        detected = clock.wall(None, hang.get("detected_wall"))
        if detected is not None:
            proof = (hang.get("verdict") or {}).get("proof") or "no progress"
            view.markers.append(Marker(detected, f"hang verdict: {proof}", "verdict", title="hang verdict"))
        kill = clock.wall(None, hang.get("killed_wall") or hang.get("reported_wall")) if killed else None
        if kill is not None:
            view.markers.append(Marker(kill, "killed by ddpdoctor (--on-hang kill)", "kill", title="killed"))
        interrupt = _interrupted(run, clock)
        if interrupt is not None and kill is None:
            label = "the user's interrupt (Ctrl-C): ddpdoctor ended the hung ranks"
            view.markers.append(Marker(interrupt, label, "kill", title="Ctrl-C"))
            view.verdict = view.verdict.replace(":", ", then the user interrupted it (Ctrl-C):", 1)
        view.first_rank = next(iter(_culprits(findings)), None)
    firsts = sorted((e.end_s, r) for r, e in view.ranks.items() if e.failed and e.how not in _STOPPED)
    own = [(t, r) for t, r in firsts if not failed[r].consequence]
    if firsts and hang is None:
        t, rank = (own or firsts)[0]
        view.first_rank = rank
        view.verdict = _death_verdict(view, rank)
        label = f"first death: rank {rank} {view.ranks[rank].how_text}"
        view.markers.append(Marker(t, label, "death", rank, f"rank {rank} died"))
    view.stacks = stack_groups(stacks, {r: e.open_point or "user code" for r, e in view.ranks.items()})
    view.parting = parting_table(books, view.open_spans)
    view.window_s = _window(steps(), view)
    return view


def _interrupted(run: Run, clock: Clock) -> float | None:
    """When the user's Ctrl-C made ddpdoctor end the hung job (common base), or None."""
    key = RunDir.INTERRUPTED_HUNG
    at = [m[key] / 1e9 for m in run.metas if isinstance(m.get(key), int)]
    return clock.wall(None, min(at)) if at else None


def _live_hang(run: Run, findings: list[Finding]) -> dict[str, Any] | None:
    """The last hang summary the diagnosis stands by (a hang finding was given). Each node's
    supervisor keeps its own ranks' statuses and stacks: the other nodes' fill in theirs."""
    if not any(f.kind == "hang" for f in findings) or not run.hangs:
        return None
    standing = [h for h in run.hangs if not h.get("recovered")]
    if not standing:
        return None
    merged = dict(standing[-1])
    for key in ("statuses", "stacks"):
        merged[key] = {}
        for summary in standing:  # the latest word on each rank last
            merged[key].update(summary.get(key) or {})
    return merged


def _culprits(findings: list[Finding]) -> list[int]:
    """The ranks the first error blames: its root rank when it names one, else its ranks."""
    for f in findings:
        if f.severity == "error" and f.ranks:
            root = f.details.get("root_rank")
            return [root] if isinstance(root, int) else list(f.ranks)
    return []


def _verdict(findings: list[Finding], hang: dict[str, Any] | None) -> str:
    """One sentence: what happened, then the doctor's first error (the cause)."""
    error = next((f for f in findings if f.severity == "error"), None)
    if hang is not None:
        verdict = hang.get("verdict") or {}
        lead = (
            f"The job hung (proven after {float(hang.get('quiet_s') or 0):.1f} s)"
            if verdict.get("state") == "proven"
            else f"The job hung (no progress for {float(hang.get('quiet_s') or 0):.0f} s)"
        )
        if hang.get("action") == "kill":
            lead += " and ddpdoctor stopped it"
    else:
        lead = "The job failed"
    return f"{lead}: {error.summary}" if error is not None else f"{lead}."


def _death_verdict(view: FailureView, first: int) -> str:
    """The first death in words, then the others in a word each: what the page opens with."""
    end = view.ranks[first]
    text = f"The job failed: rank {first} {end.how_text}, {end.step_text}"
    then = []
    for e in (e for r, e in sorted(view.ranks.items()) if r != first and e.failed):
        verb = "raised " if e.how == "exception" else ""
        then.append(
            f"rank {e.rank} {verb}{e.mark or e.how}" + (f" in {e.open_point}" if e.open_point else "")
        )
    if then:
        text += f". Then: {'; '.join(then)} (waiting for it)"
    return text + "."


def _end_of(
    run: Run, clock: Clock, rank: int, ending: endings.Ending, hang: dict[str, Any] | None, killed: bool
) -> tuple[float, str]:
    """When the rank's record ended (common base) and what ended it."""
    trace = run.ranks[rank]
    last = clock.last_end(rank, trace)
    if hang is not None:  # stuck until the kill, or until the job ended some other way (Ctrl-C)
        if killed:
            at, what = (
                clock.wall(None, hang.get("killed_wall") or hang.get("reported_wall")),
                "killed by ddpdoctor",
            )
        else:
            ended = [m["ended_ns"] / 1e9 for m in run.metas if isinstance(m.get("ended_ns"), int)]
            at, what = clock.wall(None, max(ended)) if ended else None, "the end of the job"
        if at is None:
            at, what = clock.wall(None, hang.get("detected_wall")), "hang verdict"
        return max(last, at if at is not None else last), what
    if ending.how == "exception":
        at = clock.wall(rank, ending.wall_s)
        kind = (ending.error or {}).get("type") or "an exception"
        return max(last, at if at is not None else last), f"raised {kind}"
    if ending.how in ("signal", "vanished", "exit_code"):
        at = clock.wall(rank, ending.wall_s)
        what = f"killed by {ending.signal}" if ending.signal else "ended without a word"
        what = f"exited with code {ending.code}" if ending.how == "exit_code" else what
        return max(last, at if at is not None else last), what
    return last, ""


def _rank_end(rank: int, trace: RankTrace, book: Ledger, spans: list[OpenSpan], end_s: float) -> RankEnd:
    ending = book.ending
    cut = {(s.kind, s.recorded_ts) for s in spans if s.recorded_ts is not None}
    last = book.last_step
    backwards = trace.kind(schema.BACKWARD)
    pairs = zip(backwards.step.tolist(), backwards.ts.tolist())
    finished = any(s == last and (schema.BACKWARD, t) not in cut for s, t in pairs)
    # A training forward the trace never recorded: the step it began (the trace's last + 1).
    entering = [
        s for s in spans if s.kind == schema.FORWARD and s.label == "forward" and s.recorded_ts is None
    ]
    # An evaluation forward (no grad) runs between steps: it does not make a step.
    in_step = any(s.kind in (schema.BACKWARD, schema.ALLREDUCE) or s.label == "forward" for s in spans)
    if trace.header.get("attached"):  # its stacks only: which step it was at is not known
        step, text = -1, "step unknown (attached: nothing recorded)"
    elif entering:
        # the step it began (a hang's status, a raised record), else the trace's last + 1
        step = entering[0].step if entering[0].step >= max(last, 0) else last + 1
        text = f"at step {step}, in its forward"
    elif last < 0 and not in_step:
        # steps are counted from a DDP model's forwards; a loop that syncs its gradients by
        # hand has none, but its optimizer steps say how far it got
        done = len(trace.kind(schema.OPTIMIZER))
        step, text = (
            0,
            f"after {done} optimizer step(s), no DDP forward on record" if done else "before its first step",
        )
    elif finished and not in_step and spans and spans[-1].kind == schema.DATA_WAIT:
        # Loading the next step's batch (its dataset or collate_fn raised, a worker died).
        step, text = last + 1, f"at step {last + 1}, in its data wait (step {last}'s backward had finished)"
    elif finished and not in_step and any(s.kind != schema.USER_CODE for s in spans):
        # In a collective after its backward (a metrics all_reduce, a barrier): still step k.
        point = next(s.label for s in reversed(spans) if s.kind != schema.USER_CODE)
        step, text = last, f"at step {last}, in {point} after its backward"
    elif finished and not in_step:
        # Between two steps' sync points: the end of iteration k or the start of k + 1 look
        # alike to them; counted as k + 1 (a rank that raises before step 7's forward died at
        # step 7), said both ways so the user can match it to their loop.
        step, text = (
            last + 1,
            f"at step {last + 1}, before its forward (step {last}'s backward had finished)",
        )
    else:
        step = max(last, 0)
        inner = next((s.label for s in reversed(spans) if s.kind in (schema.FORWARD, schema.BACKWARD)), "")
        text = f"at step {step}" + (f", in its {inner}" if inner else "")
    done = [p for p in book.points if not p.in_flight and not p.raised]
    open_point = next((s.label for s in reversed(spans) if s.kind != schema.USER_CODE), "")
    user = next((s.user_frame for s in spans if s.user_frame), "") or book.place
    how = _how_text(ending) if not trace.header.get("attached") else _how_text(endings.Ending("attached"))
    return RankEnd(
        rank, ending.how, how, step, text, round(end_s, 6),
        done[-1].describe() if done else "", open_point, user, ending.how in _FAILED, _mark(ending),
    )  # fmt: skip


def _mark(ending: endings.Ending) -> str:
    if ending.how == "exception" and ending.error:
        return str(ending.error.get("type") or "exception")
    if ending.how == "signal":
        return str(ending.signal)
    return {
        "exit_code": f"exit {ending.code}",
        "vanished": "vanished",
        "stopped_on_hang": "stopped on hang",
        "interrupted": "interrupted (Ctrl-C)",
    }.get(ending.how, "")


def _how_text(ending: endings.Ending) -> str:
    if ending.how == "exception" and ending.error:
        message = str(ending.error.get("message") or "").splitlines()[:1]
        return f"raised {ending.error.get('type')}" + (f": {clip(message[0], 200)}" if message else "")
    if ending.how == "signal":
        return f"killed by {ending.signal}"
    return {
        "clean_exit": "exited cleanly",
        "exit_code": f"exited with code {ending.code}, no traceback (sys.exit or SystemExit)",
        "vanished": "ended without an exception or a signal seen (os._exit?)",
        "stopped_on_hang": "stopped by ddpdoctor while hung",
        "interrupted": "stopped on the user's interrupt (Ctrl-C) while hung",
        "running": "still running when the record ends",
        "attached": "still running when ddpdoctor attached",
    }.get(ending.how, ending.how)


def _window(spans: dict[int, tuple[float, float]], view: FailureView) -> tuple[float, float] | None:
    """The last few steps before the failure and the stuck or dying period after it."""
    ends = [s.end_s for s in view.open_spans] + [m.time_s for m in view.markers]
    ends += [e.end_s for e in view.ranks.values()]
    if not ends:
        return None
    hi = max(ends)
    starts = [s.start_s for s in view.open_spans]
    if spans:
        last = max(spans)
        # the first of the last steps on record (a step cut short by an exception the loop
        # caught may have left no span: the numbers need not be contiguous)
        first = min(s for s in spans if s >= last - LAST_STEPS + 1)
        lo = spans[first][0]
        # The steps fill most of the axis and the stuck spans run on past its right edge: a
        # hang of minutes drawn whole would leave the steps a few pixels wide. Their share holds
        # for steps of any length (a floor of a millisecond took half the axis from three steps
        # of half a millisecond each); the floor only keeps the axis open when they took none.
        stuck = max([spans[last][1], *starts])
        hi = min(hi, stuck + max(STUCK_SHARE * (stuck - lo), 1e-6))
    else:
        lo = min(starts, default=hi)
    lo = min([lo] + starts)
    pad = 0.03 * max(hi - lo, 1e-3)
    return (round(lo - pad, 6), round(hi + pad, 6))
