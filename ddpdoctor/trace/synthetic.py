"""Synthetic run directories in the real trace format, for benchmarks and renderer tests.

The model is a DDP step per rank: data wait, forward, backward whose buckets become ready in
turn and whose all-reduces finish only when the slowest rank's bucket is ready (so a straggler
makes every other rank wait at the gradient sync), then the optimizer; a barrier every
``barrier_every`` steps. Hosts can be given skewed wall clocks, recorded the way the clock
probe records them, to test alignment. Pure Python and numpy, no torch; each rank's events are
built as numpy records, kind by kind, so the scale benchmark's 82 million take seconds.
"""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import binfmt, schema


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
    barrier_every: int = 100  # 0: never
    seed: int = 0
    host_name: str = "node{}"  # formatted with the host index
    param_name: str = "layers.{}.weight"  # formatted with a parameter index
    command: list[str] = field(default_factory=lambda: ["torchrun", "--nproc_per_node", "8", "train.py"])

    @property
    def bucket_bytes(self) -> list[int]:
        return [4_000_000 * (i + 1) for i in range(self.buckets)]

    def barrier_after(self, steps: np.ndarray) -> np.ndarray:
        """Which steps end with a barrier."""
        if not self.barrier_every:
            return np.zeros(len(steps), bool)
        return (steps + 1) % self.barrier_every == 0


def step_model(job: SyntheticJob) -> dict[str, np.ndarray]:
    """Every rank's timings (true µs since the job's start): (steps, ranks) arrays, ``ready``
    (steps, ranks, buckets), ``done`` (steps, buckets), ``bar_end`` (steps,), ``t_end`` (ranks,)."""
    rng = np.random.default_rng(job.seed)
    n, nb, steps = job.ranks, job.buckets, job.steps
    start = rng.integers(0, 2_000, n)
    rtt = rng.integers(50, 300, n)
    shape = (steps, n)
    data = rng.integers(200, 1_500, shape)
    if job.straggler is not None:
        data[:, job.straggler] += job.straggler_extra_us + rng.integers(0, 5_000, steps)
    fwd = rng.integers(8_000, 10_000, shape)
    bwd = rng.integers(15_000, 20_000, shape)
    opt = rng.integers(1_000, 2_000, shape)
    t_all = np.empty(shape, np.int64)
    ready_all = np.empty((steps, n, nb), np.int64)
    done_all = np.empty((steps, nb), np.int64)
    bwd_end_all = np.empty(shape, np.int64)
    bar_end = np.zeros(steps, np.int64)
    barrier = job.barrier_after(np.arange(steps))
    t = 2_000 + start.astype(np.int64)  # each rank's true clock now
    frac = (np.arange(nb) + 1)[None, :]
    for k in range(steps):
        t_all[k] = t
        bwd_start = t + data[k] + fwd[k] + 50
        ready = bwd_start[:, None] + (bwd[k][:, None] * frac) // (nb + 1)
        done = ready.max(axis=0) + 1_500 + np.arange(nb) * 300  # a bucket ends after the last rank
        done = np.maximum.accumulate(done)
        bwd_end = np.maximum(bwd_start + bwd[k], done[-1] + 20)
        t_next = bwd_end + 30 + opt[k] + 20
        ready_all[k], done_all[k], bwd_end_all[k] = ready, done, bwd_end
        if barrier[k]:
            bar_end[k] = int(t_next.max()) + 200
            t = np.full(n, bar_end[k] + 10)
        else:
            t = t_next
    return {
        "start": start,
        "rtt": rtt,
        "t": t_all,
        "data": data,
        "fwd": fwd,
        "bwd_end": bwd_end_all,
        "ready": ready_all,
        "done": done_all,
        "opt": opt,
        "bar_end": bar_end,
        "t_end": t,
    }


# The job and its model while writing: set before forking the writers, which inherit them (the
# model of 1,024 ranks x 10,000 steps is about 0.7 GB: never pickled).
_WRITING: list[tuple[SyntheticJob, dict[str, np.ndarray]]] = []


def write_run(job: SyntheticJob, out: Path, processes: int = 1) -> list[Path]:
    """Write the job's traces (one run dir per host, like a multi-node run) under ``out``;
    ``processes`` > 1 writes hosts in parallel (forked)."""
    hosts = sorted({_host(job, r) for r in range(job.ranks)})
    _WRITING[:] = [(job, step_model(job))]
    try:
        if processes > 1 and len(hosts) > 1:
            with multiprocessing.get_context("fork").Pool(processes) as pool:
                dirs = pool.map(_write_host, [(h, str(out)) for h in hosts], chunksize=1)
        else:
            dirs = [_write_host((h, str(out))) for h in hosts]
    finally:
        _WRITING.clear()
    return [Path(d) for d in dirs]


