"""GPU sampling through NVML: the real no-GPU path here, and the sampler, rank mapping and
findings against a fake NVML at the ``pynvml`` boundary (it raises pynvml's own error classes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pynvml
import pytest
from conftest import JOBS, read_lines, run_doctor, run_plain, torchrun

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.slow.gpu import expected_gpu, gpu_view, missing_text
from ddpdoctor.reports import chrome, html, json_report, terminal
from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor import nvml
from ddpdoctor.supervisor.nvml import Sampler
from ddpdoctor.trace.merge import time_base
from ddpdoctor.trace.reader import load_run, read_gpu
from ddpdoctor.trace.synthetic import SyntheticJob, write_run

MiB = 2**20
TOTAL = 81_559 * MiB  # an H100 80GB HBM3 as NVML reports it
RANK_PID = 1000  # synthetic rank r has pid 1000 + r
MONO0 = 5_000_000_000  # rank 0's mono_ns in synthetic traces


def healthy(k: int, gpu: int) -> dict[str, Any]:
    """One recorded sample of a busy H100 (the shape NVML returns)."""
    return {
        "util": 95 if k % 2 else 85,
        "mem_util": 40,
        "used": 30_000 * MiB + gpu * MiB,
        "power_mw": 650_000 + 1_000 * k,
        "sm": 1980,
        "temp": 60 + k % 5,
        "throttle": 0,  # none
    }


class FakeNVML:
    """Module-like stand-in for ``pynvml``: recorded values per (sample, GPU), scripted errors.

    ``errors[(sample, gpu, function)]`` is raised when that call is made at that sample (sample
    -1: every sample); ``procs(sample, gpu)`` gives the compute processes.
    """

    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(
        self,
        count: int = 2,
        values: Any = healthy,
        procs: Any = None,
        errors: dict[tuple[int, int, str], type[Exception]] | None = None,
        init_error: type[Exception] | None = None,
    ) -> None:
        self.count, self.values, self.init_error = count, values, init_error
        self.procs = procs or (lambda k, g: [(RANK_PID + g, 2_000 * MiB)])
        self.errors = errors or {}
        self.k = 0  # the sample being read; the test advances it
        self.calls: list[str] = []
        self.shut = False

    def _raise(self, gpu: int, fn: str) -> None:
        self.calls.append(fn)
        for key in ((self.k, gpu, fn), (-1, gpu, fn)):
            if key in self.errors:
                raise self.errors[key](*(() if issubclass(self.errors[key], pynvml.NVMLError) else ("boom",)))

    def _v(self, h: int, fn: str) -> dict[str, Any]:
        self._raise(h, fn)
        return self.values(self.k, h)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08d}-aaaa-bbbb-cccc-000000000000"

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        return 1980

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        v = self._v(h, "util")
        return SimpleNamespace(gpu=v["util"], memory=v["mem_util"])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        v = self._v(h, "memory")
        return SimpleNamespace(used=v["used"], total=TOTAL, free=TOTAL - v["used"])

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._v(h, "power")["power_mw"]

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        assert kind == self.NVML_CLOCK_SM
        return self._v(h, "sm_clock")["sm"]

    def nvmlDeviceGetTemperature(self, h: int, kind: int) -> int:
        return self._v(h, "temperature")["temp"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._v(h, "throttle")["throttle"]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._raise(h, "processes")
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.procs(self.k, h)]


def sample(sampler: Sampler, fake: FakeNVML, n: int) -> int:
    """Drive ``n`` samples by hand; returns how many the sampler took before it stopped."""
    assert sampler.open()
    for k in range(n):
        fake.k = k
        if not sampler.sample_once():
            sampler.close()
            return k
    sampler.close()
    return n


def records(path: Path, kind: str) -> list[dict[str, Any]]:
    return [r[4] for r in read_lines(path) if r[0] == kind]


# ---------------------------------------------------------------------------------------------
# The sampler at the NVML boundary


def test_real_nvml_on_this_machine_samples_or_says_why_once(tmp_path: Path) -> None:
    """The real pynvml, whatever this host has: samples where a driver and a GPU are present,
    else one 'unavailable' record and one line that says why; never a crash."""
    sampler = Sampler(tmp_path, 0.05, host="h")
    sampler.start()
    time.sleep(0.2)
    sampler.stop()
    path = RunDir(tmp_path).gpu("h")
    header = read_lines(path)[0]
    assert header[0] == "header"
    unavailable = records(path, "unavailable")
    text = missing_text([read_gpu(path)])
    if unavailable:  # no driver, no library or no GPU (this CPU-only CI machine)
        (info,) = unavailable
        assert info["error"] and info["reason"]
        assert header[1]["gpus"] == [] and not records(path, "gpu")
        assert text is not None and text.startswith("no GPU metrics: ") and text.count("NVML") == 1
    else:  # a GPU host: every GPU in the header is sampled
        assert header[1]["gpus"] and text is None
        sampled = {r["gpu"] for r in records(path, "gpu")}
        assert sampled == {g["index"] for g in header[1]["gpus"]}


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (pynvml.NVMLError_LibraryNotFound, "NVML library not found"),
        (pynvml.NVMLError_DriverNotLoaded, "driver is not loaded"),
        (pynvml.NVMLError_NoPermission, "no permission"),
        (pynvml.NVMLError_Unknown, "NVML error Unknown"),
    ],
)
def test_init_errors_leave_one_reason(tmp_path: Path, error: type, words: str) -> None:
    fake = FakeNVML(init_error=error)
    sampler = Sampler(tmp_path, nvml=fake, host="h")
    assert not sampler.open()
    sampler.close()
    (info,) = records(RunDir(tmp_path).gpu("h"), "unavailable")
    assert words in info["reason"]
    assert fake.calls == []


def test_no_gpu_and_no_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = Sampler(tmp_path / "a", nvml=FakeNVML(count=0), host="h")
    assert not sampler.open()
    sampler.close()
    assert records(RunDir(tmp_path / "a").gpu("h"), "unavailable")[0]["reason"] == "NVML sees no GPU"

    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml, "_import_pynvml", missing)
    sampler = Sampler(tmp_path / "b", host="h")
    assert not sampler.open()
    sampler.close()
    assert "not installed" in records(RunDir(tmp_path / "b").gpu("h"), "unavailable")[0]["reason"]


def test_samples_every_metric_and_skips_an_unsupported_one(tmp_path: Path) -> None:
    fake = FakeNVML(count=2, errors={(-1, 1, "power"): pynvml.NVMLError_NotSupported})
    sampler = Sampler(tmp_path, nvml=fake, host="h")
    assert sample(sampler, fake, 5) == 5
    path = RunDir(tmp_path).gpu("h")
    header = read_lines(path)[0][1]
    assert [g["name"] for g in header["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 2
    assert header["gpus"][0]["mem_total"] == TOTAL and header["driver"] == "550.54.15"
    gpu = records(path, "gpu")
    assert len(gpu) == 10
    first = gpu[0]
    assert first == {
        "gpu": 0,
        "util": 85,
        "mem_util": 40,
        "mem_used": 30_000 * MiB,
        "mem_total": TOTAL,
        "power_w": 650.0,
        "sm_clock_mhz": 1980,
        "temp_c": 60,
        "throttle": 0,
    }
    assert all("power_w" not in r for r in gpu if r["gpu"] == 1)
    assert all("power_w" in r for r in gpu if r["gpu"] == 0)
    # NotSupported is recorded once and the call is not retried.
    assert records(path, "unsupported") == [{"gpu": 1, "metric": "power", "error": "NotSupported"}]
    assert fake.calls.count("power") == 5 + 1
    # The process list did not change: written once per GPU.
    assert records(path, "gpu_procs") == [
        {"gpu": 0, "procs": [[RANK_PID, 2_000 * MiB]]},
        {"gpu": 1, "procs": [[RANK_PID + 1, 2_000 * MiB]]},
    ]
    assert records(path, "end") == [{"reason": "stop", "samples": 5}]
    assert fake.shut
    assert missing_text([read_gpu(path)]) == "not available from NVML: power (GPU 1)"


def test_error_mid_run_stops_sampling_once(tmp_path: Path) -> None:
    fake = FakeNVML(count=2, errors={(3, 1, "temperature"): pynvml.NVMLError_GpuIsLost})
    sampler = Sampler(tmp_path, nvml=fake, host="h")
    assert sample(sampler, fake, 8) == 3
    path = RunDir(tmp_path).gpu("h")
    (err,) = records(path, "nvml_error")
    assert (err["gpu"], err["metric"], err["error"]) == (1, "temperature", "GpuIsLost")
    assert max(r[1] for r in read_lines(path) if r[0] == "gpu") <= max(
        r[1] for r in read_lines(path) if r[0] == "nvml_error"
    )
    assert len([r for r in records(path, "gpu") if r["gpu"] == 1]) == 3
    assert records(path, "end")[0]["reason"] == "nvml_error"

    text = missing_text([read_gpu(path)])
    assert text is not None and "stopped" in text and "GpuIsLost reading temperature of GPU 1" in text


def test_thread_survives_a_bug_and_an_error_mid_run(tmp_path: Path) -> None:
    """Run as the supervisor runs it: a thread; a non-NVML exception ends sampling, not us."""
    fake = FakeNVML(count=1, errors={(-1, 0, "processes"): ValueError})
    sampler = nvml.start_sampler(tmp_path, 0.05, nvml=fake)
    assert sampler is not None
    sampler._thread.join(5)
    assert not sampler._thread.is_alive()
    sampler.stop()
    (err,) = records(sampler.path, "sampler_error")
    assert err["error"] == "ValueError" and err["metric"] == "processes"
    assert nvml.start_sampler(tmp_path, None) is None  # --no-nvml


def test_expected_gpu_from_local_rank_and_visible_devices() -> None:
    gpus = [{"index": i, "uuid": f"GPU-{i}abc"} for i in range(4)]
    assert expected_gpu({"local_rank": 2}, gpus) == 2
    assert expected_gpu({"local_rank": 5}, gpus) is None
    assert expected_gpu({"local_rank": 1, "cuda_visible_devices": "3,2"}, gpus) == 2
    assert expected_gpu({"local_rank": 1, "cuda_visible_devices": "3"}, gpus) == 3  # one per rank
    assert expected_gpu({"local_rank": 0, "cuda_visible_devices": "GPU-2a"}, gpus) == 2
    assert expected_gpu({"local_rank": 0, "cuda_visible_devices": "MIG-x"}, gpus) is None
    assert expected_gpu({"local_rank": None}, gpus) is None


# ---------------------------------------------------------------------------------------------
# Synthetic runs sampled through the fake: alignment, mapping, statistics, findings

STEP_US = 40_000


def sampled_run(
    tmp_path: Path, fake: FakeNVML, job: SyntheticJob | None = None, period_us: int = 100_000
) -> Any:
    """A synthetic 4-rank run on node0 plus its GPU file, sampled through ``fake`` with a
    scripted clock on rank 0's monotonic clock (the host's ranks share it)."""
    job = job or SyntheticJob(ranks=4, steps=60, ranks_per_host=4)
    (run_dir,) = write_run(job, tmp_path / "runs")
    ticks = iter(range(10_000))
    sampler = Sampler(run_dir, nvml=fake, host="node0", clock=lambda: MONO0 + next(ticks) * period_us * 1000)
    span_us = max(load_run([run_dir]).ranks[r].last_ts for r in range(job.ranks))
    sample(sampler, fake, span_us // period_us + 3)
    return load_run([run_dir])


def findings(run: Any, kind: str) -> list[Any]:
    return [f for f in diagnose(run).findings if f.kind == kind]


def test_samples_are_placed_on_rank_zero_clock(tmp_path: Path) -> None:
    run = sampled_run(tmp_path, FakeNVML(count=4))
    view = gpu_view(run)
    tb = time_base(run)
    dev = view.devices[0]
    # Sample k was taken at rank 0's monotonic time MONO0 + (k + 1) * 100 ms (the anchor used tick 0).
    expected = tb.rel(0, np.array([(k + 1) * 100_000 for k in range(len(dev.t_us))]))
    assert np.array_equal(dev.t_us, expected.astype(np.float64))
    assert len(view.devices) == 4 and [d.ranks for d in view.devices] == [[0], [1], [2], [3]]


def test_healthy_run_summary_and_no_gpu_findings(tmp_path: Path) -> None:
    run = sampled_run(tmp_path, FakeNVML(count=4))
    diag = diagnose(run)
    assert not [f for f in diag.findings if f.kind.startswith("gpu")]
    out = json_report.document(diag)["gpus"]
    assert out["sampled"] and out["missing"] is None
    assert out["ranks"]["2"] == {
        "host": "node0",
        "gpu": 2,
        "by": "pid",
        "uses_gpu": True,
        "expected_gpu": 2,
        "memory_bytes": {"2": 2_000 * MiB},
    }
    dev = out["devices"][1]
    assert dev["ranks"] == [1] and dev["name"] == "NVIDIA H100 80GB HBM3"
    assert dev["util_pct"]["peak"] == 95 and 85 <= dev["util_pct"]["mean"] <= 95
    assert dev["mem_used_bytes"]["peak"] == 30_001 * MiB and dev["mem_total_bytes"] == TOTAL
    assert dev["sm_clock_mhz"] == {"mean": 1980.0, "peak": 1980.0} and dev["throttled_share"] == 0.0
    span_s = gpu_view(run).span_us[1] / 1e6
    assert abs(dev["samples"] - span_s / 0.1) <= 2  # only the samples within the ranks' span
    text = terminal.render(diag)
    gpu_lines = [line for line in text.splitlines() if line.startswith("  GPU ")]
    assert len(gpu_lines) == 4 and gpu_lines[1].startswith("  GPU 1 rank 1: util ")
    assert "  GPU: " not in text  # nothing missing, nothing said
    assert all(len(line) <= 80 for line in text.splitlines())


def test_other_ranks_memory_on_gpu0_by_pid(tmp_path: Path) -> None:
    def procs(k: int, g: int) -> list[tuple[int, int]]:
        own = [(RANK_PID + g, 20_000 * MiB)]
        return own + [(RANK_PID + r, 500 * MiB) for r in (1, 2, 3)] if g == 0 else own

    run = sampled_run(tmp_path, FakeNVML(count=4, procs=procs))
    (f,) = findings(run, "gpu_stray_memory")
    assert (f.ranks, f.details["gpu"], f.severity) == ([1, 2, 3], 0, "warning")
    assert "set_device" in f.summary and "0.49 GiB each" in f.summary and "rank 0's GPU" in f.summary
    assert not findings(run, "gpu_shared")


def test_several_ranks_on_one_gpu_by_pid(tmp_path: Path) -> None:
    def procs(k: int, g: int) -> list[tuple[int, int]]:
        return [(RANK_PID + r, 9_000 * MiB) for r in range(4)] if g == 0 else []

    run = sampled_run(tmp_path, FakeNVML(count=4, procs=procs))
    (f,) = findings(run, "gpu_shared")
    assert f.ranks == [0, 1, 2, 3] and f.details["gpu"] == 0 and "memory" in f.details["by"]
    assert not findings(run, "gpu_stray_memory")


def test_container_pids_fall_back_to_local_rank(tmp_path: Path) -> None:
    """The driver reports host PIDs that match no rank: map by LOCAL_RANK, count processes."""

    def procs(k: int, g: int) -> list[tuple[int, int]]:
        host = 90_000
        return [(host + r, 500 * MiB) for r in range(4)] if g == 0 else [(host + g, 9_000 * MiB)]

    run = sampled_run(tmp_path, FakeNVML(count=4, procs=procs))
    view = gpu_view(run)
    assert {g.by for g in view.ranks.values()} == {"local_rank"}
    assert [view.ranks[r].gpu for r in range(4)] == [0, 1, 2, 3]
    (f,) = findings(run, "gpu_stray_memory")
    assert f.details == {"host": "node0", "gpu": 0, "processes": 4, "expected": [0]}
    assert f.ranks == [1, 2, 3]
    assert not findings(run, "gpu_shared")


def test_idle_gpus_during_steps(tmp_path: Path) -> None:
    def values(k: int, g: int) -> dict[str, Any]:
        return dict(healthy(k, g), util=8 if g == 3 else 90)

    run = sampled_run(tmp_path, FakeNVML(count=4, values=values))
    (f,) = findings(run, "gpu_idle")
    assert f.ranks == [3] and f.details["gpus"]["node0:3"]["util_mean_pct"] == 8.0
    assert "8%" in f.summary


@pytest.mark.parametrize("slow_gpu", [True, False])
def test_straggler_joined_with_its_throttling_gpu(tmp_path: Path, slow_gpu: bool) -> None:
    def values(k: int, g: int) -> dict[str, Any]:
        v = healthy(k, g)
        if slow_gpu and g == 2:
            v.update(sm=1410, throttle=0x4 | 0x20 if k % 2 else 0x4)  # power cap, thermal
        return v

    job = SyntheticJob(ranks=4, steps=60, ranks_per_host=4, straggler=2)
    run = sampled_run(tmp_path, FakeNVML(count=4, values=values), job)
    (f,) = [f for f in diagnose(run).findings if f.kind == "straggler"]
    assert f.ranks == [2]
    if not slow_gpu:
        assert "gpu" not in f.details and "GPU" not in f.summary
        return
    ev = f.details["gpu"]
    assert (ev["gpu"], ev["sm_clock_mhz"], ev["others_sm_clock_mhz"]) == (2, 1410.0, 1980.0)
    assert ev["throttled_share"] == 1.0 and ev["throttle_reasons"] == ["power cap", "thermal (software)"]
    assert "its GPU 2 (node0) SM clock averaged 1410 MHz" in f.summary
    # A data-loading straggler: the slow GPU is reported, after the data fix.
    assert f.details["phase"] == "data_wait" and f.fix.startswith("Its DataLoader")
    assert "Its GPU also runs slower" in f.fix


def test_reports_carry_the_gpu_panels_and_counters(tmp_path: Path) -> None:
    run = sampled_run(tmp_path, FakeNVML(count=2, errors={(-1, 1, "power"): pynvml.NVMLError_NotSupported}))
    diag = diagnose(run)
    trace = chrome.document(diag)["traceEvents"]
    names = {
        e["args"]["name"] for e in trace if e["name"] == "process_name" and e["pid"] >= chrome.GPU_PID_BASE
    }
    assert names == {"GPU 0 (node0) ranks 0", "GPU 1 (node0) ranks 1"}
    counters = [e for e in trace if e["ph"] == "C" and e["pid"] == chrome.GPU_PID_BASE]
    assert {e["name"] for e in counters} == set(chrome.GPU_COUNTERS) | {"throttled"}
    assert all(e["ts"] >= 0 for e in counters)
    util = [e for e in counters if e["name"] == "utilization %"]
    assert {e["args"]["gpu"] for e in util} == {85.0, 95.0}
    assert not [
        e for e in trace if e["ph"] == "C" and e["pid"] == chrome.GPU_PID_BASE + 1 and e["name"] == "power W"
    ]
    page = html.render(diag)
    assert 'id="gpu-panels"' in page and "No GPU metrics" not in page
    assert page.index('id="gpu"') > page.index('id="timeline-section"')
    assert page.index('id="gpu"') < page.index('id="lateness"')
    assert "not available from NVML: power (GPU 1)" in page
    text = terminal.render(diag)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert text.count("GPU: not available from NVML: power (GPU 1)") == 1


# ---------------------------------------------------------------------------------------------
# A real job on this machine (no GPU): the run is unchanged and the summary says so once


def gpu_lines(stderr: str) -> list[str]:
    """What the doctor says about GPUs and NVML (a finding's fix may mention a GPU in passing:
    a 2-rank CPU job on a busy machine can show a short straggler note)."""
    return [line for line in stderr.splitlines() if line.lstrip().startswith("GPU") or "nvml" in line.lower()]


@pytest.mark.e2e
def test_real_job_without_gpu(tmp_path: Path) -> None:
    command = torchrun(2, JOBS / "counted_train.py")
    plain = run_plain(tmp_path, command)
    job = run_doctor(tmp_path, command, "--nvml-interval", "0.2")
    assert job.returncode == plain.returncode == 0, job.stderr
    assert job.stdout == plain.stdout and job.stdout.count("epoch ") == 3
    said = gpu_lines(job.stderr)
    assert len(said) == 1, job.stderr
    assert said[0].startswith("  GPU: no GPU metrics: ")
    (path,) = job.run_dir.glob("gpu-*.jsonl")
    assert records(path, "unavailable")
    out = json.loads(json.dumps(json_report.document(diagnose(load_run([job.run_dir])))))["gpus"]
    assert out["sampled"] and out["devices"] == [] and out["missing"].startswith("no GPU metrics")

    (tmp_path / "off").mkdir()
    off = run_doctor(tmp_path / "off", command, "--no-nvml")
    assert off.returncode == 0, off.stderr
    assert off.stdout == plain.stdout
    assert not list(off.run_dir.glob("gpu-*.jsonl"))
    assert not gpu_lines(off.stderr), off.stderr
