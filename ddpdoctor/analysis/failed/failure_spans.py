"""The spans a rank entered and never left, from the facts the run directory keeps.

The trace holds only spans a rank left. A hang summary holds each rank's status (sync point,
op, sequence number, since when) and stack; a rank's ``rank_error`` record holds the exception
that unwound a span (the probes then record the span as if it had ended); ``ends.json`` holds
a fatal signal's stack. Each open span runs from its start to the end of the rank's record.
Pure: reads the Run and its hang summaries only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ddpdoctor.analysis.failed import endings
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Point
from ddpdoctor.analysis.hung.hang import in_own_code, main_thread
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.merge import TimeBase
from ddpdoctor.trace.reader import RankTrace, Run
from ddpdoctor.trace.stacktext import is_doctor_frame, is_user_frame

# The phases whose outermost span carries the sequence number the watcher saw.
_WATCHED_PHASES = {p.value: p.spans[0][0] for p in (LivePhase.BACKWARD, LivePhase.COLLECTIVE)}


@dataclass
class OpenSpan:
    """A span a rank entered and never left, drawn from its start to the end of its record."""

    rank: int
    kind: str  # a schema kind, or schema.USER_CODE
    phase: str  # the schema phase that styles it ("barrier", "forward", ...; "user_code")
    lane: int  # schema.Lane
    label: str  # "barrier #24", "buffer broadcast #24", "backward", "user code"
    start_s: float  # seconds on the run's common time base
    end_s: float
    step: int  # the trace's step field: the last training step started
    op: str | None = None
    seq: int | None = None
    user_frame: str = ""  # the rank's innermost user frame: "evaluate() faulty_train.py:28"
    ended_by: str = ""  # "hang verdict", "killed by ddpdoctor", "raised RuntimeError", ...
    recorded_ts: int | None = None  # the trace holds it (cut short by an exception): its raw ts

    @property
    def seconds(self) -> float:
        return max(0.0, self.end_s - self.start_s)


class Clock:
    """Wall seconds (a rank's own clock, or the supervisor's) to seconds on the common base."""

    def __init__(self, run: Run, tb: TimeBase) -> None:
        self.run, self.tb = run, tb

    def wall(self, rank: int | None, wall: Any) -> float | None:
        if not isinstance(wall, (int, float)) or not wall:
            return None
        offset = (self.tb.clock_offset_us.get(rank) or 0) if rank is not None else 0
        return (float(wall) * 1e6 + offset - self.tb.origin_us) / 1e6

    def last_end(self, rank: int, trace: RankTrace, but: str = "") -> float:
        """The end of the rank's last recorded span (of any kind but ``but``), on the common base."""
        ends = [
            int(ev.end.max()) for k, ev in trace.events.items() if len(ev) and k in schema.KINDS and k != but
        ]
        return float(self.tb.rel(rank, max(ends, default=0))) / 1e6 if ends else 0.0


