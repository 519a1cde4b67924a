"""The newest NVML sample of each GPU, read from the end of ``gpu-<host>.jsonl`` as it grows.

`top` refreshes every second: it reads only the bytes appended since its last look (the tail,
on the first look), never the whole file, and keeps the newest utilisation per GPU and which
processes each GPU runs (``gpu_procs`` is written only when that list changes, so it is kept
from earlier looks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor.probes.status import RankStatus
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema

FIRST_LOOK_BYTES = 256 * 1024


@dataclass
class GpuTail:
    path: Path
    offset: int = -1
    util: dict[int, float] = field(default_factory=dict)  # gpu index -> % in the newest sample
    mem_used: dict[int, int] = field(default_factory=dict)
    pid_gpu: dict[int, int] = field(default_factory=dict)  # process id -> gpu index
    unavailable: str = ""

    @property
    def host(self) -> str:
        return RunDir.gpu_host(self.path)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                start = self.offset if 0 <= self.offset <= size else max(0, size - FIRST_LOOK_BYTES)
                fh.seek(start)
                data = fh.read(size - start)
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            self.offset = start
            return
        self.offset = start + end + 1
        for line in data[: end + 1].splitlines():
            self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            rec = json.loads(line)
        except ValueError:
            return  # the first line of a tail read starts mid-record
        if not isinstance(rec, list) or len(rec) < 5 or not isinstance(rec[4], dict):
            return
        kind, info = rec[0], rec[4]
        gpu = info.get("gpu")
        if kind == schema.GPU and isinstance(gpu, int):
            if isinstance(info.get("util"), (int, float)):
                self.util[gpu] = float(info["util"])
            if isinstance(info.get("mem_used"), int):
                self.mem_used[gpu] = info["mem_used"]
        elif kind == schema.GPU_PROCS and isinstance(gpu, int):
            self.pid_gpu = {p: g for p, g in self.pid_gpu.items() if g != gpu}
            for proc in info.get("procs") or []:
                if isinstance(proc, list) and proc and isinstance(proc[0], int):
                    self.pid_gpu[proc[0]] = gpu
        elif kind == "unavailable":
            self.unavailable = str(info.get("reason") or info.get("error") or "unavailable")


class GpuTails:
    """Every node's GPU file across the run directories, polled together."""

    def __init__(self) -> None:
        self.tails: dict[Path, GpuTail] = {}

    def poll(self, run_dirs: list[Path]) -> None:
        for run_dir in run_dirs:
            for path in RunDir(run_dir).gpu_files():
                self.tails.setdefault(path, GpuTail(path))
        for tail in self.tails.values():
            tail.poll()

    def for_rank(self, status: RankStatus) -> dict[str, Any] | None:
        """{"gpu", "util"} of the GPU this rank runs on (by its pid, else its local rank)."""
        host, pid = status.host, status.pid
        for tail in self.tails.values():
            if host and tail.host != host:
                continue
            gpu = tail.pid_gpu.get(pid) if isinstance(pid, int) else None
            if gpu is None and isinstance(status.local_rank, int) and status.local_rank in tail.util:
                gpu = status.local_rank
            if gpu is not None and gpu in tail.util:
                return {"gpu": gpu, "util": tail.util[gpu], "mem_used": tail.mem_used.get(gpu)}
        return None
