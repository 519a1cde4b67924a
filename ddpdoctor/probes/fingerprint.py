"""Model fingerprints: does every rank still hold the same weights and buffers?

DDP keeps replicas equal by broadcasting rank 0's state at construction and all-reducing
gradients; weights loaded on one rank after wrapping, a parameter DDP never registered, or a
module left out of the wrapper break that silently. So each rank fingerprints every tensor of
every DDP model (parameters, then buffers): at construction, after the first optimizer step,
then after the optimizer step of every step ``s`` with ``(s + 1) % interval == 0``, and at exit.
The analysis compares the ranks (``analysis/misuse/divergence.py``); `top` does too while the job
runs, from two numbers per check that the trace writer's thread folds from each record into
the rank's status (``probes/recent.py``, ``live/replicas.py``).

The fingerprint of a tensor is a bit-level hash of its bytes: the elements viewed as integers
of their own width (float32 as int32, bf16 as int16...), widened to int64, multiplied by a
position weight (a fixed pseudo-random odd 64-bit number per position within a row of 65,536
elements, times an odd multiplier derived from the row's index, 1 for the first row), and
summed modulo 2**64; folded to 53 bits (the top 11 xor-ed into the low ones) so every trace
encoding holds it exactly. Why this one:

- exact: integer sums wrap the same whatever the order of the reduction (threads, kernels,
  devices), so bit-identical tensors give bit-identical fingerprints on every rank;
- complete: changing any one element changes the sum by ``odd weight * delta``, never 0
  modulo 2**64; with elements of at most 32 bits (float32, bf16, fp16) that change stays in
  the low 53 bits, so a single changed bit is always seen; otherwise, and for several
  changes, two states collide with probability about 2**-53; a permutation changes
  positions, hence weights (float sums of the values, or norms, miss both permutations and
  exact cancellations);
- cheap: three passes over the tensor (widen, multiply, sum) in chunks of 512 Ki elements
  (4 MiB of scratch), 1.1-3.5 ms per million float32 parameters on one CPU core plus
  13-40 µs per tensor (a quiet to a busy shared VM, ``benchmarks/fingerprint_cost.py``),
  three kernels per tensor on a GPU.

Cost stays at most ``BUDGET`` (0.1 %) of step time: the interval is the smallest power of two
at least ``MIN_INTERVAL`` that makes (a check's cost: the median of the last three) /
(interval x mean step time since the last check) fit, measured on each rank. Ranks may pick
different intervals, but powers of two keep their checks aligned: every multiple of the
larger interval is a check on every rank.
``DDPDOCTOR_FINGERPRINT`` = a number of steps fixes the interval; ``off`` turns this off.

On a GPU the hashes are computed on the device, on the current stream, into one int64 tensor
that is copied ``non_blocking`` into pinned host memory behind a CUDA event; the record is
written once ``event.query()`` says the copy is done (checked after later optimizer steps and
at exit). The training thread never waits for the device.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from collections import deque
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes.optsettings import Notes
from ddpdoctor.trace import schema

PROBE = "fingerprint"
ENV = "DDPDOCTOR_FINGERPRINT"  # "auto" (default), "off", or a fixed interval in steps
BUDGET = 0.001
MIN_INTERVAL = 64
MAX_INTERVAL = 1 << 16
ROW = 1 << 16  # positions with their own weight
CHUNK_ROWS = 8  # rows hashed at once: 4 MiB of int64 scratch, mostly in cache
MASK = (1 << 53) - 1
MAX_PENDING = 16  # device reads in flight at most; a check beyond is skipped
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_now = time.perf_counter_ns

_INT_OF_WIDTH: dict[int, Any] = {}
_WEIGHTS: dict[Any, Any] = {}  # device -> the ROW position weights


def _weights(device: Any) -> Any:
    import torch

    w = _WEIGHTS.get(device)
    if w is None:
        gen = torch.Generator().manual_seed(0x5EED)  # the same numbers on every rank
        w = torch.randint(-(1 << 62), 1 << 62, (ROW,), generator=gen, dtype=torch.int64)
        w = _WEIGHTS[device] = w.bitwise_or_(1).to(device)
    return w


def tensor_hash(t: Any) -> Any:
    """A 0-d int64 tensor on ``t``'s device: the hash described above (not yet masked)."""
    import torch

    if not _INT_OF_WIDTH:
        _INT_OF_WIDTH.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    flat = t.detach().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    v = flat.view(_INT_OF_WIDTH[flat.element_size()])
    w = _weights(v.device)
    n, rows = v.numel(), v.numel() // ROW
    if n <= ROW:  # most tensors: three operations (the copy keeps the model's values intact)
        return v.to(torch.int64, copy=True).mul_(w[:n]).sum()
    total = None
    for r0 in range(0, rows, CHUNK_ROWS):
        r1 = min(rows, r0 + CHUNK_ROWS)
        block = v[r0 * ROW : r1 * ROW].view(r1 - r0, ROW).to(torch.int64, copy=True).mul_(w).sum(1)
        rw = torch.arange(r0, r1, dtype=torch.int64, device=v.device).mul_(_GOLDEN).add_(1).bitwise_or_(1)
        part = block.mul_(rw).sum()
        total = part if total is None else total + part
    if n > rows * ROW:
        tail = v[rows * ROW :].to(torch.int64, copy=True).mul_(w[: n - rows * ROW]).sum()
        total = total + tail * row_weight(rows)
    return total


