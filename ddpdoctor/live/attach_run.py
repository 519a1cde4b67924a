"""From the looks at a job's ranks (attach.py) to a verdict, a printed report and a run directory.

The run directory holds one header-only trace per rank (so the reader finds the job's ranks),
every rank's stacks, ``attach.json`` with the looks, and, when the job is stuck,
``hang-1/summary.json`` in the run-time watcher's format: `diagnose` and `report` then give
the same hang finding they give for a hang caught under `ddpdoctor run`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.hung.hang import analyse, main_thread, user_frame
from ddpdoctor.live.attach import (
    ATTACH_SCHEMA,
    BUSY_CPU_SHARE,
    NO_PYSPY,
    AttachError,
    RankLooks,
    look,
    phase_of,
    pyspy,
    refused,
)
from ddpdoctor.live.procs import all_procs, find_ranks, ptrace_problem, read_proc
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir, new_run_dir, write_atomic
from ddpdoctor.supervisor import hangfile
from ddpdoctor.supervisor.stacks import pyspy_path
from ddpdoctor.trace import schema


@dataclass
class Attached:
    state: str  # "progressing" | "stuck" | "one_look"
    text: str
    run_dir: Path
    report: dict[str, Any]


def attach(pid: int, watch_s: float, out: str | None) -> Attached:
    """Find the ranks of ``pid``'s job, look at them, judge, write the run directory."""
    procs = all_procs()
    try:
        launcher, ranks = find_ranks(pid, procs)
    except LookupError as exc:
        raise AttachError(str(exc)) from None
    unreadable = [procs[pid]] + [p for p in procs.values() if p.ppid == launcher]
    for proc in unreadable:
        if proc.env_error and not any(r.pid == proc.pid for r in ranks):
            problem = ptrace_problem(proc.uid) or f"/proc/{proc.pid}/environ: {proc.env_error}"
            raise AttachError(f"cannot read the job's processes: {problem}")
    if not ranks:
        raise AttachError(
            f"no ranks under pid {pid}: give the pid of torchrun (python -m torch.distributed.run), "
            "of an mp.spawn parent, or of any rank"
        )
    if pyspy_path() is None:
        raise AttachError(f"cannot read the ranks' stacks: {NO_PYSPY}")
    uids = {p.uid for p in filter(None, (read_proc(r.pid) for r in ranks))}
    for uid in sorted(uids):
        problem = ptrace_problem(uid)
        if problem:
            raise AttachError(f"cannot read the ranks' stacks: {problem}")
    looks = look(ranks, watch_s)
    why = refused(looks)
    if why:
        raise AttachError(
            f"cannot read the ranks' stacks: ptrace was refused ({why}); in a container start it "
            "with --cap-add SYS_PTRACE, else run attach with sudo"
        )
    return judge(pid, launcher, looks, watch_s, out)


def _status(r: RankLooks, unchanged_s: float, now: float) -> RankStatus:
    """What a status file would say about this rank, from its stack."""
    frames = _main(r.last)
    phase = phase_of(frames)
    if phase is not None:
        phase = {**phase, "seq": -1, "since_s": unchanged_s}
    return RankStatus(r.proc.rank, pid=r.proc.pid, phase=phase, heartbeat_wall=now)


def _main(dump: dict[str, Any]) -> list[dict[str, Any]]:
    return main_thread(dump.get("threads") or [])


