"""`ddpdoctor bench`: every mode with every built-in model on CPU, bad models, and the pieces
that only run with GPUs (DataParallel's stage timer, the GPU wording) checked without them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import job_env

from ddpdoctor.bench import explain, worker

STEPS = 4


def _bench(cwd: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "bench", "--out", str(cwd / "bench"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=job_env(),
    )


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["mlp", "convnet", "transformer"])
def test_bench_json_every_mode(tmp_path: Path, model: str) -> None:
    proc = _bench(
        tmp_path, "--model", model, "--steps", str(STEPS), "--warmup", "1", "--batch-size", "16", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the JSON object and nothing else
    assert result["schema"] == "ddpdoctor.bench/1"
    modes = result["modes"]
    assert set(modes) == {"single", "dp", "ddp"}
    for name, mode in modes.items():
        assert mode["ok"], name
        assert mode["steps"] == STEPS, name
        assert len(mode["step_times_s"]) == STEPS
        assert mode["samples_per_s"] > 0 and mode["step_time_p50_s"] > 0, name
        assert mode["step_time_p95_s"] >= mode["step_time_p50_s"]
    gpus = torch.cuda.device_count()
    assert modes["single"]["world_size"] == 1
    assert modes["dp"]["replicas"] == max(1, gpus)
    assert modes["ddp"]["world_size"] == 2 and modes["ddp"]["batch_per_process"] == 8
    assert modes["single"]["batch_per_process"] == modes["dp"]["batch_per_process"] == 16
    assert modes["single"]["speedup"] == 1.0
    # DDP's breakdown comes from the core probes, warm-up excluded.
    probes = modes["ddp"]["probes"]
    assert probes["steps"] == STEPS
    assert probes["forward_s"] > 0 and probes["backward_s"] > 0 and probes["allreduce_s"] > 0
    assert 0.0 <= probes["overlap"] <= 1.0
    assert probes["allreduce_bytes_per_step"] >= 4 * modes["single"]["params"]
    if not gpus:
        assert modes["ddp"]["memory_per_gpu_bytes"] is None
        assert "scatter" not in modes["dp"]["breakdown_s"]  # DataParallel never ran it: no fake 0
        assert any(n.startswith("No GPU: DataParallel") for n in result["notes"])
    run_dir = tmp_path / "bench"
    assert json.loads((run_dir / "bench.json").read_text())["modes"]["ddp"]["steps"] == STEPS
    page = (run_dir / "bench.html").read_text()
    assert "bench-throughput" in page and "bench-breakdown" in page
    assert (run_dir / "ddp" / "trace-rank1.bin").is_file()  # a real run dir, for diagnose/compare


def test_bench_bad_model_exits_2(tmp_path: Path) -> None:
    for spec, says in (
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        ("resnet", "expected one of mlp, convnet, transformer"),
        ("json:no_such_function", "has no attribute 'no_such_function'"),
        ("json:__doc__", "is not callable"),
    ):
        proc = _bench(tmp_path, "--model", spec, timeout=60)
        assert proc.returncode == 2, (spec, proc.stderr)
        assert says in proc.stderr, (spec, proc.stderr)
    proc = _bench(tmp_path, "--model", "json:loads", timeout=60)  # importable, but no shape
    assert proc.returncode == 2 and "--input-shape" in proc.stderr
    proc = _bench(tmp_path, "--input-shape", "3,x", timeout=60)
    assert proc.returncode == 2 and "integers" in proc.stderr
    proc = _bench(tmp_path, "--batch-size", "10", "--nproc", "4", timeout=60)
    assert proc.returncode == 2 and "does not split evenly" in proc.stderr
    assert not (tmp_path / "bench").exists()  # nothing started


def test_worker_runs_a_user_module_named_like_ours(tmp_path: Path) -> None:
    """`--model models:build` from the user's directory gets their models.py, not ours."""
    (tmp_path / "models.py").write_text(
        textwrap.dedent(
            """
            import torch
            def build():
                return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
            """
        )
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(Path(worker.__file__)), "--mode=single,dp", "--model=models:build"]
        + ["--input-shape=3,4", "--batch-size=8", "--steps=3", "--warmup=1", "--loss=mse", f"--out={out}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    for mode in ("single", "dp"):
        res = json.loads((out / f"{mode}-rank0.json").read_text())
        assert res["params"] == 12 * 3 + 3 and len(res["step_s"]) == 3


class _FakeDP:
    """DataParallel's forward, as torch writes it, calling the four stages through self."""

    def scatter(self, inputs: tuple, kwargs: dict, ids: list) -> tuple:
        return [inputs, inputs], [kwargs, kwargs]

    def replicate(self, module: object, ids: list) -> list:
        return [module, module]

    def parallel_apply(self, replicas: list, inputs: list, kwargs: list) -> list:
        return [sum(i) for i in inputs]

    def gather(self, outputs: list, device: int) -> int:
        return sum(outputs)

    def forward(self, *inputs: int) -> int:
        ins, kws = self.scatter(inputs, {}, [0, 1])
        return self.gather(self.parallel_apply(self.replicate(self, [0, 1]), ins, kws), 0)


def test_dp_timer_times_every_stage_and_resets() -> None:
    dp = _FakeDP()
    timer = worker._DPTimer(dp, [])
    assert dp.forward(1, 2) == 6  # results pass through unchanged
    first = timer.take()
    assert set(first) == set(worker.DP_PHASES) and all(v > 0 for v in first.values())
    assert timer.called == set(worker.DP_PHASES)
    assert all(v == 0 for v in timer.take().values())


def _result(gpus: int, replicas: int) -> dict:
    mode = {"ok": True, "world_size": 4, "replicas": replicas, "threads_per_process": 1}
    return {
        "config": {"cuda_devices": ["H100"] * gpus, "cpu_count": 16},
        "modes": {
            "single": {**mode, "world_size": 1, "replicas": 1, "samples_per_s": 100.0},
            "dp": {
                **mode,
                "world_size": 1,
                "samples_per_s": 150.0,
                "step_time_mean_s": 0.1,
                "breakdown_s": {"scatter": 0.01, "replicate": 0.02, "gather": 0.01},
            },
            "ddp": {
                **mode,
                "samples_per_s": 360.0,
                "speedup": 3.6,
                "scaling_efficiency": 0.9,
                "step_time_mean_s": 0.05,
                "probes": {"allreduce_s": 0.01, "exposed_allreduce_s": 0.005, "overlap": 0.5},
            },
        },
    }


def test_explanations_name_the_causes_with_gpus_and_say_so_without() -> None:
    text = " ".join(explain.notes(_result(gpus=4, replicas=4)))
    assert "40% of each step in scatter, replicate and gather" in text
    assert "GIL" in text and "all 4 GPUs on every step" in text
    assert "DDP ran 2.40x DataParallel's throughput" in text
    assert "No GPU" not in text and "share" not in text
    cpu = " ".join(explain.notes(_result(gpus=0, replicas=1)))
    assert "No GPU: DataParallel" in cpu and "cannot be compared" in cpu
    assert "DataParallel's throughput" not in cpu and "GIL" not in cpu
    assert "share 16 core(s)" in cpu
