"""supervisor/lingering.py: a node whose ranks all exited cleanly while its launcher runs on
(torchrun's exit barrier) is told once, after a grace, and only then."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor.jobview import JobView, NodeView
from ddpdoctor.supervisor.lingering import GRACE_S, Lingering


def st(rank: int, **kw: object) -> RankStatus:
    return RankStatus.of({"rank": rank, "pid": 100 + rank, "heartbeat_wall": 1.0, **kw})


def test_said_once_after_the_grace_with_the_other_nodes_ranks(tmp_path: Path) -> None:
    said: list[str] = []
    watch = Lingering(tmp_path, said.append)
    mine = {0: st(0, exited=True)}
    other = {1: st(1, error={"type": "OSError", "message": "disk full"})}
    nodes = {0: NodeView(0, "a", str(tmp_path), 0.0, mine, {}), 1: NodeView(1, "b", "/r/n1", 0.0, other, {})}
    view = JobView(nodes)
    assert not watch.look(mine, {0: True}, view, 10.0)  # still alive: nothing
    assert not watch.look(mine, {0: False}, view, 11.0)  # the grace starts
    assert not watch.look(mine, {0: False}, view, 11.0 + GRACE_S / 2)
    assert watch.look(mine, {0: False}, view, 11.0 + GRACE_S)
    assert not watch.look(mine, {0: False}, view, 20.0) and len(said) == 1  # once
    text = " ".join(said[0].split())
    assert "rank 0 exited" in text and "rank 1 (node 1) raised OSError" in text
    assert f"ddpdoctor diagnose {tmp_path} /r/n1" in text
    assert (tmp_path / "ends.json").is_file()  # settled for a diagnosis while the launcher waits


def test_nothing_is_said_while_the_other_nodes_ranks_still_train(tmp_path: Path) -> None:
    """A node that finished first waits for the others in the exit barrier: they will come."""
    said: list[str] = []
    watch = Lingering(tmp_path, said.append)
    mine, other = {0: st(0, exited=True)}, {1: st(1, step=40)}
    nodes = {0: NodeView(0, "a", str(tmp_path), 0.0, mine, {}), 1: NodeView(1, "b", "/r/n1", 0.0, other, {})}
    for now in (1.0, 5.0, 30.0):
        assert not watch.look(mine, {0: False}, JobView(nodes), now)
    failed = {1: st(1, error={"type": "OSError"})}  # then node 1's rank fails: now it is said
    nodes[1] = NodeView(1, "b", "/r/n1", 0.0, failed, {})
    assert watch.look(mine, {0: False}, JobView(nodes), 31.0) and len(said) == 1


def test_a_failed_rank_here_is_not_a_launcher_left_waiting(tmp_path: Path) -> None:
    """A rank that raised ends its agent (or makes it restart the workers): no exit barrier."""
    said: list[str] = []
    watch = Lingering(tmp_path, said.append)
    mine = {0: st(0, exited=True), 1: st(1, error={"type": "ValueError"})}
    for now in (1.0, 2.0, 10.0):
        assert not watch.look(mine, {0: False, 1: False}, None, now)
    assert not said
