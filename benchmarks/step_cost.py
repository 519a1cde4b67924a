"""What the doctor costs a tiny training step, in µs, measured in one process by alternation.

Across processes a 1 ms step on a shared 2-core VM drifts by 1.5x between runs, far more than
the few per cent to be measured (docs/overhead.md). Here one process (world size 1, gloo)
holds copies of the same DDP model (tiny by default): one built while the doctor records with
its defaults (``default``: bucket timing ``auto``, which times this model's buckets or not as
the doctor would; ``default_timer`` says which), one whose buckets the C++ timer times where it
is built, one whose buckets the Python hook times, one
recorded with bucket timing off, and one built with the probes switched off (``collector.ACTIVE = None``,
DDP's own reduction), the plain step. A sixth, also without the doctor, has torch's own C++
all-reduce hook in DDP's slot (``builtin_hook``): on this model a hook's reduction is faster
than DDP's own, and the C++ timer is such a hook. Each model is checked to be timed as meant
before it is measured. Their training steps (forward, backward, SGD step) alternate in blocks,
each block's probes on or off as its model was built, and the cost is the median over rounds
of the difference of each block's median step to the plain block next to it: drift hits both
alike. ``*_ratio_ci90`` is that median's 90 % bootstrap interval, as a ratio.

    python benchmarks/step_cost.py [--rounds 30] [--steps 200] [--model tiny|big] [--json]

``--model big`` measures overhead_job.py's 10M-parameter MLP (ten 4 MB buckets) the same way.
Its 60-95 ms steps vary by ±7 % from step to step, and two plain copies of it can differ by 2 %:
``--arms default,default_off --rounds 6000 --steps 1`` compares its own copy recorded and
unrecorded, one step per block, to about ±0.3 % (``ARMS``, ``CHECKS``). The weight checks are
paced as in a job of the plain step's length (``pace_fingerprints``).

``--ranks 2`` runs the same alternation as a real job: two ranks under ``ddpdoctor run --
torchrun --nproc_per_node 2``, their all-reduces over gloo between processes, each step's batch
drawn from a DataLoader with a DistributedSampler as overhead_job.py draws it (the data probe
times each wait), the writer thread and the supervisor running throughout. What it cannot
alternate is what runs whether a block records or not (the supervisor, the idle writer thread,
the wrappers' pass-through): docs/overhead.md measures those apart. Rank 0's figures are
printed.
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

ARMS = ("default", "cpp_timer", "python_timer", "untimed", "builtin_hook", "plain_twin", "default_off")
# Checks of the method, run when named: plain_twin, a second plain copy (A/A: what the method
# shows where nothing differs); default_off, the default arm's own model in blocks that record
# nothing (one copy on both sides, so what differs between copies, where their memory lies,
# drops out; but a bucket timer the default registered stays in DDP's slot there, so it says
# what recording costs only where none was). With both default and default_off,
# ``default_same_*`` compares them round by round.
CHECKS = ("plain_twin", "default_off")


def main() -> int | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", choices=("tiny", "big"), default="tiny", help="overhead_job.py's models")
    ap.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="2: a real 2-rank job (see above)")
    ap.add_argument(
        "--arms",
        default="all",
        help="comma-separated arms to alternate with the plain one (default: all); fewer arms put "
        "each block nearer its plain neighbour and leave time for more rounds",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a rank of --ranks 2
    args = ap.parse_args()
    wanted = [a for a in ARMS if a not in CHECKS] if args.arms == "all" else args.arms.split(",")
    if unknown := [a for a in wanted if a not in ARMS]:
        ap.error(f"no arm {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    if "default_off" in wanted and "default" not in wanted:
        ap.error("the arm default_off needs the arm default")
    if args.ranks == 2 and not args.child:
        return launch(sys.argv[1:], args.json)
    if not args.child:
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

    from ddpdoctor.probes import collector, commhook, native
    from ddpdoctor.probes.ddp_model import state_of

    if args.child:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    c = collector.ACTIVE
    if c is None:
        raise SystemExit("step_cost: the probes are not recording in this process")
    _, width, batch = build_model(args.model)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    draw = batches(batch, width) if args.child else None

    chose: dict[str, str] = {}  # what ``auto`` chose for the default arm

    def build(probes_on: bool, cpp: bool, timing: str = "on", builtin: bool = False) -> Any:
        torch.manual_seed(0)
        os.environ["DDPDOCTOR_BUCKET_TIMING"] = timing
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
        # The first forward registers the timer (or not); ``auto`` decides after a few steps.
        block(ddp, opt, probes_on, 3 if timing != "auto" else 3 + commhook.DECIDE_AFTER + 2)
        native._module = built
        state = state_of(ddp)
        timer = "cpp" if state and state.native else "python" if state and state.timer_registered else "none"
        want = "none" if not (probes_on and timing == "on") else "cpp" if cpp else "python"
        if timing == "auto":
            want = chose["default_timer"] = timer
            if timer == "none" and not (state and state.untimed):
                raise SystemExit("step_cost: the default arm's automatic choice was never made")
        if timer != want or (probes_on and state is None):
            raise SystemExit(f"step_cost: a model meant to be timed by {want!r} is timed by {timer!r}")
        return ddp, opt, probes_on

    def block(ddp: Any, opt: Any, probes_on: bool, n: int, check: bool = False) -> float:
        """The median of ``n`` steps, in µs. ``check``: the block must record nothing (the
        default arm's copy unrecorded, whose buckets nothing times: else the writer thread moves
        the C++ timer's notes into the ring whenever it flushes)."""
        collector.ACTIVE = c if probes_on else None
        head = c.writer.ring.seqs.head if c.writer.ring is not None else 0
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            xs, ys = next(draw) if draw is not None else (x, y)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(xs), ys).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        if check and c.writer.ring is not None and c.writer.ring.seqs.head != head:
            raise SystemExit("step_cost: a block meant to record nothing recorded events")
        return statistics.median(times) * 1e6

    arms: dict[str, Any] = {
        "default": lambda: build(True, True, timing="auto"),
        "cpp_timer": lambda: build(True, True),
        "python_timer": lambda: build(True, False),
        "untimed": lambda: build(True, False, timing="off"),
        "builtin_hook": lambda: build(False, False, builtin=True),
        "plain_twin": lambda: build(False, False),
    }
    if native.module() is None:  # where the C++ timer is not built
        del arms["cpp_timer"]
        wanted = [a for a in wanted if a != "cpp_timer"]
    models = {"plain": build(False, False), **{a: arms[a]() for a in wanted if a in arms}}
    if "default_off" in wanted:
        if chose["default_timer"] != "none":  # its timer would go on timing, and its notes reach the ring
            raise SystemExit(
                f"step_cost: the default arm's buckets are timed ({chose['default_timer']}): its copy"
                " unrecorded would still time them, so default_off is for a model the defaults leave untimed"
            )
        models["default_off"] = (*models["default"][:2], False)
    paced = pace_fingerprints(block(*models["plain"], 5) * 1e3)
    diffs: dict[str, list[float]] = {k: [] for k in models if k != "plain"}
    plains: list[float] = []
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        medians = {k: block(*models[k], args.steps, check=k == "default_off") for k in order}
        plains.append(medians["plain"])
        for k in diffs:
            diffs[k].append(medians[k] - medians["plain"])
    collector.ACTIVE = c
    plain = statistics.median(plains)
    result: dict[str, Any] = {"model": args.model, "plain_step_us": round(plain, 1), **chose, **paced}
    if "default_off" in diffs:  # recorded against unrecorded on the one copy
        diffs["default_same"] = [a - b for a, b in zip(diffs["default"], diffs["default_off"], strict=True)]
    for k, d in diffs.items():
        q = statistics.quantiles(d, n=4)
        result[f"{k}_us"] = round(statistics.median(d), 1)
        result[f"{k}_q_us"] = [round(q[0], 1), round(q[2], 1)]
        result[f"{k}_ratio"] = round((plain + statistics.median(d)) / plain, 3)
        lo, hi = median_interval(d)
        result[f"{k}_ratio_ci90"] = [round((plain + lo) / plain, 3), round((plain + hi) / plain, 3)]
    result["ranks"] = dist.get_world_size()
    show = dist.get_rank() == 0
    dist.destroy_process_group()
    if not show:
        return None
    show_result(result, args.json or args.child)  # a rank's result goes to the launcher whole
    return None


