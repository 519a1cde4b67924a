"""Where a straggler's time goes: a short wall-clock profile of it and of a peer, while it lags.

A straggler finding names the late rank and the phase that makes it late; the line is in
neither the trace nor the status. While the job runs, the live lateness (live/lateness.py, the
analysis's own straggler rule) names a persistent straggler, or the rank the others waited for
a fifth of the recent steps' time (a straggler too young for the rule, a rank's beat of its own
work every N steps); once per run the watcher then
records that rank and the most punctual other rank of this node side by side with ``py-spy
record --nonblocking --idle`` for ``PROFILE_S`` at ``RATE_HZ``: never pausing them, and
keeping idle samples, since a rank's sleep or wait is where its time goes too. Each sample is
reduced to the main thread's innermost user frame (trace/stacktext.py's rule) and counted into
``profile.json``, with the user frames that called it (a slow helper is found where it is
called from: the data path, the forward); the analysis compares the two ranks' shares line by line
(analysis/slow/where.py). It runs on its own thread: the watcher never waits for it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpdoctor.live.lateness import live_lateness
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir, write_atomic
from ddpdoctor.supervisor.stacks import pyspy_path
from ddpdoctor.trace.stacktext import is_user_frame

SCHEMA = "ddpdoctor.profile/1"
CHECK_S = 1.0  # how often the live lateness is asked (12-26 ms of CPU at 1,024 ranks on a node)
PROFILE_S = 5.0
RATE_HZ = 100
TOP_LINES = 40  # lines kept per rank, the most sampled first
CALLERS = 3  # user frames kept above a line: a helper's caller, and the loop line above it
_INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # the line of the frame above


def collapsed_lines(text: str) -> tuple[int, list[list[Any]]]:
    """``py-spy record --format raw --full-filenames`` output -> (the main thread's samples,
    [[function, file, line, samples, callers]] by its innermost user frame, most first).
    ``callers``: the user frames above it in most of its samples, nearest first, as [function,
    file, line], without the script's top level. Other threads (their outermost frame is
    threading's bootstrap) are left out."""
    total = 0
    lines: Counter[tuple[str, str, int]] = Counter()
    chains: dict[tuple[str, str, int], Counter[tuple[tuple[str, str, int], ...]]] = {}
    for row in text.splitlines():
        stack, _, count = row.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        if not frames or not count.isdigit():
            continue
        if "_bootstrap (" in frames[0] and "threading.py" in frames[0]:
            continue
        n = int(count)
        total += n
        user = []
        for frame in reversed(frames):
            function, _, where = frame.rpartition(" (")
            file, _, line = where.rstrip(")").rpartition(":")
            inner = not user or (function != "<module>" and not function.endswith(_INLINE))
            if line.isdigit() and is_user_frame(file) and inner:
                user.append((function, file, int(line)))
                if len(user) > CALLERS:
                    break
        if user:
            lines[user[0]] += n
            chains.setdefault(user[0], Counter())[tuple(user[1:])] += n
    top = sorted(lines.items(), key=lambda kv: -kv[1])[:TOP_LINES]
    return total, [[*key, n, [list(frame) for frame in chains[key].most_common(1)[0][0]]] for key, n in top]


def _record(exe: str, pid: int, out: Path, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(RATE_HZ),
         "--nonblocking", "--idle", "--full-filenames", "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


class StragglerProfile:
    """Once per run, on this node: the first live persistent straggler and its peer."""

    def __init__(self, run_dir: Path, use_pyspy: bool, seconds: float = PROFILE_S) -> None:
        self.path = Path(run_dir) / RunDir.PROFILE
        self._exe = pyspy_path() if use_pyspy else None
        self._seconds = seconds
        self._next = 0.0
        self._thread: threading.Thread | None = None
        self.started = self._exe is None  # nothing to start without py-spy

    def look(self, statuses: Mapping[int, RankStatus], alive: Mapping[int, bool], now: float) -> None:
        """Called on every look of the watcher; never raises (a failure switches it off)."""
        if self.started or now < self._next:
            return
        self._next = now + CHECK_S
        try:
            self._look(statuses, alive)
        except Exception:
            self.started = True

    def _look(self, statuses: Mapping[int, RankStatus], alive: Mapping[int, bool]) -> None:
        live = {r: s for r, s in statuses.items() if alive.get(r) and not s.exited and s.pid}
        table = live_lateness(live)
        if table is None:
            return
        found = table.stragglers() or [w for w in [table.waited_for()] if w is not None]
        if not found:
            return
        rank = int(found[0]["ranks"][0])
        mean = {r: v["mean_us"] for r, v in table.per_rank().items() if r != rank}
        if not mean:
            return
        peer = min(mean, key=lambda r: mean[r])
        self.started = True
        pids = {rank: int(live[rank].pid or 0), peer: int(live[peer].pid or 0)}
        why = str(found[0]["text"])
        self._thread = threading.Thread(
            target=self._run, args=(rank, peer, pids, why), name="ddpdoctor-profile", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for a profile under way (the job has ended: py-spy stops with the ranks)."""
        if self._thread is not None:
            self._thread.join(self._seconds + 10.0 if timeout is None else timeout)

    def _run(self, rank: int, peer: int, pids: dict[int, int], why: str) -> None:
        assert self._exe is not None
        started = time.time()
        out: dict[str, Any] = {"schema": SCHEMA, "straggler": rank, "peer": peer, "why": why,
                               "started_wall": started, "rate_hz": RATE_HZ, "ranks": {}}  # fmt: skip
        try:
            with tempfile.TemporaryDirectory(prefix="ddpdoctor-profile-") as tmp:
                files = {r: Path(tmp) / f"rank{r}.txt" for r in pids}
                procs = {r: _record(self._exe, pid, files[r], self._seconds) for r, pid in pids.items()}
                for r, proc in procs.items():
                    try:
                        _, err = proc.communicate(timeout=self._seconds + 10.0)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        _, err = proc.communicate()
                    text = files[r].read_text(errors="replace") if files[r].exists() else ""
                    samples, lines = collapsed_lines(text)
                    entry: dict[str, Any] = {"samples": samples, "lines": lines}
                    if not text and err:
                        said = [ln for ln in err.splitlines() if ln.startswith("Error")] or [err.strip()]
                        entry["error"] = said[0][-300:]
                    out["ranks"][str(r)] = entry
        except Exception as exc:  # the supervisor's extra must never end supervision
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = round(time.time() - started, 3)
        with contextlib.suppress(OSError):  # a run dir gone: nothing to keep it in
            write_atomic(self.path, json.dumps(out, indent=1))