def row_weight(row: int) -> int:
    """The odd multiplier of row ``row`` (1 for row 0), as a signed int64."""
    rw = (row * _GOLDEN + 1) % (1 << 64) | 1
    return rw - (1 << 64) if rw >= 1 << 63 else rw


def fold(h: int) -> int:
    """A 64-bit hash (signed, as torch holds it) in 53 bits: the top 11 xor-ed into the rest."""
    u = h & ((1 << 64) - 1)
    return (u ^ (u >> 53)) & MASK


def hashes(tensors: list[Any]) -> list[int]:
    """Every tensor's fingerprint, computed here and now (CPU, tests, the benchmark)."""
    return [fold(int(tensor_hash(t))) for t in tensors]


class _Model:
    """One DDP model as fingerprinted: the wrapper (weakly), its index, what DDP registered."""

    def __init__(self, ddp: Any, index: int, registered: list[Any]) -> None:
        self.ref = weakref.ref(ddp)
        self.index = index
        self.registered = {id(p) for p in registered}  # the Reducer's parameters
        self.names: list[str] = []  # as last recorded
        self.exited = False  # its final state is checked (once: at exit, or as its wrapper went)


def interval_for(cost_ns: float, step_ns: float) -> int:
    """Steps between checks: the smallest power of two, ``MIN_INTERVAL`` at least, at which a
    check of ``cost_ns`` costs at most ``BUDGET`` of steps of ``step_ns``."""
    need = cost_ns / (BUDGET * max(step_ns, 1.0))
    interval = MIN_INTERVAL
    while interval < need and interval < MAX_INTERVAL:
        interval *= 2
    return interval


