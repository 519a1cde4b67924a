"""A node whose ranks have all ended while its launcher keeps running.

torchrun's agent, once its own workers succeeded, waits in an exit barrier (300 s by default)
for every other node's agent; an agent whose workers failed never arrives there. So when a job
fails on another node, this node's launcher lingers for minutes after its ranks are gone, and
its console says nothing. The watcher says once what happened (this node's ranks, the others'
as the board last saw them) and settles the run dir, so that the job can be diagnosed while
the launcher waits; a Ctrl-C then stops the launcher (launch.py), which torchrun, blocked in the
store's wait, would not act on until the barrier times out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor.jobview import JobView

GRACE_S = 3.0  # a launcher that outlives its ranks by this much is waiting for something


class Lingering:
    def __init__(self, run_dir: Path, report: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.report = report
        self.since: float | None = None
        self.said = False

    def look(
        self, mine: Mapping[int, RankStatus], alive: Mapping[int, bool], view: JobView | None, now: float
    ) -> bool:
        """Say it once, GRACE_S after the last of this node's ranks exited, every one cleanly
        (a rank that failed ends its agent, or has it restart the workers), and once a rank on
        another node failed or was lost (a node still training will arrive); True when it did."""
        if self.said or not mine or any(alive.values()) or not all(_clean(st) for st in mine.values()):
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if now - self.since < GRACE_S or not _failed_elsewhere(mine, view):
            return False
        self.said = True
        from ddpdoctor.supervisor.ends import settle

        settle(self.run_dir, wait_s=0.0)
        self.report(text(mine, view, self.run_dir))
        return True


def text(mine: Mapping[int, RankStatus], view: JobView | None, run_dir: Path) -> str:
    here = "; ".join(f"rank {r} {_ended(st)}" for r, st in sorted(mine.items()))
    lines = [
        f"ddpdoctor: every rank on this node has ended ({here}), but the launcher still runs: "
        "torchrun keeps a node whose ranks succeeded in its exit barrier (up to 300 s by "
        "default) until every node's agent arrives, and the agent of a node whose ranks failed "
        "never does. Ctrl-C ends it (torchrun alone would act on it only when that wait ends)."
    ]
    dirs = [str(run_dir)]
    if view is not None:
        others = {r: st for r, st in view.statuses.items() if r not in mine}
        if others:
            told = "; ".join(
                f"rank {r} (node {view.node_of(r)}) {_ended(st)}" for r, st in sorted(others.items())
            )
            lines.append(f"  The other nodes, as last seen: {told}.")
        dirs += [v.run_dir for _, v in sorted(view.nodes.items()) if v.run_dir and v.run_dir not in dirs]
    lines.append(f"  This node's records are complete: ddpdoctor diagnose {' '.join(dirs)}")
    return "\n".join(lines)


def _failed_elsewhere(mine: Mapping[int, RankStatus], view: JobView | None) -> bool:
    others = [st for r, st in (view.statuses.items() if view is not None else ()) if r not in mine]
    return any(st.error or st.lost for st in others)


def _clean(st: RankStatus) -> bool:
    return bool(st.exited) and not st.error


def _ended(st: RankStatus) -> str:
    if st.error:
        return f"raised {st.error.get('type') or 'an exception'}"
    if st.exited:
        return "exited"
    if st.lost:
        return "no longer heard from"
    return "still running"
