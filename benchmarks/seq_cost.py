"""What reading a process group's collective sequence number costs the training thread, next
to a blocking collective: torch binds ``_get_sequence_number_for_group`` with the GIL released
(``py::call_guard<py::gil_scoped_release>``), and every probe that records a sync point reads it.

One process, a 1-rank gloo group, no ddpdoctor: a 1-element ``all_reduce`` alone, with the read
just before it, and just after it; and the read alone in a loop. Thread CPU per call, the median
of alternated rounds.

    python benchmarks/seq_cost.py [--rounds 61] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=61)  # fewer left noise of microseconds
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group
    t = torch.ones(1)

    def alone() -> None:
        dist.all_reduce(t)

    def before() -> None:
        seq()
        dist.all_reduce(t)

    def after() -> None:
        dist.all_reduce(t)
        seq()

    def per_call(f) -> float:  # type: ignore[no-untyped-def]
        t0 = time.thread_time()
        for _ in range(args.calls):
            f()
        return (time.thread_time() - t0) / args.calls * 1e6

    for _ in range(3):
        per_call(alone), per_call(before), per_call(after)
    result = {
        "read_before_us": statistics.median(per_call(before) - per_call(alone) for _ in range(args.rounds)),
        "read_after_us": statistics.median(per_call(after) - per_call(alone) for _ in range(args.rounds)),
        "read_in_loop_us": statistics.median(per_call(seq) for _ in range(args.rounds)),
        "all_reduce_us": statistics.median(per_call(alone) for _ in range(args.rounds)),
    }
    dist.destroy_process_group()
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
