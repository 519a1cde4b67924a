"""Live supervision inside `ddpdoctor run`: read each rank's status file, catch hangs and deaths.

A thread polls ``status-rank{R}.json`` (written by every rank's trace writer thread, see
``probes/liveness.py``) and hands each look to the pure ``analysis/proof.judge``, measuring the
ranks' CPU time and stacks (``activity.py``) only while someone waits or nothing is recorded:
  * proven (every live rank blocked, and they disagree, or a peer left): a hang at once;
  * stalled (a rank outside sync points does not move) or blocked in one consistent collective:
    a hang once the threshold passes;
  * busy (the rank the others wait for progresses): a live note (``waits.py``), and a hang only
    past ``--hang-timeout`` when the user set one.
The default threshold adapts: ``HANG_MULTIPLE`` times the slowest step any rank has seen, never
below the floor. On a hang it dumps every rank's stack (stacks.py), diagnoses (analysis/hung/hang.py),
writes ``hang-N/`` and prints the report on stderr; with ``on_hang="kill"`` it then stops the job.
It also notes ranks that vanish (killed by a signal, or gone on their own) for ``rank_failure``.

A job that spans nodes is judged as one: each node's watcher puts its look on the job's board
(board.py, the rendezvous store), the node of rank 0 judges every node's ranks and the others
follow its verdict; on a hang each node dumps its own ranks' stacks and prints the same report.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpdoctor.analysis.hung import flight
from ddpdoctor.analysis.hung.hang import analyse
from ddpdoctor.analysis.hung.proof import ATOMIC, Activity, Verdict, VerdictState, is_hang, judge
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor import hangfile
from ddpdoctor.supervisor import stacks as _stacks
from ddpdoctor.supervisor.activity import ActivityTracker, pid_alive, pyspy_sample, zombie_signal
from ddpdoctor.supervisor.board import Board
from ddpdoctor.supervisor.jobview import JobView, NodeView, compact, nodes_text
from ddpdoctor.supervisor.lingering import Lingering
from ddpdoctor.supervisor.profile import StragglerProfile
from ddpdoctor.supervisor.statuses import (
    DEFAULT_FLOOR_S,
    HANG_MULTIPLE,
    adaptive_threshold,
    read_statuses,
    snapshot,
)
from ddpdoctor.supervisor.waits import WaitNotes

WATCH_SCHEMA = "ddpdoctor.watch/1"
FRESH_S = 1.0
LOOK_SHARE = 5.0  # wait at least this many times the CPU the last look took


class Watcher:
    """The supervision thread; ``start()`` after launching, ``stop()`` when the job has ended."""

    def __init__(
        self,
        run_dir: Path,
        *,
        hang_timeout: float | None = None,
        on_hang: str = "dump",
        floor_s: float = DEFAULT_FLOOR_S,
        multiple: float = HANG_MULTIPLE,
        poll_s: float = 0.25,
        report: Callable[[str], None] | None = None,
        kill_job: Callable[[list[int]], None] | None = None,
        use_pyspy: bool = True,
        since_wall: float | None = None,
        board: Board | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.hang_timeout = hang_timeout
        self.on_hang = on_hang
        self.floor_s = floor_s
        self.multiple = multiple
        self.poll_s = poll_s
        self.report = report or (lambda text: None)
        self.kill_job = kill_job
        self.use_pyspy = use_pyspy
        self.hangs: list[dict[str, Any]] = []
        self.exits: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, dict[str, Any]] = {}
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddpdoctor-watch", daemon=True)
        self._last_events: dict[int, int] = {}
        self._last_change = time.time()
        # Statuses with an older heartbeat belong to an earlier run in a reused --out dir.
        self._started_wall = time.time() - 1.0 if since_wall is None else since_wall
        self._armed = True
        self._statuses: dict[int, RankStatus] = {}
        self._lock = threading.Lock()
        self._rank_change: dict[int, float] = {}  # when each rank last recorded an event
        self._tracker = ActivityTracker(dump=pyspy_sample if use_pyspy else None)
        self._notes = WaitNotes(self.run_dir, on_change=self._write_watch)
        # The job as the board shows it (supervisor/board.py): this node alone, or every node.
        self.board = board or Board.local()
        self._host = socket.gethostname()
        self._local_events: dict[int, int] = {}
        self._measuring = False  # the leader says someone in the job waits: measure our ranks
        self._declared = 0  # hangs the leader declared (the leader's count)
        self._hang_payload: dict[str, Any] | None = None
        self._state: dict[str, Any] = {}
        self._view = JobView({})
        self._lingering = Lingering(run_dir, report)
        self._profile = StragglerProfile(self.run_dir, use_pyspy)
        self._lost: dict[int, dict[str, Any]] = {}
        self._nodes: dict[str, Any] = {}  # the job's node map, as the leader last posted it
        self._layout_v = 0
        self._nodes_seen: dict[str, dict[str, Any]] = {}  # the leader's last look at each node

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        """Stop watching; waits for a diagnosis in progress so its files are complete."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self.poll_once(time.time(), detect=False)  # last look: catch a final rank death
        self._profile.join()  # a straggler's profile under way: its ranks have exited, it ends
        with self._lock:
            self._notes.close(time.time())
        self._write_watch()

    @property
    def hung(self) -> bool:
        """A hang was reported and the job has not moved since."""
        return bool(self.hangs) and not self.hangs[-1]["recovered"]

    @property
    def lingering(self) -> bool:
        """Every rank of this node exited cleanly and the launcher still runs (lingering.py)."""
        return self._lingering.said

    def job_layout(self) -> dict[str, Any]:
        """Which node held which ranks (run.json's ``job``), as the board last showed it."""
        nodes = {**self._nodes, **self._view.layout()} if self.board.leading else self._nodes
        return {**self.board.layout.to_json(), "node": self.board.node, "nodes": nodes or self._view.layout()}

    def _node(self, statuses: dict[int, RankStatus]) -> int:
        """This node's rank in the job: its ranks' GROUP_RANK, else the launcher's --node_rank."""
        for st in statuses.values():
            if isinstance(st.node, int):
                return st.node
        return self.board.node if self.board.node is not None else 0

    def rank_pids(self) -> list[int]:
        return [s.pid or 0 for s in self._statuses.values()]

    def threshold(self, statuses: dict[int, RankStatus]) -> float:
        if self.hang_timeout is not None:
            return self.hang_timeout
        return adaptive_threshold(statuses, self.floor_s, self.multiple)

    def _loop(self) -> None:
        interval = self.poll_s
        while not self._stop.wait(interval):
            try:
                t0 = time.thread_time()
                self.poll_once(time.time())
                # Thousands of ranks: look less often rather than take more than ~1/5 of a core.
                # The look's own CPU, not its wall time: a look that waited (for the store, on a
                # loaded host) must not leave the watcher blind five times as long.
                interval = max(self.poll_s, LOOK_SHARE * (time.thread_time() - t0))
            except Exception as exc:  # the supervisor's own bug must not end supervision quietly
                self.report(f"ddpdoctor: hang watch failed: {exc!r}")
                return

    def poll_once(self, now: float, detect: bool = True) -> dict[str, Any] | None:
        """One look: this node's ranks, shared on the board; the leader judges the job, every
        node follows its verdict. Returns the hang summary if this look caught one."""
        with self._lock:
            statuses = {
                r: st
                for r, st in read_statuses(self.run_dir).items()
                if (st.heartbeat_wall or 0.0) >= self._started_wall
            }
            if not statuses and not self.board.layout.multi_node:
                return None
            alive = self._look_local(statuses, now)
            if detect:
                self._profile.look(statuses, alive, now)
            mine = NodeView(
                self._node(statuses),
                self._host,
                str(self.run_dir.resolve()),
                now,
                statuses,
                self._measure(statuses, alive, now),
                self._measuring,
            )
            running = any(a and not statuses[r].exited for r, a in alive.items())
            self._view = self.board.exchange(mine, now, running)
            if self.board.layout.multi_node:
                self._lingering.look(statuses, alive, self._view, now)
            if self.board.leading:
                state = self._decide(self._view, now, detect)
                self.board.post_state(state)
            else:
                state = self.board.job_state()
            if state is None:
                return None
            if state.get("layout_v") != self._state.get("layout_v") and not self.board.leading:
                self._nodes = self.board.layout_map() or self._nodes
            self._state = state
            verdict = Verdict.from_json(state["verdict"])
            self._measuring = bool(state.get("measure"))
            self._notes.update(verdict, now, float(state["threshold"]), self.report)
            if self.hangs and state.get("recovered") and not self.hangs[-1]["recovered"]:
                self.hangs[-1]["recovered"] = True
                self._save_hang(self.hangs[-1])
            n = int(state.get("hangs") or 0)
            if not detect or n <= len(self.hangs):
                return None
            hang = self._hang_payload if self.board.leading else self.board.hang(n)
            if hang is None:
                return None
        return self._on_hang(hang, now)

    def _look_local(self, statuses: dict[int, RankStatus], now: float) -> dict[int, bool]:
        """This node's facts: which ranks are alive, which raised or left (for rank_failure)."""
        self._statuses = statuses
        alive: dict[int, bool] = {}
        for rank, st in statuses.items():
            if self._local_events.get(rank) != st.events:
                self._local_events[rank] = st.events
                self._rank_change[rank] = now
            if st.error and rank not in self.errors:
                self.errors[rank] = {"seen_wall": now, **st.error, "others": snapshot(statuses, rank)}
                self._write_watch()
            pid = st.pid or 0
            # A heartbeat written in the last second is proof of life, and costs no syscall.
            fresh = now - (st.heartbeat_wall or 0.0) < FRESH_S and not st.exited
            alive[rank] = True if fresh or not pid else pid_alive(pid)
            if pid and rank not in self.exits and not alive[rank]:
                self.exits[rank] = {
                    "pid": pid,
                    "seen_wall": now,
                    "signal": zombie_signal(pid),
                    "exited": st.exited,
                    "step": st.step,
                    "last_heartbeat_wall": st.heartbeat_wall,
                    "error": st.error,
                    "others": snapshot(statuses, rank),
                }
                self._write_watch()
        return alive

    def _measure(
        self, statuses: dict[int, RankStatus], alive: dict[int, bool], now: float
    ) -> dict[int, Activity]:
        """This node's ranks' CPU time and stacks, measured only while someone in the job waits
        or nothing moves (the leader says so for ranks on other nodes)."""
        live = {r for r, a in alive.items() if a and not statuses[r].exited}
        waiting = any(statuses[r].waits_now(now) for r in live)
        quiet = now - max(self._rank_change.values(), default=now)
        if not (waiting or self._measuring or quiet >= 1.0):
            self._tracker.forget()
            return {r: Activity(alive=alive[r]) for r in statuses}
        measure = {r for r in live if (statuses[r].phase or {}).get("name") not in ATOMIC}
        want = measure if waiting or self._measuring else None
        return self._tracker.look(statuses, now, measure, alive, want_frame=want, since=self._rank_change)

    def _decide(self, view: JobView, now: float, detect: bool) -> dict[str, Any]:
        """The leader's judgement of the whole job (a single node leads itself)."""
        statuses, activity = view.statuses, view.activity(now)
        changed = False
        for rank, st in statuses.items():
            if self._last_events.get(rank) != st.events:
                self._last_events[rank] = st.events
                changed = True
        if changed:
            self._last_change = now
        for n, v in view.nodes.items():
            seen = now if n == self.board.node else self.board.last_seen(n)
            self._nodes_seen[str(n)] = {
                "host": v.host,
                "ranks": sorted(v.statuses),
                "seen_wall": seen,
                "steps": {str(r): st.step for r, st in v.statuses.items()},
                "running": any(not st.exited and not st.error for st in v.statuses.values()),
            }
        self._lost = {
            n: {"host": view.nodes[n].host, "ranks": sorted(view.nodes[n].statuses), "silent_s": round(s, 3)}
            for n, s in view.lost.items()
        }
        threshold = self.threshold(statuses)
        quiet = now - self._last_change
        verdict = judge(statuses, activity, now, self._world(statuses))
        alive = {r: activity[r].alive for r in statuses}
        longest = max((s.sync_wait_s(now) for r, s in statuses.items() if alive[r]), default=0.0)
        recovered = False
        if not self._armed and changed and longest <= threshold and verdict.state is not VerdictState.PROVEN:
            self._armed = True  # every rank is out of the stuck sync point and moving
            recovered = True
        failing = any(st.error for st in statuses.values())
        started = any(s.step >= 1 for s in statuses.values())
        waiting = bool(verdict.waiting) or any(s.waits_now(now) for s in statuses.values())
        hang = is_hang(
            verdict, threshold, hang_timeout=self.hang_timeout, longest=longest, quiet=quiet, started=started
        )
        if detect and self._armed and not failing and hang:
            self._armed = False
            self._declared += 1
            self._hang_payload = {
                "n": self._declared,
                "detected_wall": now,
                "threshold_s": threshold,
                "quiet_s": round(max(longest, quiet if started else 0.0), 3),
                "verdict": verdict.to_json(),
                "statuses": {str(r): s.to_json() for r, s in statuses.items()},
                "nodes": view.layout(),
            }
            self.board.post_hang(self._hang_payload)
        layout = {**self._nodes, **view.layout()}  # nodes once seen stay in the map
        if layout != self._nodes:
            self._nodes = layout
            self._layout_v += 1
            self.board.post_layout(self._nodes)
        return {
            "layout_v": self._layout_v,
            "wall": now,
            "verdict": compact(verdict.to_json()) if self.board.shared else verdict.to_json(),
            "threshold": threshold,
            "measure": waiting or quiet >= 1.0,
            "hangs": self._declared,
            "recovered": recovered or (self._armed and self._declared > 0),
        }

    @staticmethod
    def _world(statuses: dict[int, RankStatus]) -> int | None:
        return max((s.world_size or 0 for s in statuses.values()), default=0) or None

    def _on_hang(self, hang: dict[str, Any], now: float) -> dict[str, Any]:
        """Every node: dump its own ranks' stacks, share them, gather the others', and print the
        job's report (the same on every node); with ``--on-hang kill``, stop its own ranks."""
        n = int(hang["n"])
        hang_dir = RunDir(self.run_dir).hang(n)
        hang_dir.mkdir(exist_ok=True)
        statuses = {int(r): RankStatus.of(s) for r, s in (hang.get("statuses") or {}).items()}
        mine = {r: s for r, s in self._statuses.items() if r in statuses}
        stacks = _stacks.dump_all(mine, self.use_pyspy)
        self.board.share_stacks(n, stacks)
        nodes = {int(k): v for k, v in (hang.get("nodes") or {}).items()}
        stacks.update(self.board.gather_stacks(n, [k for k, v in nodes.items() if not v.get("lost")]))
        verdict = Verdict.from_json(hang["verdict"]) if hang.get("verdict") else None
        threshold, quiet = float(hang["threshold_s"]), float(hang["quiet_s"])
        proof = verdict.proof_line if verdict is not None else ""
        diag = analyse(
            statuses,
            stacks,
            threshold_s=threshold,
            quiet_s=quiet,
            now=float(hang["detected_wall"]),
            world_size=self._world(statuses),
            proof=proof,
        )
        text = diag.text(str(hang_dir)) + nodes_text(nodes, n) + flight.on_hang(self.run_dir, hang_dir, mine)
        fields = {"detected_wall": now, "threshold_s": threshold, "quiet_s": quiet}
        fields.update(world_size=self._world(statuses), action=self.on_hang, node=self.board.node)
        fields.update(nodes=hang.get("nodes") or {}, reported_wall=time.time())
        fields["verdict"] = verdict.to_json() if verdict is not None else None
        summary = hangfile.summary(hang_dir, n, statuses, stacks, text, **fields)
        hangfile.save_stacks(self.run_dir, n, {r: d for r, d in stacks.items() if r in mine})
        self._save_hang(summary)
        self.hangs.append(summary)
        self.report(text)
        self._write_watch()
        if self.on_hang == "kill" and self.kill_job is not None:
            self.killed = True
            self.report("ddpdoctor: --on-hang kill: stopping the job")
            summary["killed_wall"] = time.time()  # where the report draws the kill
            self._save_hang(summary)
            self.kill_job([s.pid or 0 for s in mine.values()])
        return summary

    def _save_hang(self, summary: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            hangfile.save(summary)

    def _write_watch(self) -> None:
        _write_json(
            self.run_dir / RunDir.WATCH,
            {
                "schema": WATCH_SCHEMA,
                "hang_timeout": self.hang_timeout,
                "on_hang": self.on_hang,
                "hangs": [h["hang_dir"] for h in self.hangs],
                "killed_on_hang": self.killed,
                "rank_exits": {str(r): e for r, e in self.exits.items()},
                "rank_errors": {str(r): e for r, e in self.errors.items()},
                "waits": self._notes.episodes,
                "node": self.board.node,
                "lost_nodes": {str(n): v for n, v in self._lost.items()},
                "nodes": self._nodes_seen if self.board.leading else {},
                "nodes_read_wall": self.board.last_ok if self.board.leading else None,
            },
        )


def _write_json(path: Path, obj: Any) -> None:
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(obj, indent=1, default=str))
