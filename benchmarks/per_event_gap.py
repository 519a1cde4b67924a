"""What a recorded collective costs when the calls are not back to back.

``overhead.py``'s ``per_event_us`` times a 1-element gloo ``all_reduce`` in a tight loop,
recorded minus plain. In such a loop gloo's worker thread may still be awake when the next call
arrives, and the probe's work between calls might let it sleep first, so that the recorded call
pays a wake-up that is not the probe's. A training loop puts compute between its collectives.
So here each call is preceded by a busy wait of ``gap`` µs (in plain and recorded calls alike),
and the figure is recorded minus plain at each gap: wall time and the calling thread's CPU
time, medians over alternated rounds, in one process (world size 1). On 2026-11-29 the gaps
did not take the extra cost away (docs/overhead.md, fourteenth round).

    python benchmarks/per_event_gap.py [--gaps 0 1 2 4 20 100] [--rounds 15] [--calls 3000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def doctor_world() -> None:
    """This process as a one-rank gloo job under the doctor (its probes installed, a run
    directory of its own), on one torch thread: the setting of every per-event figure."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp()
    import ddpdoctor.probes as probes

    probes.install()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gaps", type=float, nargs="+", default=[0, 1, 2, 4, 20, 100], help="µs before each call"
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()
    doctor_world()
    import torch
    import torch.distributed as dist

    from ddpdoctor.probes.patching import original

    tensor = torch.ones(1)
    perf = time.perf_counter

    def spaced(f: Callable[[Any], Any], gap_us: float) -> Callable[[Any], Any]:
        if not gap_us:
            return f
        gap = gap_us * 1e-6

        def call(t: Any) -> Any:
            end = perf() + gap
            while perf() < end:
                pass
            return f(t)

        return call

    def bench(f: Callable[[Any], Any], clock: Callable[[], float]) -> float:
        t0 = clock()
        for _ in range(args.calls):
            f(tensor)
        return (clock() - t0) / args.calls * 1e6

    modes = {
        (g, m): spaced(f, g)
        for g in args.gaps
        for m, f in (("plain", original(dist.all_reduce)), ("rec", dist.all_reduce))
    }
    wall: dict[Any, list[float]] = {k: [] for k in modes}
    cpu: dict[Any, list[float]] = {k: [] for k in modes}
    for _ in range(args.rounds):
        for key, f in modes.items():
            wall[key].append(bench(f, perf))
            cpu[key].append(bench(f, time.thread_time))
    result = {"calls": args.calls, "rounds": args.rounds, "gaps": []}
    for g in args.gaps:
        pw, rw = statistics.median(wall[g, "plain"]), statistics.median(wall[g, "rec"])
        pc, rc = statistics.median(cpu[g, "plain"]), statistics.median(cpu[g, "rec"])
        result["gaps"].append(
            {"gap_us": g, "plain_us": round(pw, 2), "recorded_minus_plain_us": round(rw - pw, 2),
             "plain_cpu_us": round(pc, 2), "recorded_minus_plain_cpu_us": round(rc - pc, 2)}
        )  # fmt: skip
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'gap µs':>7} {'plain µs':>9} {'rec-plain':>10} {'plain CPU':>10} {'rec-plain CPU':>14}")
    for row in result["gaps"]:
        print(
            f"{row['gap_us']:>7g} {row['plain_us']:>9.2f} {row['recorded_minus_plain_us']:>10.2f} "
            f"{row['plain_cpu_us']:>10.2f} {row['recorded_minus_plain_cpu_us']:>14.2f}"
        )


if __name__ == "__main__":
    main()