def judge(pid: int, launcher: int, looks: dict[int, RankLooks], watch_s: float, out: str | None) -> Attached:
    now = time.time()
    gone = sorted(r for r, lk in looks.items() if read_proc(lk.proc.pid) is None)
    moved = sorted(r for r, lk in looks.items() if lk.moved)
    one_look = watch_s <= 0
    state = "one_look" if one_look else ("progressing" if moved or gone else "stuck")
    unchanged = 0.0 if one_look else watch_s
    statuses = {r: _status(lk, 0.0 if r in moved else unchanged, now) for r, lk in looks.items()}
    stacks = {r: lk.last for r, lk in looks.items()}
    world = _single_node_world(looks)
    diag = analyse(statuses, stacks, threshold_s=watch_s, quiet_s=unchanged, now=now, world_size=world)
    explanation, fix = _unnumbered(diag.explanation), _unnumbered(diag.fix)
    if state == "stuck":
        _native_where_it_helps(looks, statuses)
    run_dir = new_run_dir(out)
    lines = [_headline(launcher, looks)]
    lines.append(_looks_line(state, looks, moved, gone, watch_s))
    width = max(len(_label(rs)) for rs, _ in diag.groups)
    for rs, where in diag.groups:
        now_in = "now in" if state == "progressing" else "in"
        lines.append(f"  {_label(rs):<{width}}  {now_in} {_unnumbered(where)}")
    for r in sorted(looks):
        share = looks[r].cpu_share
        if state == "stuck" and share is not None and share >= BUSY_CPU_SHARE:
            lines.append(
                f"  rank {r} is busy ({share:.0%} of a core) with an unchanged stack: slow work or an "
                "endless loop there, not a wait"
            )
    if state != "progressing":
        if state == "one_look":
            lines.append("  One look cannot tell stuck from slow (use --watch SECONDS). If it is stuck:")
        lines.append(f"  {explanation}")
        lines.append(f"  Fix: {fix}")
    else:
        lines.append("  Not a hang: the stacks change between looks.")
    lines.append(f"  Stacks and report: {run_dir}{os.sep}")
    text = "\n".join(lines)
    report = {
        "schema": ATTACH_SCHEMA,
        "pid": pid,
        "launcher_pid": launcher,
        "state": state,
        "watch_s": watch_s,
        "looks": max((len(lk.dumps) for lk in looks.values()), default=0),
        "pattern": diag.pattern if state != "progressing" else None,
        "culprits": diag.culprits if state != "progressing" else [],
        "explanation": explanation,
        "fix": fix,
        "ranks": {
            str(r): {
                "pid": lk.proc.pid,
                "ranked_by": lk.proc.ranked_by,
                "moved": r in moved,
                "gone": r in gone,
                "cpu_share": None if lk.cpu_share is None else round(lk.cpu_share, 3),
                "where": diag.ranks[r].where,
                "user_frame": user_frame(_main(lk.last)),
                "stack_method": lk.last.get("method"),
                "error": lk.last.get("error"),
            }
            for r, lk in sorted(looks.items())
        },
        "text": text,
    }
    _write_run_dir(run_dir, launcher, looks, statuses, stacks, diag, state, report, unchanged, now, world)
    return Attached(state, text, run_dir, report)


def _single_node_world(looks: dict[int, RankLooks]) -> int | None:
    """The world size when every rank should be on this node (else missing ranks are elsewhere)."""
    procs = [lk.proc for lk in looks.values()]
    world = {p.world_size for p in procs}
    local = {p.local_world_size for p in procs}
    if len(world) == 1 and world == local and None not in world:
        return next(iter(world))
    return None


def _unnumbered(text: str) -> str:
    """Without probes no rank's collective sequence number is known: say so instead of '#-1'."""
    return text.replace(" #-1", "")


def _label(ranks: list[int]) -> str:
    return "rank " + rank_list(ranks).replace(", ", ",")


def _headline(launcher: int, looks: dict[int, RankLooks]) -> str:
    proc = read_proc(launcher)
    what = " ".join(proc.cmdline[:3]) if proc else "?"
    ranks = ", ".join(f"rank {r} pid {lk.proc.pid}" for r, lk in sorted(looks.items()))
    how = {lk.proc.ranked_by for lk in looks.values()}
    note = " (ranked in mp.spawn's start order)" if "spawn order" in how else ""
    return f"ddpdoctor attach: pid {launcher} ({what}) on {socket.gethostname()}: {ranks}{note}"


def _looks_line(state: str, looks: dict[int, RankLooks], moved: list[int], gone: list[int], w: float) -> str:
    n = max((len(lk.dumps) for lk in looks.values()), default=0)
    if state == "one_look":
        return "  one look:"
    head = f"  {n} looks over {w:g} s:"
    if state == "stuck":
        return f"{head} STUCK - no rank's stack changed"
    parts = []
    if moved:
        parts.append(f"rank(s) {rank_list(moved)} moved")
    if gone:
        parts.append(f"rank(s) {rank_list(gone)} exited")
    return f"{head} progressing - {', '.join(parts)}"


