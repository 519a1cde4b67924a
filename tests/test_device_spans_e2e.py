"""Device spans in real 2-rank gloo jobs: with a (fake) CUDA device, and without one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import JOBS, run_doctor, torchrun
from test_export import check_structure
from test_reports import doctor

from ddpdoctor.reports import chrome
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import load_run

pytestmark = pytest.mark.e2e


def test_fake_gpu_job_records_a_device_span_for_every_cpu_span(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "fake_gpu_train.py"), DDPDOCTOR_BUCKET_TIMING="on")
    assert job.returncode == 0, job.stderr[-3000:]
    run = load_run([job.run_dir])
    for trace in run.ranks.values():
        assert trace.header["schema"] == schema.SCHEMA
        for cpu, dev in schema.DEVICE_KINDS.items():
            c, d = trace.kind(cpu), trace.kind(dev)
            assert len(d) == len(c) > 0, (cpu, len(c), len(d))
            n = len(schema.KINDS[dev].fields)  # the CPU twin's, less host-only ones (backward's runq)
            assert sorted(map(tuple, d.fields)) == sorted(tuple(f)[:n] for f in c.fields)
            assert np.array_equal(np.sort(d.step), np.sort(c.step))
        # Four Linear layers launch 1 ms (forward) and 2 ms (backward) of device work each,
        # which the device runs after the CPU has moved on.
        fwd, dfwd = trace.kind(schema.FORWARD), trace.kind(schema.DEV_FORWARD)
        bwd, dbwd = trace.kind(schema.BACKWARD), trace.kind(schema.DEV_BACKWARD)
        assert (dfwd.dur >= 4000).all() and (dbwd.dur >= 8000).all()
        for cpu, dev in [(fwd, dfwd), (bwd, dbwd)]:  # same order: spans resolve in record order
            assert (dev.ts >= cpu.ts - 300).all()  # the device never starts before the launch
        ar, dar = trace.kind(schema.ALLREDUCE), trace.kind(schema.DEV_ALLREDUCE)
        order_c = np.lexsort((ar.ints(0), ar.step))
        order_d = np.lexsort((dar.ints(0), dar.step))
        assert (dar.ts[order_d] >= ar.ts[order_c] - 300).all()
        # The last bucket is ready on the device after the step's backward work ran there.
        ends = dict(zip(dbwd.step.tolist(), dbwd.end.tolist(), strict=True))
        assert all(e <= ends[s] + 300 for s, e in zip(dar.step.tolist(), dar.end.tolist(), strict=True))
    assert not (job.run_dir / "probe-errors.log").exists()
    # The report draws the device lanes; the Perfetto export has a gpu thread per rank.
    page = (job.run_dir / "report.html").read_text()
    assert "backward (GPU)" in page and "bucket all-reduce (GPU)" in page
    out = tmp_path / "trace.json"
    assert doctor("export", str(job.run_dir), "-o", str(out)).returncode == 0
    trace = json.loads(out.read_text())
    host = run.ranks[0].host
    by_thread = check_structure(trace, [0, 1], {0: host, 1: host})
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    for rank, t in run.ranks.items():
        assert threads[(rank, chrome.DEVICE_TID)] == "gpu"
        on_gpu = [
            e
            for (pid, tid), evs in by_thread.items()
            if pid == rank and tid >= chrome.DEVICE_TID
            for e in evs
        ]
        assert len(on_gpu) == sum(len(t.kind(k)) for k in schema.DEVICE_KINDS.values())
        assert {e["cat"] for e in on_gpu} == set(schema.DEVICE_KINDS.values())


def test_cpu_job_has_no_device_spans(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "counted_train.py"))
    assert job.returncode == 0, job.stderr[-3000:]
    run = load_run([job.run_dir])
    for trace in run.ranks.values():
        assert len(trace.kind(schema.FORWARD)) > 0
        assert not [k for k in trace.events if k.startswith("dev_")]
    assert "(GPU)" not in (job.run_dir / "report.html").read_text()