def _host(job: SyntheticJob, rank: int) -> int:
    return rank // job.ranks_per_host


def _write_host(args: tuple[int, str]) -> str:
    host, out = args
    job, _ = _WRITING[0]
    run_dir = Path(out) / f"host{host}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(host * job.ranks_per_host, min(job.ranks, (host + 1) * job.ranks_per_host)):
        RunDir(run_dir).trace(rank).write_bytes(_rank_bytes(rank))
    meta = {"schema": "ddpdoctor.run/1", "command": job.command, "exit_code": 0, "status": "finished"}
    (run_dir / RunDir.RUN_META).write_text(json.dumps(dict(meta, host=job.host_name.format(host))), "utf-8")
    return str(run_dir)


def _rank_bytes(rank: int) -> bytes:
    """One rank's whole binary trace: header, interned values, metadata, then every event in
    one block, as the writer would have written them."""
    job, m = _WRITING[0]
    head = _head_records(job, m, rank)
    header = dict(head[0][1], layout=binfmt.layout())
    anchor = int(header["mono_ns"])
    strings = ["AdamW", "barrier", "WORLD", head[1][4]]  # the last: ddp_init's info
    out = [binfmt.json_block(binfmt.HEAD, header)]
    out += [binfmt.json_block(binfmt.STRING, [i, v]) for i, v in enumerate(strings)]
    out += [binfmt.json_block(binfmt.META, [k, anchor + ts * 1000, *r]) for k, ts, *r in head[2:]]
    init = _records(schema.DDP_INIT, anchor, [head[1][1]], [head[1][2]], [-1], [3])
    parts = [init] + _step_records(job, m, rank, anchor)
    kinds = {name: i + 1 for i, name in enumerate(schema.KINDS)}
    out.append(binfmt.events_block([(kinds[k], r.tobytes(), len(r)) for k, r in parts], 1, 1))
    end_ns = anchor + (int(m["t_end"][rank]) - int(m["start"][rank])) * 1000
    end = [schema.END, end_ns, 0, job.steps - 1, {"reason": "exit"}]
    out.append(binfmt.json_block(binfmt.META, end))
    return b"".join(out)


def _records(kind: str, anchor: int, ts: Any, dur: Any, step: Any, *fields: Any) -> tuple[str, np.ndarray]:
    """Records of ``kind`` from columns (µs since the anchor, as the reader gives them back)."""
    ts = np.asarray(ts, np.int64).ravel()
    rec = np.zeros(len(ts), schema.record_dtype(schema.KINDS[kind].spec))
    rec["t0"] = anchor + ts * 1000
    rec["t1"] = rec["t0"] + np.asarray(dur, np.int64).ravel() * 1000
    rec["step"] = np.broadcast_to(np.asarray(step).ravel() if np.ndim(step) else step, len(ts))
    for i, values in enumerate(fields):
        rec[f"f{i}"] = np.broadcast_to(np.asarray(values).ravel() if np.ndim(values) else values, len(ts))
    return kind, rec


