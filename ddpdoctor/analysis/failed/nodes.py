"""Nodes: which ranks ran on nodes whose run dirs were not read, and a node the job lost.

Each node's watcher shares its ranks through the job's store and keeps, in ``watch.json``, when
it last saw each other node's report change (``nodes``, on its own clock). A node whose report
stopped while its ranks were still training, before the first failure on the nodes read, is
the root of the failures that follow: its ranks went away, and the others' "connection closed"
or timeouts are the consequence. Silence is the evidence: a node's watcher reports four times a
second whatever its ranks do, so a report that stopped changing for seconds while the leader
still read every node's key means the watcher itself went away with its node.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddpdoctor.analysis.failed.endings import is_consequence
from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.trace.reader import Run

SILENT_S = 1.5  # a node reports every 0.25 s, its ranks dead or alive: silent this long, it is gone
SLACK_S = 0.5  # a report is seen up to one look late


@detector
def other_nodes(run: Run) -> Iterable[Finding]:
    elsewhere = run.elsewhere
    if not elsewhere or _lost(run):
        return
    nodes: dict[str, list[int]] = {}
    for rank, where in elsewhere.items():
        nodes.setdefault(where, []).append(rank)
    text = "; ".join(f"rank(s) {rank_list(rs)} on {where}" for where, rs in nodes.items())
    if run.stopped_lingering:
        text += (
            f". Every rank read here exited cleanly; the launcher, left in torchrun's exit barrier "
            f"waiting for the other nodes, was stopped on Ctrl-C (exit code {run.exit_code})"
        )
    yield Finding(
        "other_nodes",
        "info",
        sorted(elsewhere),
        f"this diagnosis covers the ranks of {len(run.dirs)} node(s); the job's other ranks ran "
        f"elsewhere: {text}",
        fix="For the whole job, pass every node's run directory: ddpdoctor diagnose DIR1 DIR2 ...",
        details={"world_size": run.world_size, "elsewhere": {str(r): w for r, w in elsewhere.items()}},
    )


@detector
def node_lost(run: Run) -> Iterable[Finding]:
    for node, info, first in _lost(run):
        ranks = [int(r) for r in info.get("ranks") or []]
        gap = float(info["silent_s"])
        steps = [v for v in (info.get("steps") or {}).values() if isinstance(v, int)]
        at = f" at step {max(steps)}" if steps else ""
        silence = (
            f"stayed silent for the job's last {gap:.1f} s: the job lost that node"
            if gap >= SILENT_S
            else "never reported a failure of its own: its ranks went away at once (the node, its "
            "network or its processes died)"
        )
        yield Finding(
            "node_lost",
            "error",
            ranks,
            f"node {node} ({info.get('host')}; rank {rank_list(ranks)}) last reported its ranks "
            f"training{at} when rank {first['rank']} lost its peers ({first['what']}), and {silence}; "
            f"the failures on the other nodes are the consequence. Its run dir ({info.get('run_dir') or '?'})"
            " says what happened there, if it survived",
            fix=f"Find out what happened to {info.get('host')} (its kernel log for the OOM killer or a "
            "reboot, the scheduler's record, its network); if the node's disk survived, diagnose its run "
            "dir with the others'. To survive a lost node, run with torchrun --max-restarts and "
            "checkpoint often enough to resume.",
            details={
                "root_rank": min(ranks) if ranks else None,
                "node": node,
                "last_seen_s": round(gap, 3),
                "first_failure": first,
                **{k: v for k, v in info.items() if k != "steps"},
            },
        )


def _lost(run: Run) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(node, what the leader last knew of it, the first failure it preceded) for each node
    whose report stopped, ranks still training, before the first failure on the nodes read."""
    first = _first_failure(run)
    if first is None:
        return []
    out = []
    elsewhere = set(run.elsewhere)
    for watch in run.watches:
        read = watch.get("nodes_read_wall")
        for node, info in (watch.get("nodes") or {}).items():
            ranks = set(int(r) for r in info.get("ranks") or [])
            seen = info.get("seen_wall")
            if not ranks or not ranks <= elsewhere or not info.get("running") or not read or not seen:
                continue
            silent = float(read) - float(seen)
            # Its ranks training in its last report, which came no later than the failure here,
            # and the failure here a lost peer: its ranks are the peers that went away.
            if first["lost_peer"] and float(seen) <= first["wall"] + SLACK_S:
                out.append((str(node), {**info, "silent_s": round(silent, 3)}, first))
    return out


def _first_failure(run: Run) -> dict[str, Any] | None:
    """The earliest rank error or death the watchers of the nodes read saw (their clocks)."""
    found: list[dict[str, Any]] = []
    for watch in run.watches:
        for rank, err in (watch.get("rank_errors") or {}).items():
            what = f"{err.get('type')}: {_gist(str(err.get('message') or ''))}"
            lost_peer = is_consequence(err)
            found.append({"wall": float(err.get("seen_wall") or 0.0), "rank": int(rank), "what": what,
                          "lost_peer": lost_peer})  # fmt: skip
        for rank, ex in (watch.get("rank_exits") or {}).items():
            if not ex.get("exited"):
                err = ex.get("error") or {}
                found.append({"wall": float(ex.get("seen_wall") or 0.0), "rank": int(rank), "what": "gone",
                              "lost_peer": bool(err) and is_consequence(err)})  # fmt: skip
    return min(found, key=lambda f: f["wall"]) if found else None


def _gist(message: str, width: int = 90) -> str:
    """The message's first line without a C++ source prefix ("[.../pair.cc:553] "), cut at a word."""
    line = (message.splitlines() or [""])[0]
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."
