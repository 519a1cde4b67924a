"""`ddpdoctor top`: a running job, rank by rank, from the status files its ranks rewrite.

Each rank's trace writer thread rewrites ``status-rank{R}.json`` four times a second (step,
current sync point, last collective, recent rate, its wait at the last gradient bucket of its
last steps; see probes/liveness.py and probes/recent.py). `top` reads only those small files,
the tail of the node's GPU samples and run.json, so it costs the job nothing and stays cheap at
a thousand ranks (docs/live.md has the measurement). Findings are the ones the status data
already prove, each by the rule the rest of ddpdoctor uses: a hang or a wait by the run-time
watcher's (``proof.judge``, ``proof.is_hang``, then ``hang.analyse`` without stacks), a straggler
by the trace analysis's (live/lateness.py), a rank that raised or vanished, ranks whose model
parameters differ at a fingerprint check they all took (live/replicas.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpdoctor.analysis.hung.hang import analyse
from ddpdoctor.analysis.hung.proof import Activity, Verdict, VerdictState, is_hang, judge
from ddpdoctor.live.gpu import GpuTails
from ddpdoctor.live.lateness import LiveLateness, live_lateness
from ddpdoctor.live.render import render
from ddpdoctor.live.replicas import weights_diverged
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor.activity import pid_alive
from ddpdoctor.supervisor.board import Board
from ddpdoctor.supervisor.jobview import JobView
from ddpdoctor.supervisor.layout import Layout
from ddpdoctor.supervisor.statuses import HANG_MULTIPLE, adaptive_threshold, hang_floor_s, read_statuses
from ddpdoctor.trace.reader import read_meta

TOP_SCHEMA = "ddpdoctor.top/1"
CPU_BUDGET = 0.04  # of one core, at most, for the refresh loop (the issue asks < 5 %)
STALL_S, STALL_STEPS = 2.0, 10  # no step for this long and this many step periods: stalled
CONNECT_S = 10.0  # a multi-node job's store, at the first look
STALE_S = 5.0  # no heartbeat for this long: the rank's writer thread stopped (or the node is gone)


class Top:
    """The state kept between refreshes: per-file GPU offsets, the previous step counts."""

    def __init__(self, run_dirs: list[Path], floor_s: float | None = None) -> None:
        self.run_dirs = run_dirs
        self.floor_s = hang_floor_s() if floor_s is None else floor_s
        self.gpus = GpuTails()
        self.host = os.uname().nodename
        self._prev: dict[int, tuple[float, int]] = {}  # rank -> (wall, step) at the last look
        self._hang_text: dict[Path, str] = {}
        self._boards: dict[Path, Board] = {}  # a multi-node job's store, read like any node

    def _board(self, run_dir: Path, meta: dict[str, Any]) -> Board | None:
        """The job's store (run.json's ``job.store``) while a multi-node job runs: every node's
        ranks, and the leading watcher's verdict."""
        job = meta.get("job") or {}
        if run_dir not in self._boards and job.get("store") and int(job.get("nnodes") or 1) > 1:
            host, _, port = str(job["store"]).rpartition(":")
            if port.isdigit() and meta.get("status") == "running":
                layout = Layout(int(job["nnodes"]), job.get("node_rank"), None, (host, int(port)))
                self._boards[run_dir] = Board(layout)
                self._boards[run_dir].wait_connected(CONNECT_S)  # torch's import and one connection
        return self._boards.get(run_dir)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """One frame, as the JSON object `--json` prints."""
        now = time.time() if now is None else now
        statuses: dict[int, RankStatus] = {}
        runs = []
        view: JobView | None = None
        state: dict[str, Any] | None = None
        for run_dir in self.run_dirs:
            meta = read_meta(run_dir)
            found = read_statuses(run_dir)
            board = self._board(run_dir, meta)
            if board is not None and view is None:
                view = board.read(now)
                state = board.job_state() if view is not None else None
            if view is not None:
                for rank, st in view.statuses.items():
                    statuses.setdefault(rank, st)  # another node's rank, through the store
            statuses.update(found)
            runs.append(
                {
                    "dir": str(run_dir),
                    "status": meta.get("status") or ("running" if found else "no status files"),
                    "exit_code": meta.get("exit_code"),
                    "ended_wall": (meta["ended_ns"] / 1e9) if meta.get("ended_ns") else None,
                    "hangs": self._hangs(run_dir),
                }
            )
        self.gpus.poll(self.run_dirs)
        finished = bool(runs) and all(r["status"] == "finished" for r in runs)
        # Without run.json (ddpdoctor.instrument()): done when every rank has exited cleanly.
        finished = finished or (bool(statuses) and all(s.exited for s in statuses.values()))
        table = live_lateness(statuses)
        lateness = table.per_rank() if table is not None else {}
        ranks = [self._row(r, st, now, lateness.get(r), finished) for r, st in sorted(statuses.items())]
        job = _job(statuses, ranks, lateness, now, finished)
        reported = any(run["hangs"] for run in runs)
        timeout = "reported" if reported else self._hang_timeout()
        activity = view.activity(now) if view is not None else {}
        findings = _findings(
            statuses, ranks, table, job, now, self.floor_s, finished, timeout, activity, state
        )
        for run in runs:
            for hang in run["hangs"]:
                findings.append({"kind": "hang_reported", "ranks": [], "text": hang})
        return {
            "schema": TOP_SCHEMA,
            "time": now,
            "runs": runs,
            "job": job,
            "ranks": ranks,
            "findings": findings,
        }

    def _row(
        self, rank: int, st: RankStatus, now: float, late: dict[str, Any] | None, finished: bool
    ) -> dict[str, Any]:
        step = st.step
        rate = st.steps_per_s
        prev = self._prev.get(rank)
        if rate is None and prev is not None and now > prev[0] and not finished:
            rate = round((step - prev[1]) / (now - prev[0]), 4)
        self._prev[rank] = (now, step)
        if _stalled(st, now):
            rate = 0.0  # the rate of its last steps is no rate of a rank that stopped stepping
        phase = st.phase or {}
        last = st.last_collective or {}
        return {
            "rank": rank,
            "host": st.host,
            "pid": st.pid,
            "state": self._state(st, now, finished),
            "step": step,
            "steps": st.steps,
            "steps_per_s": rate,
            "phase": phase.get("name"),
            "op": phase.get("op"),
            "phase_s": round(st.in_phase_s(now), 3) if phase else None,
            "last_op": last.get("op"),
            "last_seq": last.get("seq"),
            "seq": st.seq,
            "late_ms": None if late is None else round(late["mean_us"] / 1000, 3),
            "latest_share": None if late is None else late["latest_share"],
            "gpu": self.gpus.for_rank(st),
            "error": st.error,
        }

    def _state(self, st: RankStatus, now: float, finished: bool) -> str:
        if st.error:
            return "raised"
        if st.exited:
            return "exited"
        pid = st.pid
        if st.host in (None, self.host) and isinstance(pid, int) and pid > 0 and not pid_alive(pid):
            return "gone"  # no clean exit recorded: killed, or the status lags a fast exit
        if finished:
            return "ended"
        if now - (st.heartbeat_wall or 0.0) > STALE_S:
            return "silent"
        return "stalled" if _stalled(st, now) else "running"

    def _hang_timeout(self) -> float | None:
        """`ddpdoctor run --hang-timeout`, when the watcher recorded it (watch.json)."""
        for run_dir in self.run_dirs:
            try:
                value = json.loads((run_dir / RunDir.WATCH).read_text(encoding="utf-8")).get("hang_timeout")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, (int, float)) and value > 0:
                return float(value)
        return None

    def _hangs(self, run_dir: Path) -> list[str]:
        """The watcher's hang reports (hang-N/summary.json), read once each."""
        out = []
        for path in RunDir(run_dir).hang_summaries():
            if path not in self._hang_text:
                try:
                    text = str(json.loads(path.read_text(encoding="utf-8")).get("text") or "")
                except (OSError, ValueError, AttributeError):
                    continue
                self._hang_text[path] = text
            out.append(self._hang_text[path])
        return out


