"""Every rank's ledger: the sync points it issued, in order, the steps and data passes it ran,
and how it ended (``ending.py``); then where the ledgers first part ways.

A distributed job goes wrong where its ranks stop doing the same thing: one issues a collective
the others do not, leaves while they go on, or reads more batches. Errors that follow on the
other ranks (peer closed, timeouts, aborts) are consequences of that first divergence. So the
judgement starts from facts every job leaves (each rank's trace, the supervisor's exit records
and the stacks of a hang), not from a ladder of patterns over one snapshot. Where the ledgers
first part ways is ``parting.first_divergence``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ddpdoctor.analysis.failed.endings import how_it_ended, last_step_started, merged_watch
from ddpdoctor.analysis.failed.passes import passes
from ddpdoctor.analysis.failed.points import BUFFERS, FORWARD, GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.analysis.failed.stacks import (
    death_stack,
    error_frames,
    exit_stack,
    hang_frames,
    last_frames,
    user_frame,
    user_frames,
)
from ddpdoctor.analysis.hung.hang import in_own_code
from ddpdoctor.probes.collectives import COLLECTIVE_OPS
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import count_distinct
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.reader import RankTrace, Run


def sites_of(trace: RankTrace) -> dict[int, str]:
    """Interned call-site ids to file:line."""
    return {
        int(info["id"]): f"{os.path.basename(str(info.get('file')))}:{info.get('line')}"
        for _, _, info in trace.meta.get(schema.SITE, [])
        if isinstance(info.get("id"), int)
    }


def recorded_files(run: Run) -> list[str]:
    """The user's files the ranks recorded lines in (call sites), where they are on disk: the
    scripts a finding may read for the line that did what the trace shows."""
    files = {str(i.get("file")) for t in run.ranks.values() for _, _, i in t.meta.get(schema.SITE, [])}
    return sorted(f for f in files if os.path.isfile(f))


def _in_flight(run: Run, rank: int, ledger: Ledger) -> tuple[Point | None, str]:
    """The sync point a rank was inside when the last hang was recorded, and its stack's place.
    None inside a DDP pass whose stack shows the user's own code running there (a hook, an
    autograd Function): the pass waits on it, no collective is in flight."""
    if not run.hangs:
        return None, ""
    summary = run.hangs[-1]
    status = RankStatus.of((summary.get("statuses") or {}).get(str(rank)) or {"rank": rank})
    frames = hang_frames(summary, rank)
    place = user_frame(frames)
    phase = status.phase or {}
    name, op = phase.get("name"), phase.get("op")
    live = status.live_phase
    if not name or live is LivePhase.DATA or in_own_code(phase, frames):
        return None, place
    if live is LivePhase.COLLECTIVE:
        label = str(op)
    elif live is LivePhase.FORWARD:
        label = f"{FORWARD} ({op})"
    else:
        label = live.label if live is not None else str(name)
        if live is LivePhase.SYNC_BUFFERS and "eval" in str(op):
            label += " (eval)"
    seq = int(phase["seq"]) if isinstance(phase.get("seq"), int) else -1
    if live is LivePhase.BACKWARD and seq >= 0:  # past the buckets this backward has reduced
        done = [
            p.seq for p in ledger.points if p.op == GRAD_ALLREDUCE and p.step == status.step and p.seq >= seq
        ]
        seq = max(done, default=seq - 1) + 1
    group = str(phase.get("group") or "WORLD")  # its group's numbers: another group's are not WORLD's
    point = Point(
        seq, label, 0, group, status.step, place,
        in_flight=True, dtype=str(phase.get("dtype") or ""), numel=int(phase.get("numel") or 0),
        root=int(phase.get("root", -1) if phase.get("root") is not None else -1), ranks=phase.get("ranks"),
    )  # fmt: skip
    return point, place


_C10D = ("torch/distributed/distributed_c10d.py",)
_BACKWARD = ("torch/_tensor.py", "torch/autograd/__init__.py")


def died_in(run: Run, rank: int, ledger: Ledger) -> tuple[Point | None, str]:
    """The sync point a rank was inside when a signal killed it, from the Python stack it left
    (faulthandler's dump in ends.json: SIGABRT/SIGSEGV, or SIGTERM from the launcher), or when
    it raised (its exception's traceback), and the stack's place in the user's code. Its
    sequence number is not in the stack: it is the one after the last this rank recorded (a
    collective in flight has not been written yet), which holds as long as nothing unrecorded
    ran on the group in between. A stack with no frame of the user's code (killed as an
    excepthook ran, or by SIGKILL: no stack at all) falls back on the trace: a raised backward
    as the rank's last record is its gradient all-reduce."""
    if (run.ends.get(rank) or {}).get("how") == "signal":
        frames = death_stack(run, rank)
    else:  # the traceback of what it raised (inside a collective, it was there), or its exit call
        frames = error_frames(ledger) or exit_stack(run, rank)
    place = user_frame(frames) if frames else ""
    op = None
    for frame in reversed(frames or []):  # outermost first: the call the user made
        file = str(frame.get("file", "")).replace(os.sep, "/")
        if file.endswith(_C10D) and frame.get("function") in COLLECTIVE_OPS:
            op = str(frame["function"])
            break
        if file.endswith(_BACKWARD) and frame.get("function") == "backward":
            # a backward inside a training step's DDP forward: its gradient all-reduce
            if ledger.forwards and ledger.forwards[-1][1] and not _reduced(ledger):
                op = GRAD_ALLREDUCE
            break
    if op is None and not place and _raised_last_in_backward(ledger) and not _reduced(ledger):
        # No frame of its own code (killed as its excepthook ran, say): the exception came out
        # of its last step's backward, as a traceback through backward would have said.
        op = GRAD_ALLREDUCE
    if op is None:
        return (_entered(run, rank, ledger) if ledger.ending.how == "signal" else None), place
    seqs = [p.seq for p in ledger.points if p.group == "WORLD" and p.seq >= 0]
    seq = max(seqs) + 1 if seqs else -1
    site = place if op != GRAD_ALLREDUCE else (ledger.forwards[-1][3] or place)
    step = max(ledger.last_step, max((p.step for p in ledger.points), default=-1))
    point = Point(seq, op, 0, "WORLD", step, site, in_flight=True, died_in=True)
    if op != GRAD_ALLREDUCE:
        _sign(point, ledger.unfinished)
    return point, place


def _entered(run: Run, rank: int, ledger: Ledger) -> Point | None:
    """The collective a killed rank's ring says it entered and never left, where its stack names
    none (faulthandler's dump cut short by a second fault): the call at that line, with the op
    and group of the rank's earlier records there."""
    trace = run.ranks.get(rank)
    entered = trace.meta.get(schema.ENTERED, []) if trace is not None else []
    if trace is None or not entered or ledger.unfinished is None:
        return None
    info = entered[-1][2]
    site, seq = sites_of(trace).get(info.get("site")), info.get("seq")
    before = [p for p in ledger.points if p.site == site and not p.op.startswith(GRAD_ALLREDUCE)]
    if not site or not isinstance(seq, int) or not before:
        return None
    point = Point(
        seq, before[-1].op, 0, before[-1].group, ledger.last_step, site, in_flight=True, died_in=True
    )
    _sign(point, ledger.unfinished)
    return point


def _reduced(ledger: Ledger) -> bool:
    """Whether every bucket of the last training step's gradient all-reduce completed: a
    backward that raised after them (a hook's error, or what a signal handler raised as the
    engine returned) was in the rank's own code, in no collective the others share."""
    step = ledger.forwards[-1][0] if ledger.forwards else -1
    done = sum(1 for p in ledger.points if p.op == GRAD_ALLREDUCE and p.step == step and not p.raised)
    return ledger.buckets > 0 and done >= ledger.buckets


def _raised_last_in_backward(ledger: Ledger) -> bool:
    """Whether the rank's last record is its last training step's backward raising: no sync
    point after it, and the step is its last grad-mode forward's."""
    if ledger.backward_raised is None or not ledger.forwards or not ledger.forwards[-1][1]:
        return False
    ts, step = ledger.backward_raised
    return step == ledger.forwards[-1][0] and all(p.ts <= ts for p in ledger.points)


def _sign(point: Point, sig: dict[str, Any] | None) -> None:
    """Give a point the rest of its signature (dtype, element count, root, group members)."""
    if sig is not None:
        point.dtype, point.numel, point.root, point.ranks = _signature(sig)


def _signature(sig: dict[str, Any]) -> tuple[str, int, int, str]:
    """A signature record's dtype, element count, root and group members, as ``Point`` holds them."""
    return (
        str(sig.get("dtype") or ""),
        int(sig.get("numel") or 0),
        int(sig.get("root", -1)),
        str(sig.get("ranks") or ""),
    )


def build(run: Run) -> dict[int, Ledger]:
    """A ledger for every rank of the run, those that left no trace included (built once per
    run: the causes, the awaited work and the failure view read the same ledgers)."""
    return run.once("ledgers", _build)


def _build(run: Run) -> dict[int, Ledger]:
    watch = merged_watch(run)
    ledgers: dict[int, Ledger] = {}
    elsewhere = run.elsewhere  # on a node whose run dir was not given: nothing to judge it by
    world = run.world_size
    for rank in range(world):
        if rank in elsewhere:
            continue
        ledger = Ledger(rank, ending=how_it_ended(run, rank, watch))
        ledger.words = [str(w) for w in (run.ends.get(rank) or {}).get("words") or []]
        trace = run.ranks.get(rank)
        if trace is not None:
            _fill(ledger, trace, world)
        ledger.stack = user_frames(last_frames(run, rank, ledger))
        flight, place = _in_flight(run, rank, ledger)
        if flight is None:
            flight, place = died_in(run, rank, ledger)
            if any(p.died_in for p in ledger.points):  # its trace says which one raised
                flight = None
        if flight is not None:
            ledger.points.append(flight)
        ledger.place = place or (ledger.points[-1].site if ledger.points else "")
        for path, line, func in ledger.stack:
            ledger.funcs.setdefault(f"{os.path.basename(path)}:{line}", func)
        for point in ledger.points:
            point.func = ledger.funcs.get(point.site, "")
        if not ledger.place and ledger.forwards:
            ledger.place = ledger.forwards[-1][3]
        ledgers[rank] = ledger
    return ledgers


# Points kept per kind, from the end: a divergence that broke the job is near its end, and a
# long job's every bucket all-reduce would make the ledger as slow to build as the trace is big.
TAIL = 128


def _tail(events: Any) -> Any:
    n = len(events)
    return events if n <= TAIL else events.select(np.arange(n - TAIL, n))


def _fill(ledger: Ledger, trace: RankTrace, world: int) -> None:
    sites = sites_of(trace)
    for _, _, info in trace.meta.get(schema.SITE, []):
        ledger.files.setdefault(os.path.basename(str(info.get("file"))), str(info.get("file")))
        if info.get("func"):
            ledger.funcs[f"{os.path.basename(str(info.get('file')))}:{info.get('line')}"] = str(info["func"])
    sigs = {info.get("id"): info for _, _, info in trace.meta.get(schema.SIGNATURE, [])}
    signed = {sid: _signature(info) for sid, info in sigs.items()}
    points: list[Point] = []
    coll = _tail(trace.kind(schema.COLLECTIVE))
    unsigned = ("", 0, -1, None)
    for ts, step, f in zip(coll.ts.tolist(), coll.step.tolist(), coll.fields, strict=True):
        site = sites.get(f[6], "") if len(f) > 6 and type(f[6]) is int else ""
        dtype, numel, root, ranks = signed.get(f[7], unsigned) if len(f) > 7 else unsigned  # older: none
        op, nbytes, group = str(f[0]), int(f[1]), str(f[2])
        points.append(
            Point(
                int(f[4]), op, nbytes, group, step, site, ts, dtype=dtype, numel=numel, root=root, ranks=ranks
            )
        )
    fwd = trace.kind(schema.FORWARD)
    ledger.forwards_from = max(0, len(fwd) - TAIL)
    fwd = _tail(fwd)
    fwd_site: dict[int, str] = {}
    for step, f in zip(fwd.step.tolist(), fwd.fields, strict=True):
        site = sites.get(int(f[3]), "") if len(f) > 3 and isinstance(f[3], int) else ""
        ledger.forwards.append((step, bool(f[0]), bool(f[1]), site))
        if f[0]:
            fwd_site[step] = site
    red = _tail(trace.kind(schema.ALLREDUCE))
    for ts, step, nbytes, seq in zip(
        red.ts.tolist(), red.step.tolist(), red.ints(1, default=0).tolist(), red.ints(2).tolist()
    ):
        points.append(Point(seq, GRAD_ALLREDUCE, nbytes, "WORLD", step, fwd_site.get(step, ""), ts))
    buf = _tail(trace.kind(schema.SYNC_BUFFERS))
    for ts, step, f in zip(buf.ts.tolist(), buf.step.tolist(), buf.fields, strict=True):
        points.append(Point(int(f[0]), BUFFERS, 0, "WORLD", step, "", ts))
    raised = ledger.ending.how == "exception"
    for ts, step, info in trace.meta.get(schema.RAISED, []):
        fields = info.get("fields") or []
        if info.get("kind") == schema.COLLECTIVE and len(fields) >= 5:
            site = sites.get(int(fields[6]), "") if len(fields) > 6 and isinstance(fields[6], int) else ""
            op, nbytes, group, seq = str(fields[0]), int(fields[1]), str(fields[2]), int(fields[4])
        elif info.get("kind") == schema.SYNC_BUFFERS and fields:
            site, op, nbytes, group, seq = "", BUFFERS, 0, "WORLD", int(fields[0])
        else:
            if info.get("kind") == schema.BACKWARD:
                ledger.backward_raised = (ts, step)
            continue
        point = Point(seq, op, nbytes, group, step, site, ts, died_in=raised, raised=True)
        _sign(point, sigs.get(fields[7]) if len(fields) > 7 else None)
        points.append(point)
    if not len(red):  # buckets untimed (DDPDOCTOR_BUCKET_TIMING): their numbers are the gaps
        points.extend(_untimed_reductions(trace, fwd, points, fwd_site))
    ledger.points = sorted(points, key=lambda p: (p.ts, p.seq))
    if len(trace.kind(schema.DDP_INIT)) == 1:  # one model's layout: a step's all-reduces, counted
        ledger.buckets = len({info.get("index") for _, _, info in trace.meta.get(schema.BUCKET, [])})
    ledger.unfinished = _unfinished(trace, coll)
    ledger.steps = count_distinct(trace.kind(schema.BACKWARD).step)  # micro-batches share a step
    grad = fwd.ints(0) == 1 if len(fwd) else np.zeros(0, dtype=bool)
    ledger.last_step = int(fwd.step[grad].max(initial=-1)) if len(fwd) else -1
    ledger.last_step = max(ledger.last_step, last_step_started(trace))
    ledger.passes = passes(trace, world)
    funcs = {i.get("id"): i.get("func") for _, _, i in trace.meta.get(schema.SITE, [])}
    for _, _, info in trace.meta.get(schema.SYNC_LOG, []):
        sid = info.get("site")
        if isinstance(sid, int) and sid in sites:
            ledger.sync_logs.add((f"{sites[sid]} in {funcs.get(sid)}", str(info.get("name"))))


# More unrecorded numbers than this in one step are not DDP's buckets: something else ran there.
_MAX_UNTIMED = 256
# DDP reduces step 0 in its constructor's bucket layout and rebuilds the buckets in step 1's
# forward (two broadcasts): the steps from this one on issue the same C++ collectives each.
_REBUILT = 2


def _untimed_reductions(
    trace: RankTrace, fwd: Any, points: list[Point], fwd_site: dict[int, str]
) -> list[Point]:
    """DDP's gradient all-reduces of steps whose buckets were not timed. Every collective
    advances its group's sequence number and a training forward records the number it found,
    so a step's range runs from its forward's number to the next forward's (or to the rank's
    last recorded call; a last step with none after it uses as many numbers as the step
    before, from the third on). Numbers in it that no recorded call holds are DDP's C++ work:
    the bucket all-reduces, last, and before them what the forward's buffer broadcast and
    DDP's bucket rebuild issued. So the last ``buckets`` of them, in steps with a backward;
    their bytes are unknown (0: not compared between ranks)."""
    if not len(fwd):
        return []
    grad = fwd.ints(0) == 1
    steps, seqs = fwd.step[grad].tolist(), fwd.ints(2)[grad].tolist()
    if not steps:
        return []
    bwd = trace.kind(schema.BACKWARD)
    backward_ts = dict(zip(bwd.step.tolist(), bwd.ts.tolist(), strict=True))
    taken = {p.seq for p in points if p.group == "WORLD" and p.seq >= 0}
    ends = seqs[1:] + [max(taken, default=-1) + 1]
    buckets, usual = _buckets(trace), 0
    derived = []
    for i, (step, first, end) in enumerate(zip(steps, seqs, ends, strict=True)):
        ts = backward_ts.get(step)
        if ts is None or first < 0:
            continue
        if i == len(steps) - 1 and end <= first and usual:  # nothing recorded after: as before
            gaps = [q for q in range(first, first + _MAX_UNTIMED) if q not in taken][:usual]
        elif 0 < end - first <= _MAX_UNTIMED:
            gaps = [q for q in range(first, end) if q not in taken]
            usual = len(gaps) if step >= _REBUILT else usual  # not step 0's layout nor 1's rebuild
        else:
            continue
        site = fwd_site.get(step, "")
        derived += [Point(q, GRAD_ALLREDUCE, 0, "WORLD", step, site, ts) for q in gaps[-buckets:]]
    return derived


def _buckets(trace: RankTrace) -> int:
    """How many buckets DDP reduces a step: what the automatic bucket timing counted, else the
    constructor's layout."""
    for _, _, info in trace.meta.get(schema.COMM_HOOK, []):
        if isinstance(info.get("auto"), dict) and int(info["auto"].get("buckets", 0)) > 0:
            return int(info["auto"]["buckets"])
    inits = [f[0] for f in trace.kind(schema.DDP_INIT).fields if isinstance(f[0], dict)]
    return max(1, len(inits[-1].get("buckets") or [])) if inits else 1


def _unfinished(trace: RankTrace, coll: Any) -> dict[str, Any] | None:
    """The signature of the collective call a rank died in, whose record was never written:
    the call its ring says it entered last (``schema.ENTERED``), unless that call's record is
    there. Traces from before that field: the probe writes a new signature just before the
    call, so one newer than every collective record and raised record, and named by none, is
    the call's the rank was in when it died."""
    entered = trace.meta.get(schema.ENTERED, [])
    if entered:
        info = entered[-1][2]
        call = (info.get("seq"), info.get("signature"), info.get("site"))
        done = {(f[4], f[7], f[6]) for f in coll.fields if len(f) > 7}
        done |= {tuple(r[2].get("fields", [])[i] for i in (4, 7, 6)) for r in _raised_calls(trace)}
        sigs = {i.get("id"): i for _, _, i in trace.meta.get(schema.SIGNATURE, [])}
        return None if call in done else sigs.get(call[1])
    last, used = -1, set()
    if len(coll):
        last = int(coll.ts[-1])
        used = {f[7] for f in coll.fields if len(f) > 7}
    for ts, _, info in trace.meta.get(schema.RAISED, []):
        fields = info.get("fields") or []
        if info.get("kind") == schema.COLLECTIVE:
            last = max(last, ts)
            used.update(fields[7:8])
    newer = [i for ts, _, i in trace.meta.get(schema.SIGNATURE, []) if ts > last and i.get("id") not in used]
    return newer[-1] if newer else None


def forward_site(trace: RankTrace, step: int | None = None) -> str:
    """Where the training forward of a step (default: the last) was called, as file:line."""
    fwd = trace.kind(schema.FORWARD)
    if not len(fwd):
        return ""
    idx = np.flatnonzero((fwd.ints(0) == 1) & ((fwd.step == step) if step is not None else True))
    if not len(idx):
        idx = np.flatnonzero(fwd.ints(0) == 1)
    if not len(idx):
        return ""
    return sites_of(trace).get(int(fwd.ints(3)[idx[0] if step is not None else idx[-1]]), "")


def _raised_calls(trace: RankTrace) -> list[tuple[int, int, dict[str, Any]]]:
    """The rank's ``raised`` records of collectives with their whole signature."""
    return [
        r
        for r in trace.meta.get(schema.RAISED, [])
        if r[2].get("kind") == schema.COLLECTIVE and len(r[2].get("fields") or []) > 7
    ]