def open_spans(
    run: Run,
    clock: Clock,
    rank: int,
    trace: RankTrace,
    ending: endings.Ending,
    hang: dict[str, Any] | None,
    end_s: float,
    ended_by: str,
    died_in: Point | None = None,
    in_flight: Point | None = None,
) -> tuple[list[OpenSpan], list[dict[str, Any]]]:
    """The spans the rank never left, and its stack (innermost first) at the end; ``died_in``:
    the sync point a signal killed it in, as its ledger read it from its death stack;
    ``in_flight``: the one a hang found it in, as its ledger placed it (a backward's next
    bucket; none where its own code ran inside a DDP pass)."""
    if not ended_by:
        return [], []
    step = int(trace.kind(schema.FORWARD).step.max(initial=-1))
    last = clock.last_end(rank, trace)
    if hang is not None:
        status = (hang.get("statuses") or {}).get(str(rank)) or {}
        dump = (hang.get("stacks") or {}).get(str(rank)) or {}
        frames = main_thread(dump.get("threads") or [])
        user = _user(frames)
        phase = status.get("phase") or None
        step = int(status.get("step", step)) if isinstance(status.get("step"), int) else step
        if phase and LivePhase.of(phase.get("name")) is not None:
            since = float(phase.get("since_s") or 0.0)
            start = clock.wall(rank, float(status.get("heartbeat_wall") or 0) - since)
            # The status' wall clock and the trace's monotonic one differ by a little: the sync
            # point began after every span it does not enclose had ended (bucket all-reduces
            # end inside their backward).
            floor = clock.last_end(rank, trace, but=schema.ALLREDUCE)
            start = min(max(start if start is not None else last, floor), end_s)
            spans = _from_phase(rank, phase, start, end_s, step, user, ended_by)
            if in_own_code(phase, frames):  # its own code inside the pass: no collective open
                return [s for s in spans if s.lane == int(schema.Lane.COMPUTE)], frames
            if in_flight is not None and in_flight.seq >= 0:
                for span in spans:
                    if span.seq is not None and span.seq != in_flight.seq:
                        span.label = span.label.replace(f"#{span.seq}", f"#{in_flight.seq}")
                        span.seq = in_flight.seq
            return spans, frames
        return [_user_code(rank, last, end_s, step, user, ended_by)], frames
    if ending.how == "exception" and ending.error:
        frames = [
            {"file": f[0], "line": f[1], "function": f[2]}
            for f in reversed(ending.error.get("frames") or [])
            if isinstance(f, (list, tuple)) and len(f) >= 3
        ]
        user = _user(frames)
        if any(is_doctor_frame(str(f["file"])) for f in frames):  # raised inside a sync point?
            spans = _cut_short(rank, trace, clock, end_s, step, user, ended_by)
            _seen_in(run, rank, spans)
            if spans:
                return spans, frames
        return [_user_code(rank, last, end_s, step, user, ended_by)], frames
    end = run.ends.get(rank) or {}
    frames = _fatal_frames(str(end.get("stack") or ""))
    if died_in is not None:  # its death stack shows it inside a collective (ledger.died_in)
        grad = died_in.op == GRAD_ALLREDUCE
        phase = {"name": "backward" if grad else "collective", "op": died_in.op, "seq": died_in.seq}
        return _from_phase(rank, phase, last, end_s, step, _user(frames), ended_by), frames
    return [_user_code(rank, last, end_s, step, _user(frames), ended_by)], frames


def _user(frames: list[dict[str, Any]]) -> str:
    frame = next((f for f in frames if is_user_frame(str(f.get("file", "")))), None)
    if frame is None:
        return ""
    return f"{frame.get('function')}() {os.path.basename(str(frame.get('file')))}:{frame.get('line')}"


def _fatal_frames(text: str) -> list[dict[str, Any]]:
    """The main thread of a faulthandler dump (fatal-rank{R}.txt), innermost first."""
    if not text:
        return []
    from ddpdoctor.trace.stacktext import parse_faulthandler

    return main_thread(parse_faulthandler(text))


def _phase_of(kind: str, op: str | None) -> str:
    """The schema phase whose style an open span of ``kind`` takes."""
    for name, phase in schema.PHASES.items():
        if phase.kind != kind:
            continue
        if phase.where is None or (phase.where[1] == op) != phase.negate:
            return name
    return kind


def _from_phase(
    rank: int, phase: dict[str, Any], start: float, end: float, step: int, user: str, ended_by: str
) -> list[OpenSpan]:
    name, op, seq = phase.get("name"), phase.get("op"), phase.get("seq")
    seq = int(seq) if isinstance(seq, int) and seq >= 0 else None
    num = f" #{seq}" if seq is not None else ""
    spans = []
    for kind, lane in LivePhase(name).spans:
        if kind == schema.FORWARD:
            label = "forward (no grad)" if "eval" in str(op) or op == "no_grad" else "forward"
            span_op, span_seq = None, None
        elif kind == schema.SYNC_BUFFERS:
            live = LivePhase.SYNC_BUFFERS
            label, span_op, span_seq = f"{live.label}{num}", live.op, seq
        elif kind == schema.ALLREDUCE:
            live = LivePhase.BACKWARD
            label, span_op, span_seq = f"{live.label}{num}", live.op, seq
        elif kind == schema.COLLECTIVE:
            label, span_op, span_seq = f"{op}{num}", str(op), seq
        elif kind == schema.DATA_WAIT:
            label, span_op, span_seq = "data wait", None, None
        else:
            label, span_op, span_seq = kind, None, None
        span = OpenSpan(rank, kind, _phase_of(kind, span_op), int(lane), label, start, end, step)
        span.op, span.seq, span.user_frame, span.ended_by = span_op, span_seq, user, ended_by
        spans.append(span)
    return spans


def _user_code(rank: int, start: float, end: float, step: int, user: str, ended_by: str) -> OpenSpan:
    return OpenSpan(
        rank, schema.USER_CODE, schema.USER_CODE, int(schema.Lane.COMPUTE), schema.USER_CODE_LABEL,
        min(start, end), end, step, user_frame=user, ended_by=ended_by,
    )  # fmt: skip


