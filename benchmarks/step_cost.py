"""What the doctor costs a tiny training step, in µs, measured in one process by alternation.

Across processes a 1 ms step on a shared 2-core VM drifts by 1.5x between runs, far more than
the few per cent to be measured (docs/overhead.md). Here one process (world size 1, gloo)
holds copies of the same DDP model (tiny by default): one built while the doctor records (its
buckets timed by the C++ timer where it is built), one whose buckets the Python hook times, one
recorded with bucket timing off, and one built with the probes switched off (``collector.ACTIVE = None``,
DDP's own reduction), the plain step. A fifth, also without the doctor, has torch's own C++
all-reduce hook in DDP's slot (``builtin_hook``): on this model a hook's reduction is faster
than DDP's own, and the C++ timer is such a hook. Each model is checked to be timed as meant
before it is measured. Their training steps (forward, backward, SGD step) alternate in blocks,
each block's probes on or off as its model was built, and the cost is the median over rounds
of the difference of each block's median step to the plain block next to it: drift hits both
alike.

    python benchmarks/step_cost.py [--rounds 30] [--steps 200] [--model tiny|big] [--json]

``--model big`` measures overhead_job.py's 10M-parameter MLP (ten 4 MB buckets) the same way:
its ~0.1 s steps need fewer rounds and steps (``--rounds 20 --steps 5``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=("tiny", "big"), default="tiny", help="overhead_job.py's models")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    args = ap.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
    os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp(prefix="step_cost_")
    import ddpdoctor.probes as probes

    probes.install()
    import torch
    import torch.distributed as dist
    from overhead_job import build as build_model
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpdoctor.probes import collector, native
    from ddpdoctor.probes.ddp_model import state_of

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    c = collector.ACTIVE
    _, width, batch = build_model(args.model)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    def build(probes_on: bool, cpp: bool, timed: bool = True, builtin: bool = False) -> Any:
        torch.manual_seed(0)
        os.environ["DDPDOCTOR_BUCKET_TIMING"] = "on" if timed else "off"
        # Recording from the constructor on, as under `ddpdoctor run`: a model wrapped while
        # the probes were off has no state of the doctor's, so no timer and no fast path.
        collector.ACTIVE = c if probes_on else None
        ddp = DDP(build_model(args.model)[0], bucket_cap_mb=4)  # as overhead_job.py wraps it
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        if builtin:  # torch's own C++ all-reduce hook, no doctor: what a hook in DDP's slot changes
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        built, native._module = native.module(), native._module
        if not cpp:
            native._module = None  # this model's buckets: the Python hook's
        block(ddp, opt, probes_on, 3)  # the first forward registers the timer (or not)
        native._module = built
        state = state_of(ddp)
        timer = "cpp" if state and state.native else "python" if state and state.timer_registered else "none"
        want = "none" if not (probes_on and timed) else "cpp" if cpp else "python"
        if timer != want or (probes_on and state is None):
            raise SystemExit(f"step_cost: a model meant to be timed by {want!r} is timed by {timer!r}")
        return ddp, opt, probes_on

    def block(ddp: Any, opt: Any, probes_on: bool, n: int) -> float:
        collector.ACTIVE = c if probes_on else None
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    models = {"plain": build(False, False), "cpp_timer": build(True, True)}
    models["python_timer"] = build(True, False)
    models["untimed"] = build(True, False, timed=False)
    models["builtin_hook"] = build(False, False, builtin=True)
    if native.module() is None:
        del models["cpp_timer"]
    diffs: dict[str, list[float]] = {k: [] for k in models if k != "plain"}
    plains: list[float] = []
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        medians = {k: block(*models[k], args.steps) for k in order}
        plains.append(medians["plain"])
        for k in diffs:
            diffs[k].append(medians[k] - medians["plain"])
    collector.ACTIVE = c
    plain = statistics.median(plains)
    result: dict[str, Any] = {"model": args.model, "plain_step_us": round(plain, 1)}
    for k, d in diffs.items():
        q = statistics.quantiles(d, n=4)
        result[f"{k}_us"] = round(statistics.median(d), 1)
        result[f"{k}_q_us"] = [round(q[0], 1), round(q[2], 1)]
        result[f"{k}_ratio"] = round((plain + statistics.median(d)) / plain, 3)
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    sys.exit(main())
