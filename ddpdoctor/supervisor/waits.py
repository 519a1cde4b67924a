"""Live notes of ranks waiting on a busy rank: slow is not hung, but the wait has a cost.

While the proof says "busy" (the ranks in a sync point wait for a rank that progresses
outside every sync point: rank-only work, not a slow training step, which is a straggler),
``RUN_DIR/waiting.json`` says who waits on whom, where the busy rank is (its user frame) and
for how long, rewritten about once a second; it disappears when the wait ends. Each ended
wait is kept as an episode in ``watch.json`` (``waits``), which the final diagnosis turns into
an efficiency finding with its cost. One stderr line per episode once it outlasts the hang
threshold tells the user why no hang was called.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpdoctor.analysis.hung.proof import Verdict, VerdictState
from ddpdoctor.rundir import RunDir, write_atomic

WAITING_SCHEMA = "ddpdoctor.waiting/1"
_WRITE_EVERY_S = 1.0


class WaitNotes:
    def __init__(self, run_dir: Path, on_change: Callable[[], None] | None = None) -> None:
        self.path = RunDir(run_dir) / RunDir.WAITING
        self.on_change = on_change or (lambda: None)
        self.episodes: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self._written = 0.0

    def update(self, verdict: Verdict, now: float, threshold: float, report: Callable[[str], None]) -> None:
        """Follow one look's verdict: open, refresh or close the current episode."""
        if verdict.state is VerdictState.BUSY and (verdict.rank_only or self.current is not None):
            cur = self.current
            if cur is None:
                cur = self.current = {
                    "start_wall": round(now - verdict.wait_s, 3),
                    "waiting": verdict.waiting,
                    "busy": verdict.culprits,
                    "phases": {str(r): p for r, p in verdict.phases.items()},
                    "printed": False,
                }
            cur["where"] = {str(r): w for r, w in sorted(verdict.where.items())}
            cur["wait_s"] = round(max(float(cur.get("wait_s", 0.0)), verdict.wait_s), 3)
            # A rank busy at the first look that has since joined the wait only arrived late:
            # it waits now, for the ranks still busy (it is no rank-only work of its own).
            cur["waiting"] = sorted(set(cur["waiting"]) | set(verdict.waiting))
            cur["busy"] = sorted((set(cur["busy"]) | set(verdict.culprits)) - set(verdict.waiting))
            cur["phases"].update(
                {str(r): p for r, p in verdict.phases.items() if str(r) not in cur["phases"]}
            )
            cur["text"] = verdict.proof
            cur["updated_wall"] = now
            if not cur["printed"] and verdict.wait_s >= threshold:
                cur["printed"] = True
                report(f"ddpdoctor: not a hang: {verdict.proof} ({verdict.wait_s:.0f} s so far)")
            if now - self._written >= _WRITE_EVERY_S:
                self._written = now
                self._write(cur)
            return
        if self.current is not None and verdict.state is not VerdictState.UNMEASURED:
            self.close(now)

    def close(self, now: float) -> None:
        """The wait is over (or the job ended): keep it as an episode, drop the live file."""
        cur, self.current = self.current, None
        if cur is None:
            return
        cur["end_wall"] = now
        cur["wait_s"] = round(max(float(cur.get("wait_s", 0.0)), now - float(cur["start_wall"])), 3)
        self.episodes.append(cur)
        with contextlib.suppress(OSError):
            self.path.unlink()
        self.on_change()

    def _write(self, cur: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            write_atomic(self.path, json.dumps({"schema": WAITING_SCHEMA, **cur}, indent=1, default=str))
