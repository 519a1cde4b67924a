"""What one node's watcher knows of its ranks, as it travels between nodes, and the job made of them.

A node's look carries its own wall clock; the reader moves every time in it by the moment it
first saw that look on its own clock (``NodeView.shifted``), so skewed hosts compare as ages
and a node that stops writing ages like a rank that stops heartbeating.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.hung.proof import Activity
from ddpdoctor.probes.status import RankStatus


@dataclass
class NodeView:
    """One node's ranks as its watcher saw them in one look."""

    node: int
    host: str
    run_dir: str
    wall: float  # the node's clock when it looked
    statuses: dict[int, RankStatus]
    activity: dict[int, Activity]
    measuring: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "node": self.node,
                "host": self.host,
                "run_dir": self.run_dir,
                "wall": self.wall,
                "statuses": {str(r): s.to_json() for r, s in self.statuses.items()},
                "activity": {
                    str(r): [a.alive, a.idle_s, a.cpu_rate, a.frame, a.pending, a.own_code]
                    for r, a in self.activity.items()
                },
                "measuring": self.measuring,
            },
            separators=(",", ":"),
            default=str,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeView:
        d = json.loads(raw)
        return cls(
            int(d["node"]),
            str(d.get("host") or "?"),
            str(d.get("run_dir") or ""),
            float(d["wall"]),
            {int(r): RankStatus.from_json(s) for r, s in (d.get("statuses") or {}).items()},
            {int(r): Activity(*a) for r, a in (d.get("activity") or {}).items()},
            bool(d.get("measuring")),
        )

    def shifted(self, by: float) -> NodeView:
        """The same look with its times moved onto another clock (``by`` seconds)."""
        moved = {}
        for r, st in self.statuses.items():
            hb, progress = st.heartbeat_wall, st.progress_wall
            moved[r] = st.replace(
                heartbeat_wall=None if hb is None else float(hb) + by,
                progress_wall=None if progress is None else float(progress) + by,
            )
        return NodeView(
            self.node, self.host, self.run_dir, self.wall + by, moved, self.activity, self.measuring
        )


@dataclass
class JobView:
    """Every node's latest look on the reader's clock, and the nodes that fell silent."""

    nodes: dict[int, NodeView]
    lost: dict[int, float] = field(default_factory=dict)  # node -> seconds silent

    @property
    def statuses(self) -> dict[int, RankStatus]:
        out: dict[int, RankStatus] = {}
        for node in sorted(self.nodes):
            for r, st in self.nodes[node].statuses.items():
                if node in self.lost and not st.exited:
                    st = st.replace(lost=self.where(r))
                out[r] = st
        return out

    def activity(self, now: float) -> dict[int, Activity]:
        """What each node measured, aged to ``now``: a rank idle 2 s in a look 1 s old has not
        been seen to move for 3 s (a remote look is as old as the leader's first sight of it)."""
        out: dict[int, Activity] = {}
        for node, view in self.nodes.items():
            age = max(0.0, now - view.wall)
            for r in view.statuses:
                act = view.activity.get(r, Activity())
                idle = None if act.idle_s is None else act.idle_s + age
                out[r] = dataclasses.replace(act, alive=act.alive and node not in self.lost, idle_s=idle)
        return out

    def node_of(self, rank: int) -> int | None:
        return next((n for n, v in self.nodes.items() if rank in v.statuses), None)

    def where(self, rank: int) -> str:
        node = self.node_of(rank)
        return "?" if node is None else f"node {node} ({self.nodes[node].host})"

    def layout(self) -> dict[str, Any]:
        """The node map kept in run.json: which node held which ranks, and its run dir."""
        return {
            str(n): {
                "host": v.host,
                "ranks": sorted(v.statuses),
                "run_dir": v.run_dir,
                "lost": n in self.lost,
            }
            for n, v in sorted(self.nodes.items())
        }


def compact(verdict: dict[str, Any], keep: int = 16) -> dict[str, Any]:
    """A verdict as every node reads it four times a second: the culprits' places and phases,
    and one waiting rank per distinct place, not a thousand copies of "barrier #500"."""
    culprits = [str(r) for r in verdict.get("culprits") or []][:keep]
    chosen, points = list(culprits), set()
    for r, phase in (verdict.get("phases") or {}).items():
        point = (phase.get("op"), phase.get("seq"), phase.get("name"))
        if point not in points and len(chosen) < keep:
            points.add(point)
            chosen.append(r)
    chosen_set = set(chosen)
    return {
        **verdict,
        "where": {r: w for r, w in (verdict.get("where") or {}).items() if r in chosen_set},
        "phases": {r: p for r, p in (verdict.get("phases") or {}).items() if r in chosen_set},
    }


def nodes_text(nodes: dict[int, dict[str, Any]], hang: int) -> str:
    """The report's lines naming which node holds which ranks and where their stacks are
    (nothing for a job on one node)."""
    if len(nodes) < 2:
        return ""
    lines = ["", "  Nodes (stacks of each node's ranks are in its own run dir):"]
    for n, info in sorted(nodes.items()):
        ranks = rank_list(list(info.get("ranks") or []))
        lost = "  LOST: stopped reporting" if info.get("lost") else ""
        where = f"{info.get('run_dir')}/hang-{hang}/" if not info.get("lost") else "(none)"
        lines.append(f"    node {n} ({info.get('host')}): rank {ranks}  stacks: {where}{lost}")
    return "\n".join(lines)