class Fingerprints:
    """One rank's fingerprinting: the schedule, the models, the device reads in flight."""

    def __init__(self, collector: Any, cuda: Any = None, interval: int | None = None) -> None:
        self.c = collector
        self.cuda = cuda  # torch.cuda (or a test's stand-in) once a model is on a GPU
        self.fixed = interval
        self.interval = interval or MIN_INTERVAL
        self.models: list[_Model] = []
        self.next_due = 0  # the first optimizer step
        self.checked = -2  # the step checked last
        self.stepped = -2  # the last step whose optimizer step ran (the exit check wants it)
        self.costs: deque[int] = deque(maxlen=3)
        self.last = (0, 0)  # (step, perf ns) of the last check
        self.opt_checked: set[int] = set()
        self.settings = Notes()  # numbers the optimizers too
        # (event, host copy, device tensor, (record, values so far, indices the copy fills))
        self.pending: deque[tuple[Any, Any, Any, tuple]] = deque()
        import torch

        self.compiling = torch.compiler.is_compiling  # looked up once: read after every step

    def add(self, ddp: Any, index: int, registered: list[Any]) -> None:
        model = _Model(ddp, index, registered)
        # A new wrapper of a module already wrapped (re-wrapped after unfreezing layers, say)
        # supersedes the old one, which may live on in a reference cycle until the collector
        # runs: its registered parameters are no longer what the job syncs.
        module = getattr(ddp, "module", None)
        self.models = [m for m in self.models if (old := m.ref()) is not None and old.module is not module]
        self.models.append(model)
        # A wrapper that dies before the interpreter does (a main() that returns) leaves no model
        # for the exit check: check its module as the wrapper goes (the finalizer holds only the
        # module, which the wrapper holds anyway, and lets it go once it has run).
        weakref.finalize(ddp, self.released, model, module).atexit = False
        self.check([model], "init")
        if not self.last[1]:  # the first step's time, construction included, sets the first interval
            self.last = (self.c.step, _now())

    def after_step(self, optimizer: Any) -> None:
        """After an optimizer step: check when due (one comparison otherwise). Nothing while
        torch.compile traces the step (nothing to hash), asked only when there is work: the
        question is two Python frames. The C post hook (``_fast_opt.c``'s ``fingerprint``) takes
        the cheap path itself (neither due nor pending: note ``stepped``) and calls this
        otherwise: a change to when a check is due changes both."""
        step = self.c.step
        due = step >= self.next_due or step == self.checked
        if (due or self.pending) and self.compiling():
            return
        if self.pending:
            self.poll()
        self.stepped = step
        if not due:
            return
        if step == self.checked:  # another optimizer of the same step
            self._check_optimizer(optimizer)
            return
        self.checked, self.opt_checked = step, set()
        t0 = _now()
        self.models = [m for m in self.models if m.ref() is not None]  # a wrapper rebuilt each epoch
        self.check(self.models, "step")
        self._check_optimizer(optimizer)
        self._schedule(step, _now() - t0)

    def _schedule(self, step: int, cost_ns: int) -> None:
        self.costs.append(cost_ns)
        last_step, last_ns = self.last
        self.last = (step, _now())
        if self.fixed is None and step > last_step and last_ns:
            self.interval = interval_for(self.cost(), (self.last[1] - last_ns) / (step - last_step))
        self.next_due = self.due_after(step)

    def fix(self, interval: int) -> None:
        """Check every ``interval`` steps from now on (as ``DDPDOCTOR_FINGERPRINT`` would)."""
        self.fixed = self.interval = interval
        self.next_due = self.due_after(self.c.step)

    def due_after(self, step: int) -> int:
        """The next step after ``step`` that the interval makes a check."""
        return ((step + 1) // self.interval + 1) * self.interval - 1

    def cost(self) -> int:
        """A check's cost (ns): the median of the last three, so neither one preempted check nor
        one lucky one sets the interval."""
        return sorted(self.costs)[len(self.costs) // 2] if self.costs else 0

    def released(self, model: _Model, module: Any) -> None:
        """A model's wrapper was freed: its final state, as ``at_exit`` would have checked it."""
        c = self.c
        if model not in self.models or PROBE in c.disabled or module is None:
            return  # superseded by a new wrapper of the module, or fingerprinting is off
        try:
            step = c.step
            if c.live and not model.exited and step == self.stepped and step >= 0:
                model.exited = True
                self._check_module(model, module, "exit")
                self.settings.note_all(self)
        except Exception as exc:
            c.fail(PROBE, exc)

    def check(self, models: list[_Model], at: str) -> None:
        for model in models:
            ddp = model.ref()
            if ddp is not None:
                self._check_module(model, ddp.module, at)

    def _check_module(self, model: _Model, module: Any, at: str) -> None:
        """Hash one model's parameters and buffers, and name those it trains outside DDP."""
        named = list(module.named_parameters()) + list(module.named_buffers())
        n_params = sum(1 for _ in module.parameters())
        info: dict[str, Any] = {"model": model.index, "at": at}
        names = [n for n, _ in named]
        if names != model.names:
            model.names = names
            info.update(names=names, n_params=n_params, numels=[t.numel() for _, t in named])
        unsynced = [
            i
            for i, (_, p) in enumerate(named[:n_params])
            if p.requires_grad and p.grad is not None and id(p) not in model.registered
        ]
        if unsynced:
            info["unsynced"] = unsynced
        # Each parameter's version counter: every in-place write moves it (an optimizer step, a
        # copy_ under no_grad), so ranks that ran the same steps moved it alike unless one wrote
        # the weights on its own (analysis/misuse/divergence.py)
        info["versions"] = [p._version for _, p in named[:n_params]]
        # And each gradient's: after DDP's all-reduce every rank holds the same gradients, written
        # alike; one a rank scaled or clipped in place on its own moved further there.
        info["grad_versions"] = [-1 if p.grad is None else p.grad._version for _, p in named[:n_params]]
        self._submit([t for _, t in named], info)

    def _check_optimizer(self, optimizer: Any) -> None:
        """The optimizer's settings when they changed (``optsettings.py``), and the parameters it
        trains that belong to no DDP model: never all-reduced."""
        key = self.settings.key_of(optimizer)
        if key in self.opt_checked:
            return
        self.opt_checked.add(key)
        self.settings.note(self, optimizer, "check")
        inside = set()
        for model in self.models:
            ddp = model.ref()
            if ddp is not None:
                inside.update(id(p) for p in ddp.module.parameters())
        outside, names = [], []
        for g, group in enumerate(optimizer.param_groups):
            given = group.get("param_names") or []
            for i, p in enumerate(group["params"]):
                if id(p) not in inside:
                    outside.append(p)
                    names.append(given[i] if i < len(given) else f"param_groups[{g}][{i}] {list(p.shape)}")
        if outside:
            info = {"model": -1, "optimizer": key, "at": "step", "names": names, "n_params": len(names)}
            info.update(numels=[p.numel() for p in outside], unsynced=list(range(len(outside))))
            self._submit(outside, info)

    def _submit(self, tensors: list[Any], info: dict[str, Any]) -> None:
        """Hash ``tensors`` and write the record: at once for host tensors; for device tensors
        once their hashes have been copied back (``poll``). Tensors of other layouts (sparse)
        are not hashed: -1."""
        import torch

        step, t0 = self.c.step, time.monotonic_ns()
        values: list[Any] = [tensor_hash(t) if t.layout == torch.strided else -1 for t in tensors]
        record = (schema.FINGERPRINT, t0, time.monotonic_ns(), step, info)
        on_device = [
            i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device.type != "cpu"
        ]
        if self.cuda is None and on_device:
            self.cuda = torch.cuda
        if self.cuda is None or len(self.pending) >= MAX_PENDING:
            if self.cuda is not None:  # reads stuck behind the device: skip, never wait
                return
            info["values"] = [fold(int(v)) for v in values]
            self.emit(record)
            return
        if not on_device:  # a test's stand-in for CUDA: host tensors take the device path
            on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        later = set(on_device)
        host_values = [0 if i in later else fold(int(v)) for i, v in enumerate(values)]
        device = values[on_device[0]].device
        stacked = torch.stack([values[i] for i in on_device if values[i].device == device])
        host = torch.empty(len(stacked), dtype=torch.int64, pin_memory=device.type == "cuda")
        host.copy_(stacked, non_blocking=True)
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(device))
        where = [i for i in on_device if values[i].device == device]
        self.pending.append((event, host, stacked, (record, host_values, where)))

    def poll(self) -> int:
        """Write the device fingerprints whose copy has completed (never waits)."""
        done = 0
        while self.pending and self.pending[0][0].query():
            _, host, _, (record, values, where) = self.pending.popleft()
            for i, v in zip(where, host.tolist(), strict=True):
                values[i] = fold(v)
            record[4]["values"] = values
            self.emit(record)
            done += 1
        return done

    def emit(self, record: tuple) -> None:
        self.c.events += 1
        self.c.put(record)

    def at_exit(self, wait_s: float = 2.0) -> None:
        """Each model's final state (unless the rank stopped inside a step, or it is dying of an
        uncaught exception: states no other rank need share), then the reads in flight. Taken
        even where the last step was checked: every rank that ends after a whole step has an
        exit check to compare, whatever interval its own step times chose."""
        step = self.c.step
        crashed = getattr(sys, "last_value", None) is not None  # set before atexit on a crash
        if self.c.live and not crashed and step == self.stepped and step >= 0:
            final = [m for m in self.models if not m.exited and m.ref() is not None]
            for model in final:
                model.exited = True
            if final:
                self.check(final, "exit")
                self.settings.note_all(self)
        deadline = time.monotonic() + wait_s
        while self.pending and time.monotonic() < deadline:
            if not self.poll():
                time.sleep(0.002)


ACTIVE: Fingerprints | None = None


def interval_setting() -> int | None:
    """The fixed interval from the environment, None for auto, 0 for off."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("off", "0", "no"):
        return 0
    return max(1, int(raw))


def on_ddp_init(c: Any, ddp: Any, index: int, registered: list[Any]) -> None:
    """Fingerprint a DDP model right after its constructor's broadcast."""
    global ACTIVE
    if PROBE in c.disabled:
        return
    try:
        if ACTIVE is None or ACTIVE.c is not c:
            fixed = interval_setting()
            if fixed == 0:
                c.disabled.add(PROBE)
                return
            ACTIVE = Fingerprints(c, None, fixed)
            atexit.register(_exit, ACTIVE)
        ACTIVE.add(ddp, index, registered)
    except Exception as exc:
        c.fail(PROBE, exc)


def after_step(c: Any, optimizer: Any) -> None:
    fp = ACTIVE
    if fp is None or fp.c is not c or PROBE in c.disabled:
        return
    try:
        fp.after_step(optimizer)
    except Exception as exc:
        c.fail(PROBE, exc)


def _exit(fp: Fingerprints) -> None:
    c = _c.ACTIVE
    if c is not fp.c or PROBE in c.disabled:
        return
    try:
        fp.at_exit()
    except Exception as exc:
        c.fail(PROBE, exc)
