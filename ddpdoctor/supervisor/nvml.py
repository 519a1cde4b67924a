"""GPU use through NVML: one sampler thread per node, in the supervisor, never in the ranks.

The supervisor reads NVML (``nvidia-ml-py``, module ``pynvml``) every ``interval_s`` and
appends one JSON line per GPU and sample to ``gpu-<host>.jsonl`` in the run directory (format
in ``trace/schema.py``). Its header anchors the monotonic clock to wall time as a rank's does;
ranks on the same host share that monotonic clock, so analysis places GPU samples on the
ranks' common time base through them.

Never breaks the patient: every NVML call is guarded. What NVML cannot give is written once to
the file (``unavailable``, ``unsupported``, ``nvml_error`` records) and said once in the
closing summary; nothing is printed during the run. The NVML module is injectable (``nvml=``)
so tests drive the sampler with a fake holding recorded values and scripted errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema

DEFAULT_INTERVAL_S = 0.5
MIN_INTERVAL_S = 0.05

# Errors that mean "this metric does not exist here", not "NVML broke".
_UNSUPPORTED = ("NotSupported", "NoPermission", "FunctionNotFound", "NotFound")
_REASONS = {
    "ImportError": "nvidia-ml-py (pynvml) is not installed",
    "LibraryNotFound": "NVML library not found (no NVIDIA driver on this host)",
    "DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NoPermission": "no permission to query NVML",
    "no_gpus": "NVML sees no GPU",
}


def error_code(exc: BaseException) -> str:
    """``NVMLError_NotSupported`` -> ``NotSupported`` (pynvml makes one class per error code)."""
    name = type(exc).__name__
    return name[len("NVMLError_") :] if name.startswith("NVMLError_") else name


def reason(code: str, message: str = "") -> str:
    """Plain words for why there are no GPU metrics."""
    return _REASONS.get(code) or f"NVML error {code}" + (f": {message}" if message else "")


def _import_pynvml() -> Any:
    with warnings.catch_warnings():  # the deprecated `pynvml` package warns on import
        warnings.simplefilter("ignore")
        import pynvml

    return pynvml


def _throttle(nv: Any, h: Any) -> dict[str, Any]:
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)  # the newer name
    fn = fn or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return {"throttle": int(fn(h))}


def _util(nv: Any, h: Any) -> dict[str, Any]:
    u = nv.nvmlDeviceGetUtilizationRates(h)
    return {"util": int(u.gpu), "mem_util": int(u.memory)}


def _memory(nv: Any, h: Any) -> dict[str, Any]:
    m = nv.nvmlDeviceGetMemoryInfo(h)
    return {"mem_used": int(m.used), "mem_total": int(m.total)}


# metric name -> reader returning the record's fields. One failing reader never costs the others.
METRICS: dict[str, Callable[[Any, Any], dict[str, Any]]] = {
    "util": _util,
    "memory": _memory,
    "power": lambda nv, h: {"power_w": round(nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 2)},
    "sm_clock": lambda nv, h: {"sm_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))},
    "temperature": lambda nv, h: {"temp_c": int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))},
    "throttle": _throttle,
}


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return None if value is None else str(value)


class Sampler:
    """The sampling thread: ``start()`` before the job, ``stop()`` after it; never raises."""

    def __init__(
        self,
        run_dir: Path,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        nvml: Any = None,
        host: str | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.interval_s = max(MIN_INTERVAL_S, float(interval_s))
        self.host = host or socket.gethostname()
        self.path = RunDir(self.run_dir).gpu(self.host)
        self._nvml = nvml
        self.nv: Any = None
        self.handles: list[Any] = []
        self.disabled: set[tuple[int, str]] = set()  # (gpu, metric) that failed before working
        self.working: set[tuple[int, str]] = set()  # (gpu, metric) read at least once
        self.last_procs: dict[int, list[list[Any]]] = {}
        self.stopped_by: str | None = None  # why sampling ended early, None while fine
        self.samples = 0
        self._fh: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddpdoctor-nvml", daemon=True)
        self.clock = clock  # monotonic ns; tests pass a scripted one
        self.wall_ns = time.time_ns()
        self.mono_ns = clock()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            return  # stuck inside an NVML call: leave the (daemon) thread, never the job
        self.close()

    def close(self) -> None:
        if self._fh is not None:
            self._write("end", {"reason": self.stopped_by or "stop", "samples": self.samples})
            with contextlib.suppress(Exception):
                self._fh.close()
            self._fh = None
        if self.nv is not None:
            with contextlib.suppress(Exception):
                self.nv.nvmlShutdown()
            self.nv = None

    def _loop(self) -> None:
        try:
            if not self.open():
                return
            while not self._stop.is_set():
                t0 = time.monotonic()
                if not self.sample_once():
                    return
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
        except Exception as exc:  # our own bug: say it once in the file and stop sampling
            self._fail("sampler_error", {"error": type(exc).__name__, "message": str(exc)[:300]})

    # -- the NVML boundary ----------------------------------------------------------------------

    def open(self) -> bool:
        """Load and initialise NVML and write the header; False (and a record) when unavailable."""
        gpus: list[dict[str, Any]] = []
        failure: dict[str, Any] | None = None
        try:
            nv = self._nvml if self._nvml is not None else _import_pynvml()
        except ImportError as exc:
            nv, failure = None, {"error": "ImportError", "message": str(exc)[:300]}
        if nv is not None:
            try:
                nv.nvmlInit()
                self.nv = nv
                count = int(nv.nvmlDeviceGetCount())
                self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
                if not count:
                    failure = {"error": "no_gpus", "message": ""}
            except Exception as exc:
                failure = {"error": error_code(exc), "message": str(exc)[:300]}
                self.handles = []
            for i, h in enumerate(self.handles):
                gpus.append({"index": i, **self._static(h)})
        header = {
            "schema": schema.GPU_SCHEMA,
            "host": self.host,
            "pid": os.getpid(),
            "wall_ns": self.wall_ns,
            "mono_ns": self.mono_ns,
            "interval_s": self.interval_s,
            "driver": self._call(lambda: _text(nv.nvmlSystemGetDriverVersion())) if self.nv else None,
            "gpus": gpus,
        }
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # as rank traces
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
        except OSError:
            self.stopped_by = "cannot write"
            return False
        self._line(["header", header])
        if failure is not None:
            failure["reason"] = reason(failure["error"], failure["message"])
            self._fail("unavailable", failure)
            return False
        self._flush()
        return True

    def _static(self, h: Any) -> dict[str, Any]:
        nv = self.nv
        out = {
            "name": self._call(lambda: _text(nv.nvmlDeviceGetName(h))),
            "uuid": self._call(lambda: _text(nv.nvmlDeviceGetUUID(h))),
            "mem_total": self._call(lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total)),
            "max_sm_clock_mhz": self._call(lambda: int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))),
            "power_limit_w": self._call(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
        }
        return {k: v for k, v in out.items() if v is not None}

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None

    def sample_once(self) -> bool:
        """Read every GPU once and append the records; False when sampling must stop."""
        ts = (self.clock() - self.mono_ns) // 1000
        for i, h in enumerate(self.handles):
            fields: dict[str, Any] = {"gpu": i}
            for metric, read in METRICS.items():
                got = self._read(i, metric, lambda read=read, h=h: read(self.nv, h), ts)
                if got is _STOP:
                    return False
                if got is not None:
                    fields.update(got)
            if len(fields) > 1:
                self._write("gpu", fields, ts)
            procs = self._read(i, "processes", lambda h=h: self._processes(h), ts)
            if procs is _STOP:
                return False
            if procs is not None and procs != self.last_procs.get(i):
                self.last_procs[i] = procs
                self._write("gpu_procs", {"gpu": i, "procs": procs}, ts)
        self.samples += 1
        self._flush()
        return True

    def _processes(self, h: Any) -> list[list[Any]]:
        """[[pid, bytes or None]...]: compute processes (CUDA contexts) on the GPU, MiB-rounded
        so the caching allocator's small moves do not rewrite the list every sample."""
        out = []
        for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h) or []:
            used = getattr(p, "usedGpuMemory", None)
            used = int(used) // 2**20 * 2**20 if isinstance(used, int) else None
            out.append([int(p.pid), used])
        return sorted(out, key=lambda p: p[0])

    def _read(self, gpu: int, metric: str, fn: Callable[[], Any], ts: int) -> Any:
        """One guarded NVML read: None if the metric is missing here, _STOP if sampling ends."""
        key = (gpu, metric)
        if key in self.disabled:
            return None
        try:
            value = fn()
        except Exception as exc:
            code = error_code(exc)
            what = {"gpu": gpu, "metric": metric, "error": code}
            if not type(exc).__name__.startswith("NVMLError"):
                self._fail("sampler_error", {**what, "message": str(exc)[:300]}, ts)
                return _STOP
            if key not in self.working or code in _UNSUPPORTED:
                # Never worked (or the driver now refuses it): this metric is missing here.
                self.disabled.add(key)
                self._write("unsupported", what, ts)
                return None
            self._fail("nvml_error", {**what, "message": str(exc)[:300]}, ts)
            return _STOP
        self.working.add(key)
        return value

    # -- the file -------------------------------------------------------------------------------

    def _fail(self, kind: str, info: dict[str, Any], ts: int | None = None) -> None:
        """Record why sampling stops (once) and stop; the job goes on."""
        if self.stopped_by is None:
            self.stopped_by = kind
            self._write(kind, info, ts)
            self._flush()
        self._stop.set()

    def _write(self, kind: str, info: dict[str, Any], ts: int | None = None) -> None:
        if ts is None:
            ts = (self.clock() - self.mono_ns) // 1000
        self._line([kind, int(ts), 0, -1, info])

    def _line(self, record: list[Any]) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError, TypeError):
            self._fh = None  # a full disk costs the GPU metrics, never the job

    def _flush(self) -> None:
        if self._fh is not None:
            try:
                self._fh.flush()
            except OSError:
                self._fh = None


_STOP = object()


def start_sampler(run_dir: Path, interval_s: float | None, nvml: Any = None) -> Sampler | None:
    """Start sampling (None when switched off); a failure here costs the GPU metrics only."""
    if interval_s is None:
        return None
    try:
        sampler = Sampler(run_dir, interval_s, nvml=nvml)
        sampler.start()
        return sampler
    except Exception:
        return None
