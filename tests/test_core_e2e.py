"""The core promise, end to end: real torchrun / mp.spawn jobs under `ddpdoctor run`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import JOBS, diagnose_json, job_env, read_lines, run_doctor, run_plain, torchrun

pytestmark = pytest.mark.e2e


def counts(run_dir: Path, rank: int) -> dict[str, int]:
    """Events of each kind in one rank's trace, plus barriers and training forwards."""
    out: dict[str, int] = {}
    for rec in read_lines(run_dir / f"trace-rank{rank}.jsonl"):
        out[rec[0]] = out.get(rec[0], 0) + 1
        if rec[0] == "collective" and rec[4] == "barrier":
            out["barrier"] = out.get("barrier", 0) + 1
        if rec[0] == "forward" and rec[4] == 1:
            out["train_forward"] = out.get("train_forward", 0) + 1
    return out


def test_torchrun_job_counts_every_sync_point(tmp_path: Path) -> None:
    # every bucket timed: auto may leave this job's 2 MB of gradients untimed, rank by rank
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"), DDPDOCTOR_BUCKET_TIMING="on")
    assert job.returncode == 0, job.stderr
    # The job's own output is untouched; ours is one banner line and the summary, on stderr.
    lines = job.stdout.splitlines()
    assert [line.rsplit(" ", 1)[0] for line in lines] == [f"epoch {e} correct" for e in range(3)]
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    assert job.stderr.count("ddpdoctor 0.1.0: recording") == 1
    for rank in (0, 1):
        c = counts(job.run_dir, rank)
        assert c["train_forward"] == 24  # 3 epochs x 8 batches
        assert c["forward"] == 30  # + 3 epochs x 2 eval batches under no_grad
        assert c["backward"] == 24
        # DDP reduces step 0 in its construction-time layout (1 bucket), then rebuilds (3).
        assert c["allreduce"] == 1 + 23 * 3
        assert c["barrier"] == 4
        assert c["collective"] == 4 + 3  # barriers + one all_reduce of the metric per epoch
        assert c["data_wait"] == 30
        assert c["optimizer"] == 24
        assert c["ddp_init"] == 1
        assert c["end"] == 1
    diag = diagnose_json(job.run_dir)
    assert diag["schema"] == "ddpdoctor.diagnosis/1"
    assert diag["run"]["world_size"] == 2 and diag["run"]["ranks"] == [0, 1]
    assert diag["run"]["exit_code"] == 0
    assert diag["run"]["steps"] == {"0": 24, "1": 24}
    assert diag["run"]["batch_size"] == {"per_process": 8, "global": 16}
    assert "counted_train.py" in " ".join(diag["run"]["command"])
    ph = diag["phases"]["1"]
    assert ph["forward"]["count"] == 30 and ph["allreduce"]["count"] == 70
    assert ph["barrier"]["count"] == 4 and ph["collective"]["count"] == 3
    assert ph["ddp_init"]["count"] == 1 and ph["optimizer"]["count"] == 24
    assert ph["backward"]["mean_s"] > 0
    assert [f for f in diag["findings"] if f["severity"] != "info"] == []


