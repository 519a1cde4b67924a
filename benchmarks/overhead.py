"""How much slower is a DDP job under ddpdoctor? Interleaved A/B, within one run and across runs.

Within one run (issue 25's figure): ``step_cost.py --ranks 2`` runs a 2-rank gloo job under
``ddpdoctor run`` whose blocks of steps alternate between a model the doctor records with its
defaults and the same model unrecorded, for a tiny model and a compute-bound one (~10M
parameters); the host's drift falls on both arms alike.

Across runs: the same 2-rank job run plain, under `ddpdoctor run`, with torch.profiler (CPU
activities) and, with ``--python-hook``, with torch's own Python ``allreduce_hook`` (what any
comm hook written in Python costs), with ``--no-buckets`` under the doctor with
``DDPDOCTOR_BUCKET_TIMING=off``, with ``--timed`` with ``=on`` (every bucket timed: the default,
``auto``, leaves a step that cannot carry it), and with ``--python-timer`` under the doctor
timing buckets with its Python hook (as where its C++ timer is not built), in interleaved order,
each mode's median step time relative to plain. This also counts what runs whether a step
records or not (the supervisor, the writer thread, start-up), but its trials spread by about
±15 % on a shared 2-core host (docs/overhead.md). Also reports the trace size per rank per
step, and the per-event cost of a recorded collective measured in-process.

    python benchmarks/overhead.py [--trials 5] [--steps-big 30] [--steps-tiny 400] [--json]

``--json`` prints one line: per_event_us (median, with its interval), probe_us, emit_us per kind,
bucket_us and python_hook_bucket_us (see ``per_event_cost_us``); ``tiny_ratio`` and
``big_ratio`` (within one run: recorded / plain median step), ``*_ratio_ci90`` (its 90 %
interval), ``*_ratio_against`` (a plain copy of the model, or the recorded one unrecorded),
``*_target_met`` (true, false, or null when the interval straddles issue 25's target),
``*_default_timer`` (whether the defaults timed the buckets); ``*_runs_ratio`` (across
runs: doctor / plain median step), each trial's ratio, ``*_runs_ratio_ci95`` and
``*_runs_target_met`` the same for those trials, ``*_doctor_cpu_ratio`` (rank 0's CPU per step,
all its threads, doctor / plain: the recording's CPU, which other jobs on a shared machine
disturb less than wall time), the trace size and the writer thread's duty cycle
(``*_writer_duty``: its CPU seconds per second recorded, in rank 0); ``*_events_per_step``
(rank 0's) and ``*_accounted_ratio``, the cost by its parts (``accounted_ratio``): resolved
where the A/B figures are not, but a model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddpdoctor import _env
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import read_trace

HERE = Path(__file__).resolve().parent
# gloo in torch 2.13 now and then aborts a rank at interpreter exit, after the job's work is
# done, with or without ddpdoctor (tests/conftest.py says more): a run that ends so is rerun once.
EXIT_ABORT = "terminate called without an active exception"
JOB = HERE / "overhead_job.py"
TARGETS = {"tiny": 1.03, "big": 1.005}  # issue 25: doctor / plain median step
# Two-sided 95 % quantiles of Student's t by degrees of freedom (trials - 1); 1.96 beyond.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
_T95.update({10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042})


def ratio_interval(doctor: list[float], plain: list[float]) -> tuple[float, float] | None:
    """95 % interval of the doctor / plain step-time ratio from paired trials (each pair run
    back to back, so the machine's drift is shared): Student's t on the log ratios. None with
    fewer than two pairs."""
    logs = [math.log(d / p) for d, p in zip(doctor, plain, strict=True)]
    if len(logs) < 2:
        return None
    df = len(logs) - 1  # the nearest tabled df at or below it: the wider interval
    t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def verdict(interval: tuple[float, float] | None, target: float) -> bool | None:
    """True when the whole interval is within the target, False when it is all above, None
    (unresolved) when the trials' spread cannot tell."""
    if interval is None:
        return None
    return True if interval[1] <= target else False if interval[0] > target else None


def run_once(mode: str, kind: str, steps: int, workdir: Path) -> tuple[float, float, int, float, float]:
    """(median step seconds, rank 0's CPU seconds per step (all its threads), trace bytes per
    rank per step or 0, the writer thread's duty cycle in rank 0: its CPU seconds per second
    recorded, or 0; the events rank 0 recorded per step, or 0)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(JOB),
        kind,
        str(steps),
    ]
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    if mode == "doctor_no_buckets":  # the doctor with DDP's own C++ reduction left alone
        env[_env.BUCKET_TIMING] = "off"
    if mode == "doctor_on":  # every bucket timed, whatever it costs the step
        env[_env.BUCKET_TIMING] = "on"
    if mode == "doctor_python_timer":  # buckets timed by the Python hook: no C++ timer built there
        env[_env.CACHE] = str(workdir / "no-native-timer")
        env[_env.BUCKET_TIMING] = "on"
    if mode.startswith("doctor"):
        cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *job]
    elif mode in ("profiler", "python_hook"):
        cmd = job + ["--" + mode.replace("_", "-")]
    else:
        cmd = job
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=600)
    if proc.returncode != 0 and EXIT_ABORT in proc.stderr:  # not ours: see EXIT_ABORT
        print(f"{mode}/{kind}: a rank aborted at exit ({EXIT_ABORT!r}); once more", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}/{kind} failed:\n{proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    job_result = json.loads(line)
    median, cpu = job_result["median_s"], job_result["cpu_per_step_s"]
    trace_bytes, duty, events = 0, 0.0, 0.0
    if mode.startswith("doctor"):
        trace = next(run_dir.glob("trace-rank0.*"))
        trace_bytes = trace.stat().st_size // (steps + 5)
        recorded = read_trace(trace)
        end = recorded.meta.get(schema.END, [(0, 0, {})])[0][2]
        duty = end.get("writer_cpu_s", 0.0) / max(end.get("wall_s", 0.0), 1e-9)
        events = sum(len(e) for e in recorded.events.values()) / (steps + 5)  # the job's warm-up too
    return median, cpu, trace_bytes, duty, events


def accounted_ratio(events_per_step: float, per_event_cpu_us: float, duty: float, step_us: float) -> float:
    """The doctor's cost on a step by its parts, where an A/B cannot resolve it: each event it
    records at the training thread's measured CPU cost per event (a recorded gloo all_reduce
    minus plain, after a blocking call: cold caches), and its writer thread's CPU share, all
    of it taken from the training (a host whose cores the ranks fill). A model, not a
    measurement: what it leaves out (cache pollution, the supervisor's own process) the A/B
    figures hold."""
    return 1.0 + (events_per_step * per_event_cpu_us + duty * step_us) / step_us


# The big step's 60-95 ms varies by ±7 % from step to step here: 6,000 one-step rounds pin its
# median to about ±0.3 % (half an hour; 3,000 pinned ±0.4 %, wide enough to straddle 1.005).
# Its blocks alternate the default arm's own copy recorded and unrecorded (``default_off``):
# two plain copies of the model differed by up to 2 % within one run (docs/overhead.md,
# twenty-ninth round).
IN_RUN = {
    "tiny": ["--rounds", "300", "--steps", "40"],
    "big": ["--arms", "default,default_off", "--rounds", "6000", "--steps", "1"],
}


def in_run(kind: str) -> dict[str, Any]:
    """``step_cost.py --ranks 2``: one real 2-rank job under ``ddpdoctor run`` whose blocks of
    steps alternate between a model the doctor records with its defaults and the same model
    unrecorded, so the host's drift falls on both arms (``IN_RUN``: its rounds and steps)."""
    cmd = [sys.executable, str(HERE / "step_cost.py"), "--ranks", "2", "--json", "--model", kind]
    cmd += IN_RUN[kind]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"step_cost.py --ranks 2 --model {kind} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_as_script(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` from a file, as a training script runs: code given with ``python -c`` has
    no file (``<string>``), so the probes take its lines for a library's, not the user's."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "per_event.py"
        script.write_text(code)
        return subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
        )


