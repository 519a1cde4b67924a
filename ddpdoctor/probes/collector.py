"""The per-rank collector: the one object every probe records into.

It exists only in a process that has become a rank (called ``init_process_group``); every
probe checks ``collector.ACTIVE`` first and passes straight through when it is None, so the
same patched torch is inert in torchrun's agent, in DataLoader workers and in forked children.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes import fastpath, guard, liveness
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.writer import TraceWriter

_now = time.monotonic_ns
# phase, op, sequence number at entry, t0 (monotonic ns)[, group name, group size, bytes, group]:
# the group fields let the supervisor prove a hang (ranks of one group that disagree).
Progress = tuple[Any, ...]
_RING_ENV = "DDPDOCTOR_RING"  # "0": no memory-mapped ring (trace/ring.py) beside the trace

ACTIVE: Collector | None = None
INITIALISED = False  # init_process_group succeeded in this process (recorded or not)
_activation_lock = threading.Lock()


# The fields the probes read and write on every event (the step, the live progress, the event
# count, the writer, the record kinds...): members of a C object where the C module is built
# (``_fast_state.c``), which its probes reach without a dict lookup; set below as attributes.
_State: Any = getattr(fastpath.module(), "State", object)


class Collector(_State):
    """Holds one rank's writer and the little state the probes share (step, open phases)."""

    def __init__(self, run_dir: str, header: dict[str, Any], default_pg: Any) -> None:
        self.run_dir = run_dir
        self.rank: int = header["rank"]
        self.default_pg = default_pg
        self.step = -1
        self.awaiting_backward = False  # a grad-mode DDP forward has not had its backward yet
        # The pace model's last forward ran under no_sync(): the next one is the same step's
        # next micro-batch (gradient accumulation), not a new step.
        self.accumulating = False
        self.optimizer_t0 = 0
        self.inputs_at = 0  # the next training step whose forward inputs are counted (data.py)
        self.optimizer_outer: Any = None  # weakref to the optimizer whose step began (optimizer.py)
        self.in_bucket_hook = False  # inside a gradient bucket's comm hook (ddp.py)
        self.native: list[Any] = []  # model states whose buckets the C++ timer times (commhook.py)
        # The C++ timer's set_step once one times a model: the forward probes call it at each new
        # step (a pybind function: no Python frame between the probe and the timer's atomic).
        self.native_step: Any = None
        self.native_settling = False  # drain the C++ timer after each backward (commhook.py)
        self.native_quiet = 0  # backwards in a row whose drain found no new bucket layout
        self.ddp_models = 0  # DistributedDataParallel instances constructed so far
        self.step_model: Any = None  # the DDP model state of the last grad-mode forward
        # The model whose grad-mode forwards count steps: the first to run one since the last
        # DDP construction. With a generator and a discriminator (or a teacher) each iteration
        # runs several DDP forwards; counting them all would split one step into several.
        self.pace_model: Any = None
        self.disabled: set[str] = set()
        self.groups: dict[int, tuple[Any, str, int]] = {}  # id(process group) -> (it, name, size)
        # Live progress, published by the writer thread as status-rank{R}.json (liveness.py):
        # (phase, op, seq at entry, t0 monotonic ns) of the sync point the rank is inside, or None.
        self.progress: Progress | None = None
        self.pid = os.getpid()
        self.closed = False
        self.events = 0  # events recorded so far: a counter the supervisor watches move
        self.last_step_ns = 0  # entry of the last training forward
        self.max_step_ns = 0  # the slowest step seen (forward entry to next forward entry)
        flush, capacity = _env.writer_settings()
        self.writer = TraceWriter(
            RunDir(run_dir).trace(self.rank, header.get("restart", 0)),
            header,
            capacity=capacity,
            flush_interval=flush,
            on_error=self._writer_failed,
            ring=os.environ.get(_RING_ENV) != "0",
            packer=fastpath.packer,
            seqs=fastpath.seqs,
        )
        if self.writer.ring_error is not None:
            why = self.writer.ring_error
            _log_error(run_dir, f"rank {self.rank}: no crash-safe ring, recording as before: {why}")
        self.put = self.writer.put
        self.record = self.writer.record
        self.pack = self.writer.pack  # a record whose fields are interned already
        # The hottest probe's: its kind, and per call site and tensor shape what its records
        # share (probes/collectives.py), so that a call in a loop costs no lookups.
        self.collective_kind = self.writer.kind(schema.COLLECTIVE)
        self.collective_pack = (self.collective_kind.pack_into, self.collective_kind.kid)
        self.forward_kind = self.writer.kind(schema.FORWARD)  # the DDP forward's, packed as is
        self.backward_kind = self.writer.kind(schema.BACKWARD)  # and its backward's
        self.optimizer_kind = self.writer.kind(schema.OPTIMIZER)
        self.bucket_kind = self.writer.kind(schema.ALLREDUCE)  # the C++ timer's notes (commhook.py)
        self.calls: dict[tuple, tuple] = {}

    @property
    def live(self) -> bool:
        """Still recording in this process (not closed, not a forked child's inherited copy)."""
        return not self.closed and self.pid == os.getpid()

    def enter(self, phase: LivePhase, op: str, seq: int, t0: int = 0, group: tuple = ()) -> Progress | None:
        """Enter a sync point (a call where the rank may wait for its peers): its status file
        shows it inside (phase, op, seq) until ``leave(<what this returned>, ...)``, which a
        probe calls in a ``finally``. Two plain calls: a context manager costs twice as much.
        ``group``: (name, size, bytes, process group) of the collective, for the hang proof."""
        prev = self.progress
        self.progress = (phase, op, seq, t0 or _now(), *group)
        return prev

    def leave(self, prev: Progress | None, kind: str | None, *fields: Any) -> None:
        """Leave the sync point entered last and record its span (none when ``kind`` is None)."""
        progress = self.progress
        t0 = progress[3] if progress is not None else _now()
        self.progress = prev
        if kind is not None:
            self.events += 1
            self.record(kind, t0, _now(), self.step, fields)

    def raised(self, prev: Progress | None, kind: str, *fields: Any) -> None:
        """Leave the sync point entered last by an exception: record it as raised (a ``raised``
        record naming the span), never as a span of ``kind``: it did not complete, and a
        collective that waited seconds for a dead peer is no step's time."""
        t0 = self.progress[3] if self.progress is not None else _now()
        self.progress = prev
        t1 = _now()
        self.events += 1
        info = {"kind": kind, "fields": list(fields), "dur_us": (t1 - t0) // 1000}
        self.put((schema.RAISED, t0, t1, self.step, info))

    def in_collective(self) -> bool:
        """Inside a recorded collective or a bucket's comm hook: collectives called there
        (all_gather_object -> all_gather, a hook's all_reduce) are part of it, not the user's."""
        return self.in_bucket_hook or (self.progress is not None and self.progress[0] is LivePhase.COLLECTIVE)

    def emit(self, kind: str, t0: int, t1: int, *fields: Any) -> None:
        """Record one event (monotonic ns) at the current step."""
        self.events += 1
        self.record(kind, t0, t1, self.step, fields)

    def progress_seq(self) -> int:
        """The default group's collective sequence number now, -1 if unknown (never raises)."""
        try:
            return int(self.default_pg._get_sequence_number_for_group())
        except Exception as exc:
            guard.passthrough(exc)
            return -1

    def meta(self, kind: str, info: dict[str, Any]) -> None:
        self.writer.meta(kind, self.step, info)

    def fail(self, probe: str, exc: BaseException) -> None:
        """A probe broke: log it once in the run dir and switch that probe off for good. What
        a signal handler raised inside the probe is the program's: it goes on up (guard.py)."""
        guard.passthrough(exc)
        if probe in self.disabled:
            return
        self.disabled.add(probe)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            self.meta(schema.PROBE_ERROR, {"probe": probe, "error": error})
            where = "".join(traceback.format_tb(exc.__traceback__)[-3:])
            _log_error(self.run_dir, f"rank {self.rank}: probe '{probe}' switched off: {error}\n{where}")
        except Exception:
            pass

    def _writer_failed(self, exc: BaseException) -> None:
        self.disabled.add("*")
        _log_error(self.run_dir, f"rank {self.rank}: trace writing stopped: {exc}")
        _warn_once(f"ddpdoctor: rank {self.rank} stopped recording ({exc}); training continues")

    def close(self, reason: str = "exit") -> None:
        if self.native:
            from ddpdoctor.probes import commhook

            commhook.drain(self)
        self.closed = True
        self.writer.close(reason)


def _log_error(run_dir: str, text: str) -> None:
    try:
        with open(os.path.join(run_dir, RunDir.ERROR_LOG), "a", encoding="utf-8") as fh:
            fh.write(text.rstrip() + "\n")
    except OSError:
        pass


_warned = False


def _warn_once(text: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        with contextlib.suppress(Exception):
            sys.stderr.write(text + "\n")


def activate(dist: Any) -> Collector | None:
    """Make this process a recorded rank; called right after ``init_process_group`` succeeds.

    Returns None (and records nothing) in DataLoader workers, when disabled, or when no run
    directory can be agreed on. Never raises.
    """
    global ACTIVE, INITIALISED
    INITIALISED = True
    with _activation_lock:
        if ACTIVE is not None:
            return ACTIVE
        try:
            if os.environ.get(_env.DISABLE) == "1" or _in_dataloader_worker():
                return None
            run_dir = _agree_run_dir(dist)
            header = _header(dist)
            pg = dist.distributed_c10d._get_default_group()
            ACTIVE = Collector(run_dir, header, pg)
        except Exception as exc:
            rank = os.environ.get("RANK", "?")
            run_dir = os.environ.get(_env.RUN_DIR)
            if run_dir:
                _log_error(run_dir, f"rank {rank}: not recorded: {exc}")
            _warn_once(f"ddpdoctor: rank {rank} not recorded ({exc}); training continues")
            return None
        _install_exit_handlers(ACTIVE)
        try:
            liveness.install(ACTIVE)
        except Exception as exc:
            ACTIVE.fail("liveness", exc)
        try:
            from ddpdoctor.probes import lastwords

            lastwords.install(ACTIVE)
        except Exception as exc:
            ACTIVE.fail("lastwords", exc)
        _measure_clock(dist, ACTIVE)
        return ACTIVE


def _measure_clock(dist: Any, collector: Collector) -> None:
    """This rank's clock offset to rank 0, so traces from several hosts line up (bounded)."""
    try:
        from ddpdoctor.probes import clock

        clock.measure(dist, collector)
    except Exception as exc:
        collector.fail("clock", exc)


def deactivate(reason: str = "exit") -> None:
    """Close the trace and stop recording (tests, and ``ddpdoctor.instrument`` users)."""
    global ACTIVE
    collector, ACTIVE = ACTIVE, None
    if collector is not None:
        collector.close(reason)


def _in_dataloader_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None
    except Exception as exc:
        guard.passthrough(exc)
        return False


def _agree_run_dir(dist: Any) -> str:
    """The run dir from the supervisor's environment, else one that rank 0 picks and shares."""
    run_dir = os.environ.get(_env.RUN_DIR)
    if not run_dir:
        store = dist.distributed_c10d._get_default_store()
        key = "ddpdoctor/run_dir"
        if dist.get_rank() == 0:
            from ddpdoctor.rundir import new_run_dir

            store.set(key, str(new_run_dir(None)))
        run_dir = store.get(key).decode()
        os.environ[_env.RUN_DIR] = run_dir
    os.makedirs(run_dir, exist_ok=True)
    return run_dir


def _header(dist: Any) -> dict[str, Any]:
    import torch

    local_rank = os.environ.get("LOCAL_RANK")
    return {
        "schema": schema.SCHEMA,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(local_rank) if local_rank is not None else None,
        "host": socket.gethostname(),
        "node": _int_env("GROUP_RANK"),  # the launcher's node rank (torchrun), None elsewhere
        "pid": os.getpid(),
        "wall_ns": time.time_ns(),
        "mono_ns": time.monotonic_ns(),
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        "argv": list(sys.argv),
        # Frameworks that drive DDP for the user: the diagnosis gives fixes in their terms.
        "frameworks": [m for m in ("lightning", "pytorch_lightning", "accelerate") if m in sys.modules],
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _install_exit_handlers(collector: Collector) -> None:
    """Close the trace at exit; go quiet in forked children.

    No SIGTERM handler on purpose: a Python handler only runs once the main thread is back
    in the interpreter, so a rank blocked in a collective would ignore torchrun's SIGTERM
    until torchrun's 30 s SIGKILL. The writer's frequent flushes bound what a signal loses.
    """
    atexit.register(collector.close)
    os.register_at_fork(after_in_child=_forget_in_child)


def _forget_in_child() -> None:
    """A forked child (DataLoader worker, user fork) inherits the collector: never record there."""
    global ACTIVE
    ACTIVE = None