def pace_fingerprints(step_ns: float) -> dict[str, Any]:
    """Check the weights as often as the doctor would in a job of ``step_ns`` steps, and say how
    often and at what cost a check (``fingerprint_*``). The doctor's rule divides the time
    between two checks by the recorded steps between them; here the unrecorded blocks between
    recorded ones would count, and the checks (a pass over the weights) would come two or three
    times as often as in the job (docs/overhead.md, twenty-ninth round)."""
    from ddpdoctor.probes import fingerprint

    fp = fingerprint.ACTIVE
    if fp is None or fp.fixed is not None or not fp.costs:
        return {}
    fp.fix(fingerprint.interval_for(fp.cost(), step_ns))
    return {"fingerprint_interval": fp.interval, "fingerprint_check_us": round(fp.cost() / 1e3, 1)}


def show_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
        return
    for key, value in result.items():
        print(f"{key}: {value}")


def median_interval(diffs: list[float], draws: int = 1000) -> tuple[float, float]:
    """The 90 % bootstrap interval of the differences' median (seeded: the same rounds give the
    same interval): how well the rounds pin the cost down, which their quartiles do not say."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return meds[draws // 20], meds[draws - 1 - draws // 20]


def batches(batch: int, width: int) -> Any:
    """Endless batches from a DataLoader over a DistributedSampler, as overhead_job.py reads
    them: a pass of 20,000 batches per rank, so a new pass (its iterator and the data probe's
    description of the loader) is rare next to the steps timed."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    n = batch * 20_000 * 2
    data = TensorDataset(torch.randn(n, width), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True))
    while True:
        yield from loader


def launch(argv: list[str], quiet: bool) -> int:
    """``--ranks 2``: this script as both ranks of a job under ``ddpdoctor run``; rank 0's result
    is shown, the doctor's run dir named, and the job's exit status returned."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    out = tempfile.mkdtemp(prefix="step_cost_run_")
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", out, "--", *job, __file__, *argv, "--child"]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]  # rank 0's result
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        return done.returncode or 1
    show_result(json.loads(lines[-1]), quiet)
    print(f"run dir: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