def _stalled(st: RankStatus, now: float) -> bool:
    """Alive but no step began for many times its recent step period (a hang, a long wait)."""
    last, rate = st.last_step_wall, st.steps_per_s
    if not isinstance(last, (int, float)) or not isinstance(rate, (int, float)) or rate <= 0:
        return False
    return now - last > max(STALL_S, STALL_STEPS / rate)


def _job(
    statuses: dict[int, RankStatus],
    ranks: list[dict[str, Any]],
    lateness: dict[int, dict[str, Any]],
    now: float,
    finished: bool,
) -> dict[str, Any]:
    steps = [r["steps"] for r in ranks]
    rates = [r["steps_per_s"] for r in ranks if r["steps_per_s"] is not None]
    world = max((s.world_size or 0 for s in statuses.values()), default=0)
    progress = [s.progress_wall or 0.0 for s in statuses.values()]
    slowest = max(lateness, key=lambda r: lateness[r]["mean_us"]) if lateness else None
    if slowest is None and rates:
        slowest = min((r for r in ranks if r["steps_per_s"] is not None), key=lambda r: r["steps_per_s"])[
            "rank"
        ]
    return {
        "ranks_seen": len(statuses),
        "world_size": world or None,
        "steps_min": min(steps, default=None),
        "steps_max": max(steps, default=None),
        # Every DDP step waits for the slowest rank: the job runs at the lowest rank rate.
        "steps_per_s": min(rates) if rates else None,
        "slowest_rank": slowest,
        "since_progress_s": round(now - max(progress), 3) if progress and max(progress) > 0 else None,
        "finished": finished,
    }