# Recorded minus plain per call, as the per-event figures take it: both timed in blocks of
# ``block`` calls, ``pairs`` blocks of each, each pair in random order; the median of the pairs'
# differences, its 90 % bootstrap interval, the mean and the quartiles. The gloo call drifts by
# microseconds over seconds: in 21 pairs of 5,000-call blocks that drift was the figure (the
# differences' quartiles -7 to +17 µs on 2026-12-06, the median moving 1.8-3.8 µs between runs).
# Short blocks in many pairs put the drift into both arms, and the interval says how well the
# median is known. A cost paid once in hundreds of calls would fall in few blocks and hide from
# the median: the mean is given beside it.
PAIRED_BLOCKS = """
import random as _random, statistics as _statistics
def paired_blocks(rec, plain, arg, clock, pairs=600, block=100, seed=0):
    rng = _random.Random(seed)
    def run(f):
        t0 = clock()
        for _ in range(block):
            f(arg)
        return (clock() - t0) / block * 1e6
    run(rec), run(plain)
    d = []
    for _ in range(pairs):
        if rng.random() < 0.5:
            a = run(rec)
            d.append(a - run(plain))
        else:
            b = run(plain)
            d.append(run(rec) - b)
    boot = sorted(_statistics.median(rng.choices(d, k=len(d))) for _ in range(200))
    q = _statistics.quantiles(d, n=4)
    return {"median": _statistics.median(d), "ci": [boot[9], boot[189]], "mean": _statistics.fmean(d),
            "q1": q[0], "q3": q[2]}
"""