def test_bucket_records_name_their_parameters(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"), DDPDOCTOR_BUCKET_TIMING="on")
    assert job.returncode == 0, job.stderr
    buckets = [r[4] for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "bucket"]
    rebuilt = {b["index"]: b for b in buckets[1:]}
    assert sorted(rebuilt) == [0, 1, 2]
    assert rebuilt[0]["params"] == ["6.bias", "6.weight", "4.bias", "4.weight"]
    assert sum(b["bytes"] for b in rebuilt.values()) == 544260 * 4
    init = next(r for r in read_lines(job.run_dir / "trace-rank0.jsonl") if r[0] == "ddp_init")[4]
    assert init["params"] == 544260
    assert init["options"]["bucket_cap_mb"] == pytest.approx(1.0)
    assert init["options"]["find_unused_parameters"] is False


@pytest.mark.parametrize("hook", ["none", "user", "late"])
def test_parameters_bit_identical_with_and_without_doctor(
    tmp_path: Path, hook: str, native_timer: Path
) -> None:
    """Three ranks, so the gradient average is not a power-of-two division. Buckets timed from
    the first step (the default): our timer's reduction (in C++, probes/native.py) against
    DDP's own, every step; ``late``: the user's hook registered after the first epoch, when
    the C++ timer holds DDP's slot, runs (and is timed) inside it."""
    plain = run_plain(tmp_path, torchrun(3, JOBS / "seeded_train.py", "plain.pt", f"--hook={hook}"))
    assert plain.returncode == 0, plain.stderr
    command = torchrun(3, JOBS / "seeded_train.py", "doc.pt", f"--hook={hook}")
    job = run_doctor(tmp_path, command)
    assert job.returncode == 0, job.stderr
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "doc.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = read_lines(job.run_dir / "trace-rank2.jsonl")
    hooks = [r[4] for r in records if r[0] == "comm_hook"]
    assert hooks and hooks[-1]["user"] is (hook != "none")
    assert hooks[0].get("native", False) is (hook != "user")  # a user's hook from the start: Python
    if hook != "none":
        assert "user_hook" in hooks[-1]["name"]
    steps = [r[3] for r in records if r[0] == "allreduce"]
    assert sorted(set(steps)) == list(range(20))  # 2 epochs x 10 steps, every one timed


def test_bucket_timing_auto_times_long_steps_from_the_fifth_and_keeps_the_weights(tmp_path: Path) -> None:
    """``auto`` where the C++ timer is not built: the Python timer goes into DDP's hook slot
    only once a few steps have shown it is cheap: mid-run, from DDP's C++ reduction to ours,
    which must sum bit for bit the same."""
    args = ("--epochs=1", "--sleep-ms=60")  # 10 steps of 60 ms or more: their bucket can be timed
    plain = run_plain(tmp_path, torchrun(3, JOBS / "seeded_train.py", "plain.pt", *args))
    assert plain.returncode == 0, plain.stderr
    command = torchrun(3, JOBS / "seeded_train.py", "doc.pt", *args)
    python_timer = {"DDPDOCTOR_CACHE": str(tmp_path / "none")}  # no C++ timer built there
    job = run_doctor(tmp_path, command, DDPDOCTOR_BUCKET_TIMING="auto", **python_timer)
    assert job.returncode == 0, job.stderr
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "doc.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for rank in range(3):
        records = read_lines(job.run_dir / f"trace-rank{rank}.jsonl")
        (hook,) = [r for r in records if r[0] == "comm_hook"]
        assert hook[3] == 4 and hook[4]["auto"]["step_ms"] >= 60 and "timed" not in hook[4]
        steps = {r[3] for r in records if r[0] == "allreduce"}
        assert steps == set(range(4, 10))  # decided at step 4's forward, from 3 step intervals
    assert [f["kind"] for f in diagnose_json(job.run_dir)["findings"] if f["severity"] != "info"] == []


def test_bucket_timing_auto_leaves_millisecond_steps_to_ddp_and_still_knows_their_reductions(
    tmp_path: Path,
) -> None:
    # 12 buckets in steps of a few ms: timing them in Python (no C++ timer built) would need
    # steps of 240 ms (0.5 % of a step for 100 µs a bucket), a margin no load closes.
    command = torchrun(2, JOBS / "seeded_train.py", "doc.pt", "--epochs=1", "--deep=15")
    python_timer = {"DDPDOCTOR_CACHE": str(tmp_path / "none")}  # no C++ timer built there
    job = run_doctor(tmp_path, command, DDPDOCTOR_BUCKET_TIMING="auto", **python_timer)
    assert job.returncode == 0, job.stderr
    records = read_lines(job.run_dir / "trace-rank1.jsonl")
    (hook,) = [r for r in records if r[0] == "comm_hook"]
    auto = hook[4]["auto"]
    assert hook[4]["timed"] is False and auto["buckets"] >= 8
    # The decision follows from what it measured (how long a step took here is the machine's).
    assert auto["buckets"] * auto["cost_us"] > auto["share"] * auto["step_ms"] * 1e3
    assert not any(r[0] == "allreduce" for r in records)
    layout = [r[4] for r in records if r[0] == "bucket"]  # from DDP's logging data, untimed
    assert [b["index"] for b in layout] == list(range(hook[4]["auto"]["buckets"]))
    assert sorted(p for b in layout for p in b["params"])[:2] == ["0.bias", "0.weight"]
    from ddpdoctor.analysis.failed.ledger import build
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE
    from ddpdoctor.trace.reader import load_run

    ledger = build(load_run([job.run_dir]))[1]
    per_step = [p.step for p in ledger.points if p.op == GRAD_ALLREDUCE]
    assert set(per_step) == set(range(15))  # the last step's: before the epoch's barrier
    # Step 0 reduces in DDP's construction-time layout; then a number per bucket every step.
    assert {per_step.count(step) for step in range(1, 15)} == {hook[4]["auto"]["buckets"]}


def test_bucket_timing_off_leaves_the_reduction_to_ddp(tmp_path: Path) -> None:
    """DDPDOCTOR_BUCKET_TIMING=off: the user's hook runs as registered, untimed; no bucket spans,
    the same weights, and a healthy job still reads as healthy."""
    plain = run_plain(tmp_path, torchrun(3, JOBS / "seeded_train.py", "plain.pt", "--hook=user"))
    assert plain.returncode == 0, plain.stderr
    command = torchrun(3, JOBS / "seeded_train.py", "doc.pt", "--hook=user")
    job = run_doctor(tmp_path, command, DDPDOCTOR_BUCKET_TIMING="off")
    assert job.returncode == 0, job.stderr
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "doc.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = read_lines(job.run_dir / "trace-rank2.jsonl")
    hooks = [r[4] for r in records if r[0] == "comm_hook"]
    assert hooks[-1]["user"] is True and hooks[-1]["timed"] is False and "user_hook" in hooks[-1]["name"]
    assert not any(r[0] == "allreduce" for r in records)
    assert sum(1 for r in records if r[0] == "forward") >= 20
    assert [f["kind"] for f in diagnose_json(job.run_dir)["findings"] if f["severity"] != "info"] == []


def test_mp_spawn_launch(tmp_path: Path, write_script) -> None:
    script = write_script(
        "spawned.py",
        """
        import os, sys
        import torch, torch.distributed as dist, torch.multiprocessing as mp
        from torch.nn.parallel import DistributedDataParallel as DDP

        def worker(rank, world, port):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=world)
            model = DDP(torch.nn.Linear(8, 2))
            for _ in range(5):
                model(torch.randn(4, 8)).sum().backward()
            dist.barrier()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(worker, args=(2, int(sys.argv[1])), nprocs=2)
            print("spawned done")
        """,
    )
    job = run_doctor(tmp_path, [sys.executable, str(script), str(_free_port())])
    assert job.returncode == 0, job.stderr
    assert job.stdout.strip() == "spawned done"
    assert sorted(p.name for p in job.run_dir.glob("trace-*.bin")) == [
        "trace-rank0.bin",
        "trace-rank1.bin",
    ]
    for rank in (0, 1):
        c = counts(job.run_dir, rank)
        assert (c["train_forward"], c["backward"], c["allreduce"], c["barrier"]) == (5, 5, 5, 1)


def test_legacy_torch_distributed_launch(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--use-env",
        "--standalone",
        "--nproc_per_node=2",
        str(JOBS / "counted_train.py"),
    ]
    job = run_doctor(tmp_path, command)
    assert job.returncode == 0, job.stderr
    assert counts(job.run_dir, 1)["train_forward"] == 24


@pytest.mark.parametrize("code", [3, 0])
def test_exit_code_passes_through_plain_python(tmp_path: Path, write_script, code: int) -> None:
    script = write_script("exits.py", f"import sys; print('bye'); sys.exit({code})")
    job = run_doctor(tmp_path, [sys.executable, str(script)])
    assert job.returncode == code
    assert job.stdout == "bye\n"
    assert "nothing recorded" in job.stderr  # no rank ever called init_process_group


def test_exit_code_of_failing_torchrun_job(tmp_path: Path, write_script) -> None:
    script = write_script(
        "fails.py",
        """
        import sys, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        sys.exit(7 if dist.get_rank() == 1 else 0)
        """,
    )
    plain = run_plain(tmp_path, torchrun(2, script))
    job = run_doctor(tmp_path, torchrun(2, script))
    assert plain.returncode != 0
    assert job.returncode == plain.returncode
    diag = diagnose_json(job.run_dir)
    assert diag["run"]["exit_code"] == plain.returncode
    # sys.exit(7) raises no traceback: the rank's exit status (glibc's on_exit) names the root
    failure = next(f for f in diag["findings"] if f["kind"] == "rank_failure")
    assert failure["ranks"] == [1] and "exited with code 7" in failure["summary"], failure
    ends = json.loads((job.run_dir / "ends.json").read_text())["ranks"]
    # rank 0's exit(0) may still be in libtorch's teardown when torchrun, seeing rank 1's 7,
    # stops it: its status is written first thing in exit(), but Python's finalization precedes
    assert (ends["0"]["how"], ends["1"]["code"]) == ("exit", 7) and ends["0"]["code"] in (0, None), ends


def test_command_not_found(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, ["definitely-not-a-command-xyz"])
    assert job.returncode != 0
    assert "cannot start 'definitely-not-a-command-xyz'" in job.stderr


def test_sigterm_to_doctor_reaches_launcher_and_keeps_traces(tmp_path: Path, write_script) -> None:
    script = write_script(
        "forever.py",
        """
        import time, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(8, 2))
        if dist.get_rank() == 0:
            print("started", flush=True)
        while True:
            model(torch.randn(4, 8)).sum().backward()
            time.sleep(0.01)
        """,
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), "--", *torchrun(2, script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: communicate() below must not lose what readline() buffered
        env=job_env(),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"started"
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0  # torchrun reports the workers it had to stop
    for rank in (0, 1):
        records = read_lines(run_dir / f"trace-rank{rank}.jsonl")
        assert sum(1 for r in records if r[0] == "backward") > 10
        assert records[-1][0] != "end"  # killed by the signal as without us: no clean close
    meta = diagnose_json(run_dir)["run"]
    assert meta["exit_code"] == proc.returncode


def test_instrument_one_liner_without_the_cli(tmp_path: Path, write_script) -> None:
    script = write_script(
        "opt_in.py",
        """
        import ddpdoctor; ddpdoctor.instrument()
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(8, 2))
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        dist.destroy_process_group()
        """,
    )
    proc = run_plain(tmp_path, torchrun(2, script))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "ddpdoctor-runs").iterdir()
    assert sorted(p.name for p in run_dir.glob("trace-*.bin")) == [
        "trace-rank0.bin",
        "trace-rank1.bin",
    ]
    assert counts(run_dir, 1)["backward"] == 3
    # Each backward carries the thread's run-queue delay so far (µs; probes/cpuwait.py), never
    # decreasing: this kernel keeps schedstats, so none is the -1 of "unknown".
    runq = [r[4] for r in read_lines(run_dir / "trace-rank1.jsonl") if r[0] == "backward"]
    assert all(isinstance(v, int) and v >= 0 for v in runq) and runq == sorted(runq), runq


def test_dataloader_workers_and_forks_write_no_traces(tmp_path: Path, write_script) -> None:
    script = write_script(
        "workers.py",
        """
        import os, torch, torch.distributed as dist
        from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
        from torch.nn.parallel import DistributedDataParallel as DDP

        def main():
            dist.init_process_group("gloo")
            data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
            sampler = DistributedSampler(data)
            for method in ("fork", "spawn"):
                loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2,
                                    multiprocessing_context=method)
                model = DDP(torch.nn.Linear(8, 2))
                for x, y in loader:
                    ((model(x) - y) ** 2).mean().backward()
            pid = os.fork()
            if pid == 0:  # a forked child that uses the patched torch must not record
                torch.distributed.get_rank()
                os._exit(0)
            os.waitpid(pid, 0)
            dist.destroy_process_group()

        if __name__ == "__main__":
            main()
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr
    # Only the two ranks wrote traces or status files: no worker, fork or torchrun agent did.
    written = sorted(p.name for p in job.run_dir.iterdir() if p.name.startswith(("trace-", "status-")))
    assert written == ["status-rank0.json", "status-rank1.json", "trace-rank0.bin", "trace-rank1.bin"]
    c = counts(job.run_dir, 0)
    assert c["data_wait"] == 8 and c["train_forward"] == 8  # 4 batches per rank per loader


def test_failing_probe_switches_off_and_training_goes_on(tmp_path: Path, write_script) -> None:
    script = write_script(
        "broken_probe.py",
        """
        import torch, torch.distributed as dist
        from torch.utils.data import DataLoader, TensorDataset
        from torch.nn.parallel import DistributedDataParallel as DDP
        import ddpdoctor.probes.data as data_probe

        def broken(loader):
            raise RuntimeError("simulated probe bug")

        data_probe.describe_loader = broken  # the probe's own code fails, not the job's
        dist.init_process_group("gloo")
        loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
        model = DDP(torch.nn.Linear(4, 1))
        for epoch in range(3):
            for (x,) in loader:
                model(x).sum().backward()
        print("trained", flush=True)
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("trained") == 2
    log = (job.run_dir / "probe-errors.log").read_text()
    assert log.count("probe 'data' switched off: RuntimeError: simulated probe bug") == 2  # once per rank
    c = counts(job.run_dir, 0)
    assert c["probe_error"] == 1
    assert c.get("data_wait", 0) == 0 and c["train_forward"] == 12  # other probes unaffected
    kinds = {f["kind"] for f in diagnose_json(job.run_dir)["findings"]}
    assert "probe_error" in kinds


def test_a_signal_handlers_exception_inside_a_probe_reaches_the_program(tmp_path: Path, write_script) -> None:
    """Python runs a signal handler between any two bytecodes, inside a probe too (the
    DataLoader's SIGCHLD handler when a worker is OOM-killed, a user's SIGALRM timeout): what it
    raises is the program's and must reach the program, not switch the probe off."""
    script = write_script(
        "alarm.py",
        """
        import signal
        import torch, torch.distributed as dist
        from torch.utils.data import DataLoader, TensorDataset
        from torch.nn.parallel import DistributedDataParallel as DDP
        import ddpdoctor.probes.data as data_probe

        def on_alarm(signum, frame):
            raise TimeoutError("epoch took too long")

        signal.signal(signal.SIGALRM, on_alarm)
        describe = data_probe.describe_loader

        def alarmed(loader):  # the alarm goes off while the data probe runs
            signal.raise_signal(signal.SIGALRM)
            return describe(loader)

        data_probe.describe_loader = alarmed
        dist.init_process_group("gloo")
        loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
        model = DDP(torch.nn.Linear(4, 1))
        try:
            for (x,) in loader:
                model(x).sum().backward()
        except TimeoutError as exc:
            print(f"caught: {exc}", flush=True)
        data_probe.describe_loader = describe
        for (x,) in loader:
            model(x).sum().backward()
        print("trained", flush=True)
        """,
    )
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr
    assert job.stdout.count("caught: epoch took too long") == 2, job.stdout  # once per rank
    assert job.stdout.count("trained") == 2
    assert not (job.run_dir / "probe-errors.log").exists()  # no probe broke
    c = counts(job.run_dir, 0)
    assert c.get("probe_error", 0) == 0 and c["data_wait"] == 4  # the second pass was recorded


def test_a_signal_handlers_exception_at_any_moment_of_a_step_reaches_the_program(
    tmp_path: Path, write_script
) -> None:
    """A timer whose handler raises fires at a random moment of each step (data, forward,
    backward and its bucket drain, a collective, the optimizer's hooks): every exception it
    raised reaches the loop's ``except``. The C probes cleared what a helper they called raised,
    a signal handler's exception too (4 of 499 lost before)."""
    script = write_script(
        "ticks.py",
        """
        import random, signal, sys, time
        import torch, torch.distributed as dist, torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, TensorDataset

        class Tick(Exception):
            pass

        armed, fired, lost = False, 0, {}

        def on_alarm(signum, frame):
            global fired
            if armed:
                fired += 1
                where, f = [], frame
                while f is not None:
                    where.append(f"{f.f_code.co_filename}:{f.f_lineno}")
                    f = f.f_back
                lost[fired] = where
                raise Tick(fired)

        signal.signal(signal.SIGALRM, on_alarm)
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        rng = random.Random(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))), batch_size=8)
        model = DDP(net)
        wrappers = [model]  # kept: a wrapper's finalizer runs Python code (docs/diagnosis.md)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        took = []
        for x, y in loader:  # the first pass unarmed: torch's lazy imports swallow exceptions
            t0 = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            dist.all_reduce(torch.zeros(1))
            opt.step()
            took.append(time.perf_counter() - t0)
        # about half the steps are cut short on any host at any load: the window grows after
        # a step cut short and shrinks after one that completed
        window = 2 * sorted(took)[len(took) // 2]
        caught, it = 0, iter(loader)
        for step in range(400):
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-5, window))
            try:
                armed = True
                try:
                    x, y = next(it)
                except StopIteration:
                    it = iter(loader)
                    x, y = next(it)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                dist.all_reduce(loss.detach())
                opt.step()
                armed = False
                window *= 0.9
            except Tick as tick:
                armed = False
                caught += 1
                window *= 1.1
                del lost[tick.args[0]]
                # torch's optimizer restores grad mode in a `finally` that a signal can cut short
                # (optimizer.py `_use_grad`: 0-2 in 790 ticks with no probes loaded)
                torch.set_grad_enabled(True)
                model = DDP(net)  # a step cut short leaves the reducer mid-iteration
                wrappers.append(model)
                it = iter(loader)
            signal.setitimer(signal.ITIMER_REAL, 0)
        armed = False
        print(f"fired={fired} caught={caught}", flush=True)
        for k, where in lost.items():
            print(f"lost #{k}:", *where[:6], sep="\\n  ", flush=True)
        dist.destroy_process_group()
        sys.exit(0 if fired == caught and fired > 100 else 3)
        """,
    )
    job = run_doctor(tmp_path, torchrun(1, script))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-2000:]
    assert not (job.run_dir / "probe-errors.log").exists()  # no probe broke
    c = counts(job.run_dir, 0)
    assert c.get("optimizer", 0) > 20 and c.get("collective", 0) > 20  # the probes recorded
    # the summary names the hundreds of wrappers in one line
    wrappers = [line for line in (job.stdout + job.stderr).splitlines() if line.startswith("  DDP: ")]
    assert len(wrappers) == 1 and "wrappers alike" in wrappers[0], wrappers[:3]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_instrument_without_the_cli_keeps_a_killed_ranks_steps(tmp_path: Path, write_script) -> None:
    """No supervisor settles the run: `diagnose` completes the dead rank's trace from its ring."""
    script = write_script(
        "opt_in_killed.py",
        """
        import os, signal
        import ddpdoctor; ddpdoctor.instrument()
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(8, 2))
        for step in range(9):
            if step == 7 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            model(torch.randn(4, 8)).sum().backward()
        dist.destroy_process_group()
        """,
    )
    proc = run_plain(tmp_path, torchrun(2, script), DDPDOCTOR_FLUSH_S="60")  # nothing flushed
    assert proc.returncode != 0
    (run_dir,) = (tmp_path / "ddpdoctor-runs").iterdir()
    assert counts(run_dir, 1).get("backward", 0) < 7  # the file alone has lost the steps
    diagnose_json(run_dir)
    assert counts(run_dir, 1)["backward"] == 7  # every step before the kill, from the ring
    ends = json.loads((run_dir / "ends.json").read_text())["ranks"]
    assert ends["1"]["how"] == "signal" and ends["1"]["signal"] == "SIGKILL"
