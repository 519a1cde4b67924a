"""One store, many nodes: what sharing liveness costs at 128 nodes x 8 ranks, measured here.

A real c10d TCPStore (as torchrun's rendezvous runs one) serves ``--nodes`` simulated node
watchers. Node 0 is a real ``Watcher`` (supervisor/watch.py) over a run dir whose 8 status
files this script rewrites, with a real ``Board`` (supervisor/board.py): it reads every node's
key and judges the whole job. The other nodes run in ``--procs`` processes, each doing what a
non-leading watcher does every 0.25 s: write its node key (8 ranks' statuses, the size real
ones have) and read the job's state. At ``--block-after`` seconds every rank enters collective
#N, and the job's last rank enters it as a broadcast while the others wait in a barrier: a
hang the statuses prove. Printed (and ``--json``): store operations and bytes per second, the
leader's CPU share and look time, a non-leading node's CPU share, and the verdict's latency
(from the last rank blocking to the leader's verdict, and to every node seeing it).

    python benchmarks/multinode_scale.py [--nodes 128] [--ranks-per-node 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOK_S = 0.25


def status(rank: int, world: int, node: int, now: float, events: int, blocked_at: float | None) -> dict:
    """A rank's status as probes/liveness.py writes it (recent step waits included)."""
    phase = None
    if blocked_at is not None and now >= blocked_at:
        last = rank == world - 1
        phase = {
            "name": "collective",
            "op": "broadcast" if last else "barrier",
            "seq": 500,
            "since_s": round(now - blocked_at, 3),
            "group": "WORLD",
            "group_size": world,
            "bytes": 4 if last else 0,
            "group_ranks": None,
        }
    return {
        "schema": "ddpdoctor.status/1", "rank": rank, "world_size": world, "local_rank": rank % 8,
        "node": node, "host": f"node{node:04d}", "pid": 0, "heartbeat_wall": now, "progress_wall": now,
        "exited": False, "step": events // 5, "events": events, "seq": 499, "phase": phase,
        "max_step_s": 0.25, "faulthandler": f"/scratch/runs/n{node}/stacks-rank{rank}.txt",
        "ptracer": True, "error": None, "cpu_s": 12.3, "steps_per_s": 4.0, "last_step_wall": now,
        "sync_wait_us": [[s, 800 + (s * 37 + rank) % 900] for s in range(max(0, events // 5 - 31), events // 5)],  # noqa: E501
        "last_collective": {"op": "allreduce", "seq": 499, "ago_s": 0.01},
    }  # fmt: skip


def node_sim(port: int, nodes: list[int], per_node: int, world: int, clock: Any, block: float,
             duration: float, out: Any) -> None:  # fmt: skip
    """Non-leading watchers: each look, write the node's key and read the job's state."""
    import torch.distributed as dist

    from ddpdoctor.analysis.hung.proof import Activity
    from ddpdoctor.probes.status import RankStatus
    from ddpdoctor.supervisor import board
    from ddpdoctor.supervisor.jobview import NodeView

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    out.put("ready")
    while clock.value == 0.0:
        time.sleep(0.01)
    start = clock.value
    ops = sent = received = 0
    seen: dict[int, float] = {}
    events = 0
    cpu0, t_end = time.process_time(), start + duration
    looks: list[float] = []
    while time.time() < t_end:
        tick = time.time()
        events += 1
        for node in nodes:
            ranks = range(node * per_node, (node + 1) * per_node)
            blocked = start + block
            n = events if tick < blocked else 5000
            statuses = {r: RankStatus.from_json(status(r, world, node, tick, n, blocked)) for r in ranks}
            view = NodeView(node, f"node{node:04d}", f"/scratch/runs/n{node}", tick, statuses,
                                  {r: Activity() for r in ranks})  # fmt: skip
            blob = view.to_json()
            store.set(board.node_key(node), blob)
            ops, sent = ops + 1, sent + len(blob)
            ops += 1
            if store.check([board.JOB_KEY]):
                raw = store.get(board.JOB_KEY)
                ops, received = ops + 1, received + len(raw)
                state = json.loads(raw)
                if state.get("hangs") and node not in seen:
                    seen[node] = time.time()
                    stacks = json.dumps({str(r): {"method": None, "threads": []} for r in ranks})
                    store.set(board.stacks_key(1, node), stacks)
                    ops, sent = ops + 1, sent + len(stacks)
        looks.append(time.time() - tick)
        time.sleep(max(0.0, LOOK_S - (time.time() - tick)))
    cpu = time.process_time() - cpu0
    out.put({"ops": ops, "sent": sent, "received": received, "seen": seen, "cpu_s": cpu, "nodes": len(nodes)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--procs", type=int, default=4, help="processes simulating the other nodes")
    parser.add_argument("--block-after", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch.distributed as dist

    from ddpdoctor.supervisor.board import Board
    from ddpdoctor.supervisor.layout import Layout
    from ddpdoctor.supervisor.watch import Watcher

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port, per, world = server.port, args.ranks_per_node, args.nodes * args.ranks_per_node
    ctx = mp.get_context("spawn")
    queue: Any = ctx.Queue()
    clock: Any = ctx.Value("d", 0.0)  # the common start, once every simulator is connected
    others = list(range(1, args.nodes))
    procs = [
        ctx.Process(
            target=node_sim,
            args=(port, others[i :: args.procs], per, world, clock, args.block_after, args.duration, queue),
        )
        for i in range(args.procs)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert queue.get(timeout=300) == "ready"
    start = clock.value = time.time() + 1.0
    blocked = start + args.block_after
    run_dir = Path(tempfile.mkdtemp(prefix="ddpdoctor-mn-"))
    board = Board(Layout(args.nodes, 0, per, ("127.0.0.1", port)))
    watcher = Watcher(run_dir, floor_s=30, use_pyspy=False, since_wall=0, board=board)
    looks: list[float] = []
    hang: dict[str, Any] | None = None
    while not board.shared and time.time() < start + 30:
        time.sleep(0.05)
    while time.time() < start:
        time.sleep(0.05)
    cpu0 = time.process_time()
    events = 0
    while time.time() < start + args.duration:
        tick = time.time()
        events += 1
        for r in range(per):
            st = status(r, world, 0, tick, events if tick < blocked else 5000, blocked)
            (run_dir / f"status-rank{r}.json").write_text(json.dumps(st))
        t0 = time.perf_counter()
        summary = watcher.poll_once(tick)
        looks.append(time.perf_counter() - t0)
        hang = hang or summary
        time.sleep(max(0.0, LOOK_S - (time.time() - tick)))
    leader_cpu = time.process_time() - cpu0
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    seen = [t for r in results for t in r["seen"].values()]
    total_ops = sum(r["ops"] for r in results)
    total_bytes = sum(r["sent"] + r["received"] for r in results)
    node_cpu = sum(r["cpu_s"] for r in results) / max(1, sum(r["nodes"] for r in results))
    # The leader's reads: one multi_get of every node's key per look (and a check per new node).
    leader_bytes = sum(len(server.get(f"ddpdoctor/v1/node/{n}")) for n in range(args.nodes)) * len(looks)
    figures = {
        "nodes": args.nodes,
        "ranks": world,
        "store_ops_per_s": round((total_ops + 3 * len(looks)) / args.duration, 1),
        "store_mb_per_s": round((total_bytes + leader_bytes) / args.duration / 1e6, 2),
        "node_key_kb": round(len(server.get("ddpdoctor/v1/node/1")) / 1e3, 2),
        "leader_cpu_share": round(leader_cpu / args.duration, 4),
        "leader_look_ms_p50": round(statistics.median(looks) * 1e3, 2),
        "leader_look_ms_p95": round(sorted(looks)[int(0.95 * (len(looks) - 1))] * 1e3, 2),
        "node_cpu_share": round(node_cpu / args.duration, 4),
        # declared: the leader's look that proved it; printed: after every node's stacks came in
        "verdict_s_after_block": round(hang["detected_wall"] - blocked, 2) if hang else None,
        "printed_s_after_block": round(hang["reported_wall"] - blocked, 2) if hang else None,
        "seen_by_every_node_s": round(max(seen) - blocked, 2) if len(seen) == len(others) else None,
        "nodes_that_saw_it": len(seen),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
