"""What each layer of the collective probe costs around a real gloo call, in one process.

``overhead.py``'s ``per_event_cpu_us`` is one figure: recorded minus torch's own call. Here the
same 1-element ``all_reduce`` (world size 1, the calling thread's CPU time) runs in four modes,
each against torch's own call right after it, in a shuffled order per round:

- ``off``: the probes switched off (``collector.ACTIVE = None``): the Python wrapper, the C
  object and one lookup;
- ``disabled``: the collective probe alone switched off (``"collectives"`` in ``c.disabled``);
- ``recorded``: the whole probe;
- ``null``: torch's call against itself, the control: how far apart two equal figures land.

Each block is checked to record as its mode means (every call, or none). Each figure is the
median over rounds of the difference; ``faults_per_call`` is the minor page
faults the recorded calls took (``getrusage``), which the ring's first lap used to add
(docs/overhead.md, twenty-second round).

    python benchmarks/per_event_layers.py [--rounds 40] [--calls 4000] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time
from typing import Any

from per_event_gap import doctor_world

MODES = ("recorded", "disabled", "off", "null")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=4000, help="calls per timed block")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()
    result = measure(args.rounds, args.calls)
    if args.json:
        print(json.dumps(result))
        return
    for mode in MODES:
        print(f"{mode:>9}: {result[mode + '_us']:+.2f} µs per call")
    print(f"page faults per recorded call: {result['faults_per_call']:.4f}")


def measure(rounds: int, calls: int) -> dict[str, Any]:
    doctor_world()
    import torch
    import torch.distributed as dist

    from ddpdoctor.probes import collector
    from ddpdoctor.probes.patching import original

    t, c = torch.ones(1), collector.ACTIVE
    recorded, plain = dist.all_reduce, original(dist.all_reduce)
    faults = [0, 0]

    def block(mode: str | None) -> float:
        f = plain if mode in (None, "null") else recorded
        if mode == "off":
            collector.ACTIVE = None
        elif mode == "disabled":
            c.disabled.add("collectives")
        events = c.events
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
        for _ in range(calls):
            f(t)
        took = (time.thread_time() - t0) / calls * 1e6
        made, meant = c.events - events, calls if mode == "recorded" else 0
        if made != meant:  # a mode that does not do what it says measures nothing
            raise SystemExit(f"per_event_layers: {mode or 'plain'} recorded {made} events, not {meant}")
        if mode == "recorded":
            faults[0] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0
            faults[1] += calls
        collector.ACTIVE = c
        c.disabled.discard("collectives")
        return took

    for mode in MODES:  # warm: the call site learnt, torch's lazy paths taken
        block(mode)
    faults[:] = [0, 0]
    diffs: dict[str, list[float]] = {m: [] for m in MODES}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            diffs[mode].append(block(mode) - block(None))
    dist.destroy_process_group()
    out: dict[str, Any] = {f"{m}_us": round(statistics.median(v), 3) for m, v in diffs.items()}
    out["faults_per_call"] = round(faults[0] / max(1, faults[1]), 5)
    return out


if __name__ == "__main__":
    main()
