"""Synthetic run directories in the real trace format, for benchmarks and renderer tests.

The model is a DDP step per rank: data wait, forward, backward whose buckets become ready in
turn and whose all-reduces finish only when the slowest rank's bucket is ready (so a straggler
makes every other rank wait at the gradient sync), then the optimizer; a barrier every
``barrier_every`` steps. Hosts can be given skewed wall clocks, recorded the way the clock
probe records them, to test alignment. Pure Python and numpy: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddpdoctor.trace import schema

_ENC = json.JSONEncoder(separators=(",", ":")).encode


@dataclass
class SyntheticJob:
    ranks: int = 4
    steps: int = 50
    ranks_per_host: int = 8
    buckets: int = 4
    straggler: int | None = None  # this rank's data loading is slow
    straggler_extra_us: int = 30_000
    host_skew_us: dict[int, int] = field(default_factory=dict)  # host index -> wall clock error
    record_clock: bool = True  # write the clock records the probe would
    barrier_every: int = 100
    seed: int = 0
    host_name: str = "node{}"  # formatted with the host index
    param_name: str = "layers.{}.weight"  # formatted with a parameter index
    command: list[str] = field(default_factory=lambda: ["torchrun", "--nproc_per_node", "8", "train.py"])


def _host(job: SyntheticJob, rank: int) -> int:
    return rank // job.ranks_per_host


def write_run(job: SyntheticJob, out: Path) -> list[Path]:
    """Write the job's traces (one run dir per host, like a multi-node run) under ``out``."""
    rng = np.random.default_rng(job.seed)
    n, nb = job.ranks, job.buckets
    t0_wall_us = 1_700_000_000_000_000
    start = rng.integers(0, 2_000, n)  # true µs since the job's start when each rank begins
    dirs: dict[int, Path] = {}
    lines: list[list[str]] = [[] for _ in range(n)]
    param_bytes = [4_000_000 * (i + 1) for i in range(nb)]
    params = [[job.param_name.format(2 * i), job.param_name.format(2 * i + 1)] for i in range(nb)]
    for r in range(n):
        h = _host(job, r)
        dirs.setdefault(h, out / f"host{h}")
        skew = job.host_skew_us.get(h, 0)
        header = {
            "schema": schema.SCHEMA,
            "rank": r,
            "world_size": n,
            "local_rank": r % job.ranks_per_host,
            "host": job.host_name.format(h),
            "pid": 1000 + r,
            "wall_ns": (t0_wall_us + int(start[r]) + skew) * 1000,
            "mono_ns": 5_000_000_000 + r,
            "backend": "nccl",
            "torch": "2.13.0",
            "argv": job.command[3:] if len(job.command) > 3 else ["train.py"],
            "restart": 0,
        }
        out_lines = lines[r]
        out_lines.append(_ENC([schema.HEADER, header]))
        options = {
            "find_unused_parameters": False,
            "broadcast_buffers": True,
            "gradient_as_bucket_view": False,
            "static_graph": False,
            "bucket_cap_mb": 25.0,
            "device_ids": [str(r % job.ranks_per_host)],
            "buffers": 0,
        }
        init = {"module": "Net", "params": sum(param_bytes) // 4, "param_tensors": 2 * nb}
        init.update({"param_bytes": sum(param_bytes), "buckets": param_bytes, "seq": 0, "options": options})
        out_lines.append(_ENC([schema.DDP_INIT, 0, 1_000, -1, init]))
        if job.record_clock:
            rtt = int(rng.integers(50, 300))
            out_lines.append(
                _ENC(
                    [
                        schema.CLOCK,
                        1_000,
                        0,
                        -1,
                        {"offset_ns": -skew * 1000, "rtt_ns": rtt * 1000, "ref_rank": 0},
                    ]
                )
            )
        loader = {"id": 1, "sampler": "DistributedSampler", "epoch": 0, "shuffle": True, "batch_size": 32}
        loader.update({"drop_last": False, "num_workers": 4, "dataset_len": 32 * n * job.steps})
        out_lines.append(_ENC([schema.LOADER, 1_500, 0, -1, loader]))
        out_lines.append(_ENC([schema.COMM_HOOK, 1_600, 0, -1, {"name": "ddp default", "user": False}]))
        for i in range(nb):
            info = {"index": i, "bytes": param_bytes[i], "params": params[i]}
            out_lines.append(_ENC([schema.BUCKET, 1_700, 0, 0, info]))

    t = 2_000 + start.astype(np.int64)  # each rank's true clock now (µs since job start)
    seq = 1
    for k in range(job.steps):
        data = rng.integers(200, 1_500, n)
        if job.straggler is not None:
            data[job.straggler] += job.straggler_extra_us + int(rng.integers(0, 5_000))
        fwd = rng.integers(8_000, 10_000, n)
        bwd = rng.integers(15_000, 20_000, n)
        opt = rng.integers(1_000, 2_000, n)
        fwd_start = t + data
        bwd_start = fwd_start + fwd + 50
        ready = bwd_start[:, None] + (bwd[:, None] * (np.arange(nb)[None, :] + 1)) // (nb + 1)
        done = ready.max(axis=0) + 1_500 + np.arange(nb) * 300  # a bucket ends after the last rank
        done = np.maximum.accumulate(done)
        bwd_end = np.maximum(bwd_start + bwd, done[-1] + 20)
        opt_start = bwd_end + 30
        t_next = opt_start + opt + 20
        barrier = job.barrier_every and (k + 1) % job.barrier_every == 0
        if barrier:
            b_end = int(t_next.max()) + 200
        for r in range(n):
            out_lines = lines[r]
            base = -start[r]  # trace timestamps are µs since the rank's own anchor
            out_lines.append(_ENC([schema.DATA_WAIT, int(t[r] + base), int(data[r]), k - 1, 1]))
            out_lines.append(_ENC([schema.FORWARD, int(fwd_start[r] + base), int(fwd[r]), k, 1, 1, seq]))
            for i in range(nb):
                rd = int(ready[r, i])
                out_lines.append(
                    _ENC([schema.ALLREDUCE, rd + int(base), int(done[i]) - rd, k, i, param_bytes[i], seq + i])
                )
            out_lines.append(
                _ENC([schema.BACKWARD, int(bwd_start[r] + base), int(bwd_end[r] - bwd_start[r]), k])
            )
            out_lines.append(_ENC([schema.OPTIMIZER, int(opt_start[r] + base), int(opt[r]), k, "AdamW"]))
            if barrier:
                ts = int(t_next[r])
                out_lines.append(
                    _ENC(
                        [
                            schema.COLLECTIVE,
                            ts + int(base),
                            b_end - ts,
                            k,
                            "barrier",
                            0,
                            "WORLD",
                            n,
                            seq + nb,
                            0,
                        ]
                    )
                )
        seq += nb + (1 if barrier else 0)
        t = t_next if not barrier else np.full(n, b_end + 10)
    paths = []
    for r in range(n):
        lines[r].append(_ENC([schema.END, int(t[r] - start[r]), 0, job.steps - 1, {"reason": "exit"}]))
        run_dir = dirs[_host(job, r)]
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / schema.trace_filename(r)
        path.write_text("\n".join(lines[r]) + "\n", encoding="utf-8")
        paths.append(path)
    meta = {"schema": "ddpdoctor.run/1", "command": job.command, "exit_code": 0, "status": "finished"}
    for h, run_dir in dirs.items():
        (run_dir / "run.json").write_text(json.dumps(dict(meta, host=job.host_name.format(h))), "utf-8")
    return [dirs[h] for h in sorted(dirs)]