def _findings(
    statuses: dict[int, RankStatus],
    ranks: list[dict[str, Any]],
    table: LiveLateness | None,
    job: dict[str, Any],
    now: float,
    floor_s: float,
    finished: bool,
    hang_timeout: float | str | None = None,
    activity: dict[int, Activity] | None = None,
    state: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """What the status data prove: a rank that raised or vanished, a straggler, replicas that
    differ, and the watcher's own live rule (``proof.judge``, ``proof.is_hang``) for a hang or a wait."""
    activity = activity or {}
    out: list[dict[str, Any]] = []
    for row in ranks:
        if row["state"] == "raised":
            err = row["error"] or {}
            text = f"rank {row['rank']} raised {err.get('type')}: {str(err.get('message'))[:200]}"
            out.append({"kind": "rank_error", "ranks": [row["rank"]], "text": text})
        elif row["state"] == "gone" and not finished:
            text = f"rank {row['rank']} (pid {row['pid']}) is gone without a clean exit at step {row['step']}"
            out.append({"kind": "rank_gone", "ranks": [row["rank"]], "text": text})
    if table is not None:  # the trace analysis's straggler rule (live/lateness.py)
        out += table.stragglers()
    out += weights_diverged(statuses)
    live = {r: s for r, s in statuses.items() if not s.exited and not s.error}
    if finished or not live or out and out[0]["kind"] in ("rank_error", "rank_gone"):
        return out  # a failing rank explains the others' wait (the watcher says the same)
    if hang_timeout == "reported":
        return out  # the watcher's own report (with stacks) is shown instead
    threshold = hang_timeout or adaptive_threshold(statuses, floor_s, HANG_MULTIPLE)
    longest = max((s.sync_wait_s(now) for s in live.values()), default=0.0)
    started = any(s.step >= 1 for s in statuses.values())
    quiet = job["since_progress_s"] or 0.0
    world = job["world_size"]
    if state is not None:  # the leading watcher's verdict, judged with what it measured
        verdict, threshold = Verdict.from_json(state["verdict"]), float(state["threshold"])
    else:  # the watcher's own rule over what the status files show (no CPU measured here)
        alive = {r: Activity(alive=not s.exited) for r, s in statuses.items()}
        verdict = judge(statuses, {**alive, **activity}, now, world)
    timeout = hang_timeout if isinstance(hang_timeout, (int, float)) else None
    if verdict.state is VerdictState.BUSY:
        out.append({"kind": "waiting", "ranks": verdict.culprits, "text": f"not a hang: {verdict.proof}"})
    if is_hang(verdict, threshold, hang_timeout=timeout, longest=longest, quiet=quiet, started=started):
        partial = world if len(statuses) < (world or 0) else None
        proof = verdict.proof if verdict.state is VerdictState.PROVEN else ""
        diag = analyse(
            live,
            {},
            threshold_s=threshold,
            quiet_s=max(longest, quiet),
            now=now,
            world_size=partial,
            proof=proof,
        )
        lead = (
            f"proven: {verdict.proof}."
            if proof
            else f"no progress for {max(longest, quiet):.0f} s (threshold {threshold:g} s):"
        )
        text = f"{lead} {diag.explanation} Fix: {diag.fix}"
        out.append({"kind": "hang", "ranks": diag.culprits, "pattern": diag.pattern, "text": text})
    return out


def run(
    run_dirs: list[Path],
    *,
    once: bool = False,
    as_json: bool = False,
    interval: float = 1.0,
    echo: Callable[[str], None] = print,
) -> None:
    """Print a frame every ``interval`` seconds until every run has finished (or Ctrl-C).
    On a terminal each frame replaces the last; in a pipe or log frames follow each other."""
    top = Top(run_dirs)
    clear = not as_json and not once and sys.stdout.isatty()
    while True:
        started, cpu0 = time.monotonic(), time.process_time()
        frame = top.snapshot()
        if as_json:
            echo(json.dumps(frame, separators=(",", ":"), default=str))
        else:
            echo(("\x1b[H\x1b[2J" if clear else "") + render(frame) + ("" if clear or once else "\n"))
        if once or frame["job"]["finished"]:
            return
        # Never more than CPU_BUDGET of a core: with thousands of ranks (or a slow shared file
        # system) the refresh stretches instead of the cost growing.
        spent = time.process_time() - cpu0
        time.sleep(max(0.0, max(0.05, interval, spent / CPU_BUDGET) - (time.monotonic() - started)))