def per_event_cost_us(n: int = 5000, pairs: int = 21) -> dict[str, Any]:
    """The training thread's cost per event, in-process, each a median of alternated pairs:

    - ``per_event_us``: a 1-element gloo ``all_reduce`` recorded minus the original, taken as
      ``PAIRED_BLOCKS`` says, with its 90 % interval (``per_event_ci_us``), mean and quartiles;
      ``per_event_cpu_us`` and its interval and mean the same in the thread's own CPU time,
      which other processes on a shared machine disturb less;
    - ``probe_us``: the same probe around a collective that does nothing: the probe's own cost,
      without gloo's noise;
    - ``emit_us``: the recording call every other probe ends in (``Collector.emit``) for the
      kinds a DDP step records (forward, backward, the comm hook's bucket all-reduce);
    - ``forward_us``: the whole DDP forward probe (step counting, the group's sequence number,
      the call site, the live status, the record) around a small model's training forward,
      recorded minus not (thread CPU, ``PAIRED_BLOCKS``' median and interval, 300 pairs): a hook
      event's cost among the forward's own Python,
      where caches are cold, not a loop of recording calls alone; ``forward_eval_us`` the same
      under ``torch.no_grad()``. The model is made under the doctor, as a user's is: one made
      without it is one the probe never saw, and takes the Python path (about 8 µs; every
      ``forward_us`` before 2026-11-29's twentieth session timed that path by mistake). Where
      the C module is built, a forward the C probe did not record stops the benchmark;
    - ``bucket_us``: a backward of 48 one-bucket layers, per bucket, under the doctor's bucket
      timer (the C++ one where it is built) minus DDP's built-in C++ reduction, next to
      ``python_hook_bucket_us``, the
      same for torch's own Python ``allreduce_hook``: what any comm hook written in Python
      costs (a GIL trip per bucket and one for its completion)."""
    code = f"""{PAIRED_BLOCKS}
import os, time, json, tempfile, statistics
os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
os.environ["DDPDOCTOR_RUN_DIR"] = tempfile.mkdtemp()
import ddpdoctor.probes as probes; probes.install()
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from ddpdoctor.probes import collector, collectives, data, ddp
from ddpdoctor.probes.patching import original
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
t = torch.ones(1)
def bench(f, *a, clock=time.perf_counter):
    t0 = clock()
    for _ in range({n}):
        f(*a)
    return (clock() - t0) / {n} * 1e6
rec, plain = dist.all_reduce, original(dist.all_reduce)
wall = paired_blocks(rec, plain, t, time.perf_counter)
cpu = paired_blocks(rec, plain, t, time.thread_time)
def nothing(tensor, op=None, group=None, async_op=False):
    return None
probed = collectives._collective_wrapper("all_reduce")(nothing)
probe = statistics.median(bench(probed, t) - bench(nothing, t) for _ in range({pairs}))
c = collector.ACTIVE
emit = {{k: statistics.median(bench(c.emit, k, 1, 2, *f) for _ in range(5))
        for k, f in (("forward", (1, 1, 5, 0)), ("backward", (100,)), ("allreduce", (0, 4096, 7)))}}
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(48)])
doctor = DDP(model(), bucket_cap_mb=0.004)
collector.ACTIVE = None
builtin = DDP(model(), bucket_cap_mb=0.004)
python_hook = DDP(model(), bucket_cap_mb=0.004)
python_hook.register_comm_hook(None, allreduce_hook)
x = torch.randn(4, 32)
def backward(m, steps=40):
    collector.ACTIVE = c if m is doctor else None
    t0 = time.perf_counter()
    for _ in range(steps):
        m(x).sum().backward()
    return (time.perf_counter() - t0) / steps * 1e6 / 48
for m in (doctor, builtin, python_hook) * 3:
    backward(m)
bucket = statistics.median(backward(doctor) - backward(builtin) for _ in range(9))
python = statistics.median(backward(python_hook) - backward(builtin) for _ in range(9))
collector.ACTIVE = c  # a model made under the doctor, as a user's is: the probe knows it
small = DDP(torch.nn.Linear(4, 4))  # the whole DDP forward probe, in the context of a forward
xs = torch.randn(2, 4)
def on(x):
    collector.ACTIVE = c
    small(x)
def off(x):
    collector.ACTIVE = None
    small(x)
in_c = ddp.IN_C.get("forward")
forward = {{}}
for grad in (True, False):
    with torch.set_grad_enabled(grad):
        on(xs), off(xs)  # the model's first forward of each mode learns it
        before = in_c.recorded if in_c is not None else 0
        forward[grad] = paired_blocks(on, off, xs, time.thread_time, pairs=300)
    # a training forward at a sampled step counts its inputs on the Python path (probes/data.py)
    counted = 301 * 100 // data.INPUT_EVERY + data.INPUT_SAMPLES + 1 if grad else 0
    if in_c is not None and in_c.recorded - before < 301 * 100 - counted:
        raise SystemExit(f"forward_us timed the Python path: {{in_c.recorded - before}} of 30100 in C")
collector.ACTIVE = c
figures = {{f"per_event_{{k}}_us": v for k, v in wall.items() if k != "median"}}
figures.update({{f"per_event_cpu_{{k}}_us": v for k, v in cpu.items() if k in ("ci", "mean")}})
print(json.dumps({{"per_event_us": wall["median"], "per_event_cpu_us": cpu["median"], **figures,
                  "probe_us": probe, "emit_us": emit,
                  "bucket_us": bucket, "python_hook_bucket_us": python,
                  "forward_us": forward[True]["median"], "forward_ci_us": forward[True]["ci"],
                  "forward_eval_us": forward[False]["median"], "forward_eval_ci_us": forward[False]["ci"]}}))
"""
    out = run_as_script(code)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps-big", type=int, default=30)
    parser.add_argument("--steps-tiny", type=int, default=400)
    parser.add_argument("--json", action="store_true", help="print only the one-line JSON result")
    parser.add_argument("--no-profiler", action="store_true", help="leave out the torch.profiler mode")
    parser.add_argument(
        "--python-hook", action="store_true", help="add a mode with torch's own Python allreduce_hook"
    )
    parser.add_argument(
        "--no-buckets", action="store_true", help="add the doctor with DDPDOCTOR_BUCKET_TIMING=off"
    )
    parser.add_argument(
        "--python-timer", action="store_true", help="add the doctor timing buckets with its Python hook"
    )
    parser.add_argument("--timed", action="store_true", help="add the doctor with DDPDOCTOR_BUCKET_TIMING=on")
    parser.add_argument("--no-in-run", action="store_true", help="leave out the one-run alternation")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ddpdoctor-overhead-"))
    modes = ["plain", "doctor"] + ([] if args.no_profiler else ["profiler"])
    modes += ["python_hook"] if args.python_hook else []
    modes += ["doctor_no_buckets"] if args.no_buckets else []
    modes += ["doctor_python_timer"] if args.python_timer else []
    modes += ["doctor_on"] if args.timed else []
    say = (lambda *a, **k: None) if args.json else print
    result: dict[str, object] = dict(per_event_cost_us())
    say(f"per-event cost: {json.dumps(result)}")
    for kind in ("tiny", "big") if not args.no_in_run else ():
        arms = in_run(kind)
        # one copy recorded and not, where that is all the default changed (no bucket timer,
        # which would stay in DDP's slot in its unrecorded blocks); else against a plain copy
        same = "default_same_ratio" in arms and arms["default_timer"] == "none"
        arm = "default_same" if same else "default"
        ci = arms[f"{arm}_ratio_ci90"]
        met = verdict((ci[0], ci[1]), TARGETS[kind])
        result[f"{kind}_ratio"], result[f"{kind}_ratio_ci90"] = arms[f"{arm}_ratio"], ci
        result[f"{kind}_ratio_against"] = "its own copy unrecorded" if same else "a plain copy"
        result[f"{kind}_target_met"], result[f"{kind}_default_timer"] = met, arms["default_timer"]
        result[f"{kind}_plain_step_us"] = arms["plain_step_us"]
        said = {True: "met", False: "not met", None: "unresolved"}[met]
        say(
            f"\n{kind} model, one 2-rank run under the doctor, its blocks alternating recorded and"
            f" plain: {arms[f'{arm}_ratio']:.3f}x (90 % interval {ci[0]:.3f}-{ci[1]:.3f}, buckets"
            f" timed: {arms['default_timer']}), target {TARGETS[kind]}x {said}"
        )
    for kind, steps in (("big", args.steps_big), ("tiny", args.steps_tiny)):
        results: dict[str, list[float]] = {m: [] for m in modes}
        cpus: dict[str, list[float]] = {m: [] for m in modes}
        sizes: list[int] = []
        duties: list[float] = []
        counts: list[float] = []
        t0 = time.time()
        for trial in range(args.trials):
            order = modes[:]
            random.Random(trial).shuffle(order)
            for mode in order:
                median, cpu, size, duty, events = run_once(mode, kind, steps, workdir)
                results[mode].append(median)
                cpus[mode].append(cpu)
                if mode == "doctor":
                    sizes.append(size)
                    duties.append(duty)
                    counts.append(events)
        base = statistics.median(results["plain"])
        say(f"\n{kind} model, {steps} steps x {args.trials} interleaved trials ({time.time() - t0:.0f} s):")
        for mode in modes:
            med = statistics.median(results[mode])
            say(
                f"  {mode:9s} median step {med * 1e3:8.2f} ms   ratio to plain {med / base:6.3f}"
                f"   trials: {', '.join(f'{v * 1e3:.2f}' for v in results[mode])}"
            )
        cpu_base = statistics.median(cpus["plain"])
        cpu_ratios = {m: statistics.median(cpus[m]) / cpu_base for m in modes}
        shown = ", ".join(f"{m} {r:.3f}" for m, r in cpu_ratios.items())
        say(f"  rank 0 CPU per step, ratio to plain: {shown}")
        say(f"  trace: {statistics.median(sizes)} bytes per rank per step")
        say(f"  writer thread: {statistics.median(duties):.2%} of one core (rank 0, median)")
        ratios = sorted(d / p for d, p in zip(results["doctor"], results["plain"], strict=True))
        interval = ratio_interval(results["doctor"], results["plain"])
        met = verdict(interval, TARGETS[kind])
        if interval is not None:
            said = {True: "met", False: "not met", None: "unresolved: the trials spread too much"}[met]
            say(
                f"  doctor / plain, 95 % interval {interval[0]:.3f}-{interval[1]:.3f}: "
                f"target {TARGETS[kind]}x {said}"
            )
        result[f"{kind}_runs_ratio"] = round(statistics.median(results["doctor"]) / base, 4)
        result[f"{kind}_runs_ratio_ci95"] = [round(v, 4) for v in interval] if interval else None
        result[f"{kind}_runs_target_met"] = met
        for mode in modes[2:]:
            result[f"{kind}_{mode}_ratio"] = round(statistics.median(results[mode]) / base, 4)
        for mode in modes[1:]:
            result[f"{kind}_{mode}_cpu_ratio"] = round(cpu_ratios[mode], 4)
        result[f"{kind}_trial_ratios"] = [round(r, 3) for r in ratios]
        result[f"{kind}_trace_bytes_per_rank_step"] = statistics.median(sizes)
        result[f"{kind}_writer_duty"] = round(statistics.median(duties), 5)
        result[f"{kind}_events_per_step"] = round(statistics.median(counts), 2)
        step_us = float(result.get(f"{kind}_plain_step_us") or base * 1e6)  # in-run plain, where run
        accounted = accounted_ratio(
            statistics.median(counts), float(result["per_event_cpu_us"]), statistics.median(duties), step_us
        )
        result[f"{kind}_accounted_ratio"] = round(accounted, 4)
        say(
            f"  by its parts: {statistics.median(counts):.1f} events per step x"
            f" {result['per_event_cpu_us']:.2f} µs + the writer's {statistics.median(duties):.2%}"
            f" of a {step_us / 1e3:.2f} ms step = {accounted:.4f}x (a model: see accounted_ratio)"
        )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
