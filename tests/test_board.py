"""The job board's pure parts: where the store is, what a node's look carries, lost nodes."""

from __future__ import annotations

import time

from ddpdoctor.analysis.hung.proof import Activity, judge
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.supervisor.jobview import JobView, NodeView, nodes_text
from ddpdoctor.supervisor.layout import Layout, parse_layout

PY = ["python", "-m", "torch.distributed.run"]


def test_layout_from_torchrun_arguments() -> None:
    two = parse_layout(
        ["torchrun", "--nnodes", "2", "--node_rank=1", "--nproc-per-node", "4", "--master_addr", "10.0.0.5",
         "--master_port", "29501", "train.py", "--nnodes", "9"], {}
    )  # fmt: skip
    assert two == Layout(2, 1, 4, ("10.0.0.5", 29501)) and two.multi_node
    c10d = parse_layout(
        [*PY, "--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "t.py"], {}
    )
    assert c10d.nnodes == 4 and c10d.endpoint == ("head", 29400) and c10d.node_rank is None
    assert not parse_layout(["torchrun", "--standalone", "--nproc_per_node", "2", "t.py"], {}).multi_node
    assert not parse_layout(["python", "train.py"], {}).multi_node
    assert parse_layout(["torchrun", "t.py"], {"PET_NNODES": "2", "PET_MASTER_ADDR": "h"}).endpoint == (
        "h",
        29500,
    )
    off = parse_layout(["torchrun", "--nnodes", "2", "t.py"], {"DDPDOCTOR_STORE": "off"})
    assert not off.multi_node
    # An option's value is skipped, a flag is not: the script after --no-python is still found.
    skip = parse_layout(["torchrun", "--log-dir", "logs", "--no-python", "--nnodes", "3", "run.sh"], {})
    assert skip.nnodes == 3


def _status(rank: int, now: float, **phase: object) -> RankStatus:
    return RankStatus(rank, world_size=2, pid=1, heartbeat_wall=now, progress_wall=now, step=4, events=10,
                      phase=phase or None)  # fmt: skip


def test_a_nodes_look_travels_and_lands_on_the_readers_clock() -> None:
    view = NodeView(
        1,
        "b",
        "/runs/n1",
        1000.0,
        {1: _status(1, 999.5)},
        {1: Activity(True, 4.0, 0.0, "f() x.py:3", own_code=True)},
    )
    back = NodeView.from_json(view.to_json())
    assert back.activity[1] == view.activity[1] and back.statuses[1] == view.statuses[1]
    moved = back.shifted(+7.0)  # its clock is 7 s behind ours
    assert moved.wall == 1007.0 and moved.statuses[1].heartbeat_wall == 1006.5


def test_a_remote_rank_idle_in_an_old_look_has_been_idle_longer_since() -> None:
    """The leader judges a look that may be seconds old (a node busy dumping a stack): a rank idle
    2 s then has not been seen to move for 2 s plus the look's age, so a rank stuck since before
    the others began to wait reads as stalled, not busy."""
    barrier = {"name": "collective", "op": "barrier", "seq": 9, "since_s": 5.5, "group": "WORLD"}
    nodes = {
        0: NodeView(0, "a", "/runs/n0", 1010.0, {0: _status(0, 1010.0, **barrier)}, {0: Activity()}),
        1: NodeView(1, "b", "/runs/n1", 1007.0, {1: _status(1, 1007.0)}, {1: Activity(True, 2.0, 0.0)}),
    }
    acts = JobView(nodes).activity(1010.0)
    assert acts[1].idle_s == 5.0 and acts[0].idle_s is None
    verdict = judge(JobView(nodes).statuses, acts, 1010.0, 2)
    assert verdict.state == "stalled" and verdict.culprits == [1] and verdict.idle_s == 5.0
    under_way = NodeView(1, "b", "", 0.0, {1: _status(1, 0.0)}, {1: Activity(pending=True)})
    back = NodeView.from_json(under_way.to_json())
    assert back.activity[1].pending, "a measurement under way travels as one"


def test_a_lost_nodes_ranks_are_gone_and_named_in_the_proof() -> None:
    now = time.time()
    barrier = {"name": "collective", "op": "barrier", "seq": 9, "since_s": 3.0, "group": "WORLD"}
    nodes = {
        0: NodeView(0, "a", "/runs/n0", now, {0: _status(0, now, **barrier)}, {0: Activity()}),
        1: NodeView(1, "b", "/runs/n1", now - 6, {1: _status(1, now - 6)}, {1: Activity()}),
    }
    job = JobView(nodes, lost={1: 6.0})
    assert job.activity(now)[1].alive is False and job.statuses[1].lost == "node 1 (b)"
    verdict = judge(job.statuses, job.activity(now), now, 2)
    assert verdict.state == "proven" and verdict.culprits == [1]
    assert "rank 1 was lost with node 1 (b)" in verdict.proof
    text = nodes_text(job.layout(), 1)
    assert "node 0 (a): rank 0  stacks: /runs/n0/hang-1/" in text and "node 1 (b): rank 1" in text
    assert "LOST" in text