def _cut_short(
    rank: int, trace: RankTrace, clock: Clock, end: float, step: int, user: str, ended_by: str
) -> list[OpenSpan]:
    """The spans an exception unwound, each drawn up to the exception: the trace's ``raised``
    records of the last exception (a raised record that later spans follow was caught)."""
    done = [
        int(ev.end.max())
        for k, ev in trace.events.items()
        if len(ev) and k in schema.KINDS and k not in schema.DEVICE_KINDS.values()
    ]
    raised = [(ts + int(i.get("dur_us") or 0), ts, s, i) for ts, s, i in trace.meta.get(schema.RAISED, [])]
    last = max((r[0] for r in raised), default=None)
    if last is None:  # no sync point raised: the exception came from another wrapped call
        if trace.header.get("schema") == schema.SCHEMA:  # (torch.save after the optimizer step)
            return []
        return _cut_short_before_raised(rank, trace, clock, end, step, user, ended_by)
    spans = []
    for stop, ts, span_step, info in sorted(raised, key=lambda r: r[1]):
        kind = str(info.get("kind"))
        if kind not in schema.KINDS or stop < last - 100_000 or stop < max(done, default=0):
            continue
        spans.append(_span_of(rank, clock, kind, tuple(info.get("fields") or ()), ts, span_step, end))
    for span in spans:
        span.user_frame, span.ended_by = user, ended_by
    return spans


def _span_of(rank: int, clock: Clock, kind: str, fields: tuple, ts: int, step: int, end: float) -> OpenSpan:
    args = schema.KINDS[kind].args(fields)
    seq = args.get("seq") if isinstance(args.get("seq"), int) and args["seq"] >= 0 else None
    op = args.get("op") if kind == schema.COLLECTIVE else None
    lane = next((p.lane for p in schema.PHASES.values() if p.kind == kind), schema.Lane.COMPUTE)
    label = schema.KINDS[kind].describe(fields) + (
        f" #{seq}" if kind != schema.FORWARD and seq is not None else ""
    )
    start = float(clock.tb.rel(rank, ts)) / 1e6
    span = OpenSpan(rank, kind, _phase_of(kind, op), int(lane), label, start, max(end, start), step)
    span.op, span.seq = op, seq
    return span


def _cut_short_before_raised(
    rank: int, trace: RankTrace, clock: Clock, end: float, step: int, user: str, ended_by: str
) -> list[OpenSpan]:
    """Traces written before ``raised`` records recorded an unwound span as if it had ended:
    the rank's last span and those enclosing it (a backward ends after its bucket all-reduces)."""
    found: list[tuple[int, int, str, tuple, int]] = []  # end, ts, kind, fields, step
    for kind, ev in trace.events.items():
        if kind not in schema.KINDS or not len(ev) or schema.KINDS[kind].name.startswith("dev_"):
            continue
        i = int(ev.end.argmax())
        found.append((int(ev.end[i]), int(ev.ts[i]), kind, ev.fields[i], int(ev.step[i])))
    if not found:
        return []
    last_end = max(f[0] for f in found)
    last_start = max(f[1] for f in found if f[0] == last_end)
    spans = []
    for e, ts, kind, fields, span_step in sorted(found, key=lambda f: f[1]):
        if e < last_end - 1000 or ts > last_start:  # not the last span, nor one around it
            continue
        span = _span_of(rank, clock, kind, fields, ts, span_step, end)
        span.user_frame, span.ended_by, span.recorded_ts = user, ended_by, ts
        spans.append(span)
    return spans


def _seen_in(run: Run, rank: int, spans: list[OpenSpan]) -> None:
    """Name the collective a cut-short span waited in, from the watcher's look at this rank when
    another rank exited or raised (watch.json: its phase, op and sequence number)."""
    for watch in run.watches:
        for key in ("rank_exits", "rank_errors"):
            for seen in (watch.get(key) or {}).values():
                look = ((seen or {}).get("others") or {}).get(str(rank)) or {}
                kind = _WATCHED_PHASES.get(str(look.get("phase")))
                seq = look.get("seq")
                for span in spans:
                    if span.kind == kind and span.seq is None and isinstance(seq, int) and seq >= 0:
                        span.seq, span.op = seq, str(look.get("op") or "")
                        if kind == schema.BACKWARD:
                            span.label = f"backward ({LivePhase.BACKWARD.label} #{seq})"