def _head_records(job: SyntheticJob, m: dict[str, np.ndarray], rank: int) -> list[list]:
    """The records a rank writes before its first step: header, DDP init, clock, loader, buckets."""
    host = _host(job, rank)
    skew = job.host_skew_us.get(host, 0)
    n, nb, sizes = job.ranks, job.buckets, job.bucket_bytes
    header = {
        "schema": schema.SCHEMA,
        "rank": rank,
        "world_size": n,
        "local_rank": rank % job.ranks_per_host,
        "host": job.host_name.format(host),
        "pid": 1000 + rank,
        "wall_ns": (1_700_000_000_000_000 + int(m["start"][rank]) + skew) * 1000,
        "mono_ns": 5_000_000_000 + rank,
        "backend": "nccl",
        "torch": "2.13.0",
        "argv": job.command[3:] if len(job.command) > 3 else ["train.py"],
        "restart": 0,
    }
    options = {
        "find_unused_parameters": False,
        "broadcast_buffers": True,
        "gradient_as_bucket_view": False,
        "static_graph": False,
        "bucket_cap_mb": 25.0,
        "device_ids": [str(rank % job.ranks_per_host)],
        "buffers": 0,
    }
    init = {"module": "Net", "params": sum(sizes) // 4, "param_tensors": 2 * nb}
    init.update({"param_bytes": sum(sizes), "buckets": sizes, "seq": 0, "options": options})
    loader = {"id": 1, "sampler": "DistributedSampler", "epoch": 0, "shuffle": True, "batch_size": 32}
    loader.update({"drop_last": False, "num_workers": 4, "dataset_len": 32 * n * job.steps})
    records: list[list] = [[schema.HEADER, header], [schema.DDP_INIT, 0, 1_000, -1, init]]
    if job.record_clock:
        clock = {"offset_ns": -skew * 1000, "rtt_ns": int(m["rtt"][rank]) * 1000, "ref_rank": 0}
        records.append([schema.CLOCK, 1_000, 0, -1, clock])
    records.append([schema.LOADER, 1_500, 0, -1, loader])
    records.append([schema.COMM_HOOK, 1_600, 0, -1, {"name": "ddp default", "user": False}])
    for i in range(nb):
        params = [job.param_name.format(2 * i), job.param_name.format(2 * i + 1)]
        records.append([schema.BUCKET, 1_700, 0, 0, {"index": i, "bytes": sizes[i], "params": params}])
    return records


def _step_records(job: SyntheticJob, m: dict[str, np.ndarray], rank: int, anchor: int) -> list:
    """Every step's records, as the probes would write them: timestamps in µs since the
    rank's own anchor (its start)."""
    steps, nb, sizes = job.steps, job.buckets, job.bucket_bytes
    base = -int(m["start"][rank])
    k = np.arange(steps, dtype=np.int64)
    barrier = job.barrier_after(k)
    seq = 1 + k * nb + np.concatenate([[0], np.cumsum(barrier)[:-1]]).astype(np.int64)
    t, data, fwd, opt = (m[x][:, rank] for x in ("t", "data", "fwd", "opt"))
    fwd_start = t + data
    bwd_start = fwd_start + fwd + 50
    bwd_end = m["bwd_end"][:, rank]
    ready = m["ready"][:, rank, :]
    opt_start = bwd_end + 30
    t_next = opt_start + opt + 20
    ks = np.repeat(k, nb)
    bucket = np.tile(np.arange(nb), steps)
    out = [
        _records(schema.DATA_WAIT, anchor, t + base, data, k - 1, 1),
        _records(schema.FORWARD, anchor, fwd_start + base, fwd, k, 1, 1, seq, -1),
        _records(
            schema.ALLREDUCE,
            anchor,
            ready + base,
            m["done"] - ready,
            ks,
            bucket,
            np.asarray(sizes)[bucket],
            np.repeat(seq, nb) + bucket,
        ),
        _records(schema.BACKWARD, anchor, bwd_start + base, bwd_end - bwd_start, k, -1),
        _records(schema.OPTIMIZER, anchor, opt_start + base, opt, k, 0),
    ]
    b = barrier
    if b.any():
        bar = (t_next[b] + base, (m["bar_end"] - t_next)[b], k[b], 1, 0, 2, job.ranks, (seq + nb)[b], 0, -1)
        out.append(_records(schema.COLLECTIVE, anchor, *bar))
    return out


def append_records(path: Path, records: list[list[Any]]) -> None:
    """Append JSON-lines-style records (``[kind, ts_us, dur_us, step, *fields]``, or metadata
    ``[kind, ts_us, 0, step, {...}]``) to a binary trace, as the rank would have written them:
    for tests that extend a synthetic run with a rank's last moments."""
    dec = binfmt.decode(path.read_bytes(), events=False)
    layout = (dec.header or {}).get("layout") or []
    kinds = {name: (i + 1, spec) for i, (name, spec, _) in enumerate(layout)}
    sid = max(dec.strings, default=-1) + 1
    out = []
    for kind, ts, dur, step, *fields in records:
        if kind not in kinds:
            out.append(binfmt.json_block(binfmt.META, [kind, dec.anchor + ts * 1000, dur, step, *fields]))
            continue
        kid, spec = kinds[kind]
        row = np.zeros(1, schema.record_dtype(spec))
        row["t0"] = dec.anchor + ts * 1000
        row["t1"] = row["t0"] + dur * 1000
        row["step"] = step
        for i, code in enumerate(spec):
            value = fields[i] if i < len(fields) else -1
            if code in schema.INTERNED:
                out.append(binfmt.json_block(binfmt.STRING, [sid, value]))
                value, sid = sid, sid + 1
            row[f"f{i}"] = value
        out.append(binfmt.events_block([(kid, row.tobytes(), 1)], dec.seq_hi, dec.seq_hi))
    with open(path, "ab") as fh:
        fh.write(b"".join(out))