def _native_where_it_helps(looks: dict[int, RankLooks], statuses: dict[int, RankStatus]) -> None:
    """Native frames show what a rank waits on below Python (gloo/NCCL in a collective or in the
    backward's all-reduce): taken once, for stuck ranks in a sync point."""
    wanted = [r for r, st in statuses.items() if st.phase]
    if not wanted:
        return
    with ThreadPoolExecutor(max_workers=min(8, len(wanted))) as pool:
        for r, dump in zip(wanted, pool.map(lambda r: pyspy(looks[r].proc.pid, native=True), wanted)):
            looks[r].native = dump.get("text") or dump.get("error") or ""


def _stack_text(rank: int, lk: RankLooks) -> str:
    dump = lk.last
    how = f"{dump.get('method') or 'nothing'} {dump.get('error') or ''}".rstrip()
    lines = [f"rank {rank} (pid {lk.proc.pid}): stack by {how}"]
    for t in dump.get("threads") or []:
        state = "active" if t.get("active") else "idle"
        lines.append(f"\nThread {t.get('name')} ({state}, most recent call first):")
        for f in t.get("frames") or []:
            lines.append(f'  File "{f.get("file")}", line {f.get("line")}, in {f.get("function")}')
    if lk.native:
        lines.append("\nWith native frames (py-spy --native):\n" + lk.native)
    return "\n".join(lines) + "\n"


def _write_run_dir(
    run_dir: Path,
    launcher: int,
    looks: dict[int, RankLooks],
    statuses: dict[int, RankStatus],
    stacks: dict[int, dict[str, Any]],
    diag: Any,
    state: str,
    report: dict[str, Any],
    quiet_s: float,
    now: float,
    world: int | None,
) -> None:
    host = socket.gethostname()
    proc = read_proc(launcher)
    meta = {
        "schema": "ddpdoctor.run/1",
        "command": proc.cmdline if proc else [],
        "host": host,
        "pid": launcher,
        "status": "attached",
        "attached": True,
        "started_ns": time.time_ns(),
    }
    layout = RunDir(run_dir)
    write_atomic(layout / RunDir.RUN_META, json.dumps(meta, indent=2))
    # The traces' clock starts with the first look, so the stuck spans run from it to the
    # verdict on the timeline (a header stamped now would put the verdict before its start).
    wall_ns = int((now - quiet_s) * 1e9)
    mono_ns = time.monotonic_ns() - (time.time_ns() - wall_ns)
    for r, lk in looks.items():
        header = {
            "schema": schema.JSONL_SCHEMA,  # a header alone: the JSON-lines form says it plainly
            "rank": r,
            "world_size": lk.proc.world_size or len(looks),
            "local_rank": lk.proc.local_rank,
            "host": host,
            "pid": lk.proc.pid,
            "wall_ns": wall_ns,
            "mono_ns": mono_ns,
            "argv": lk.proc.cmdline,
            "restart": 0,
            "attached": True,
        }
        write_atomic(layout.trace(r).with_suffix(".jsonl"), json.dumps([schema.HEADER, header]) + "\n")
        write_atomic(layout.stacks(r), _stack_text(r, lk))
    write_atomic(layout / RunDir.ATTACH, json.dumps(report, indent=1, default=str))
    write_atomic(layout / RunDir.ATTACH_TEXT, report["text"] + "\n")
    if state != "stuck":
        return
    hang_dir = layout.hang(1)
    hang_dir.mkdir(exist_ok=True)
    for r, lk in looks.items():
        write_atomic(layout.hang_stack(1, r), _stack_text(r, lk))
    fields = {"detected_wall": now, "threshold_s": quiet_s, "quiet_s": quiet_s, "world_size": world}
    fields.update(action="attach", reported_wall=now)
    hangfile.save(hangfile.summary(hang_dir, 1, statuses, stacks, report["text"], **fields))
