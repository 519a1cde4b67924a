"""A few numbers about the last steps, for `ddpdoctor top`: kept by the trace writer's thread.

`top` must read only the small status files, yet show steps/s, the last collective and how late
each rank arrives at the gradient sync. The writer thread already sees every event as it
serialises it, so it feeds the few kinds needed here (training forwards, bucket all-reduces,
collectives, buffer broadcasts) into bounded deques; the training thread does nothing more.

Lateness needs no cross-host clock (as in analysis/slow/straggler.py): the last bucket's
all-reduce ends at about the same moment on every rank, so a rank that got it ready later waits
less. Each rank publishes its wait in that bucket for its last completed steps; `top` lines the
ranks up by step.

The model fingerprints (probes/fingerprint.py) reach the status the same way: the writer thread
folds each ``fingerprint`` record's per-tensor hashes into two numbers, parameters and buffers
(buffers may differ by design, see analysis/misuse/divergence.py), and keeps the last few checks, so
`top` compares the ranks' weights at a step they all checked without any per-tensor data.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpdoctor.trace import schema

# Steps kept: enough for a steady rate, and for lateness: two ranks' windows, published at
# moments up to a status interval apart, must still share the 14 steps on which one of two ranks
# being latest is no chance (p < 1e-4, analysis/slow/straggler.py); small enough to publish.
KEEP_STEPS = 32
KEEP_CHECKS = 4  # fingerprint checks kept per model: ranks on different intervals still share one
KEEP_MODELS = 4  # the models checked last (a wrapper rebuilt each epoch gets a new index)
_M64 = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15  # odd: the rolling hash below is a bijection of its state


class RecentSteps:
    """Fed by writer taps (``(kind, t0_ns, t1_ns, step, *fields)``); ``status()`` for the file."""

    def __init__(self, keep: int = KEEP_STEPS) -> None:
        self.starts: deque[tuple[int, int]] = deque(maxlen=keep)  # (step, forward entry ns)
        self.sync: deque[tuple[int, int]] = deque(maxlen=keep)  # (step, last bucket wait µs)
        self._open: tuple[int, int, int] | None = None  # (step, ready ns, wait µs) of the newest step
        self.last_collective: tuple[str, int, int] | None = None  # (op, seq, end ns)
        # (step, the sequence number of its first bucket all-reduce): the moment every rank's
        # step shares, where a Join has made the ranks' own step counts part
        self.firsts: deque[tuple[int, int]] = deque(maxlen=keep)
        self.on_first: Callable[[int, int], None] | None = None  # told each (step, seq) seen

    # The newest events of each kind a flush must hand over: a collective and a buffer
    # broadcast only say which was last; forwards, enough to hold KEEP_STEPS training ones
    # between evaluation forwards; bucket all-reduces, the writer's default (many per step).
    NEWEST = {schema.COLLECTIVE: 1, schema.SYNC_BUFFERS: 1, schema.FORWARD: 8 * KEEP_STEPS}

    def taps(self) -> dict[str, Any]:
        return {
            schema.FORWARD: self.forward,
            schema.ALLREDUCE: self.allreduce,
            schema.COLLECTIVE: self.collective,
            schema.SYNC_BUFFERS: self.sync_buffers,
        }

    def forward(self, event: tuple) -> None:
        _, t0, _, step, grad, *_ = event
        if grad:
            self.starts.append((step, t0))

    def allreduce(self, event: tuple) -> None:
        _, t0, t1, step, _, _, seq = event[:7]
        cur = self._open
        if cur is not None and cur[0] != step:
            self.sync.append((cur[0], cur[2]))  # a later step began: the previous one is complete
            cur = None
        if cur is None or t0 >= cur[1]:  # the bucket that got ready last decides the wait
            self._open = (step, t0, (t1 - t0) // 1000)
        self.last_collective = ("allreduce", int(seq), t1)
        if self.firsts and self.firsts[-1][0] == step:
            if seq < self.firsts[-1][1]:
                self.firsts[-1] = (step, int(seq))
        else:
            self.firsts.append((step, int(seq)))
        if self.on_first is not None:
            self.on_first(step, int(seq))

    def first_seq(self, step: int) -> int | None:
        """The sequence number ``step``'s first bucket all-reduce had, while it is kept."""
        return next((seq for s, seq in reversed(self.firsts) if s == step), None)

    def collective(self, event: tuple) -> None:
        _, _, t1, _, op, _, _, _, seq = event[:9]
        self.last_collective = (str(op), int(seq), t1)

    def sync_buffers(self, event: tuple) -> None:
        _, _, t1, _, seq = event[:5]
        self.last_collective = ("broadcast", int(seq), t1)

    def finish(self) -> None:
        """The rank is exiting: its newest step's buckets are all reduced."""
        if self._open is not None:
            self.sync.append((self._open[0], self._open[2]))
            self._open = None

    def status(self, now_ns: int | None = None) -> dict[str, Any]:
        """The fields this adds to ``status-rank{R}.json``."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        wall = time.time()
        starts = list(self.starts)
        rate = None
        if len(starts) >= 2 and starts[-1][1] > starts[0][1]:
            rate = round((starts[-1][0] - starts[0][0]) / ((starts[-1][1] - starts[0][1]) / 1e9), 4)
        last = self.last_collective
        return {
            "steps_per_s": rate,
            "last_step_wall": round(wall - (now_ns - starts[-1][1]) / 1e9, 3) if starts else None,
            "sync_wait_us": [[s, w] for s, w in list(self.sync)],  # list(): one step, under the GIL
            "last_collective": {"op": last[0], "seq": last[1], "ago_s": round((now_ns - last[2]) / 1e9, 3)}
            if last
            else None,
        }


def combine(values: list[int]) -> int:
    """One number for a list of per-tensor fingerprints, order included: a multiplicative
    rolling hash modulo 2**64, folded to 53 bits like the per-tensor ones (JSON holds it)."""
    h = len(values)
    for v in values:
        h = (h * _MULT + int(v)) & _M64
    return (h ^ (h >> 53)) & ((1 << 53) - 1)


class RecentFingerprints:
    """Fed by the ``fingerprint`` writer tap: per DDP model, the last checks as (step, at,
    parameters, buffers, the sequence number of the step's first gradient all-reduce).
    Parameters DDP never registered (``unsynced``) are left out of the parameters' number:
    their divergence is the analysis' gradients_not_synced."""

    def __init__(self, keep: int = KEEP_CHECKS, steps: RecentSteps | None = None) -> None:
        self.keep = keep
        self.steps = steps  # says each step's first gradient all-reduce, for the checks after it
        # Checks whose step's all-reduces may still come: the C++ timer's bucket records reach
        # the writer after the step's fingerprint record can. step -> those checks' records.
        self._waiting: dict[int, list[list[Any]]] = {}
        if steps is not None:
            steps.on_first = self._first
        self.n_params: dict[int, int] = {}  # model -> parameters first in its values
        self.checks: dict[int, deque[list[Any]]] = {}

    def taps(self) -> dict[str, Any]:
        return {schema.FINGERPRINT: self.fingerprint}

    def fingerprint(self, event: tuple) -> None:
        _, _, _, step, info = event[:5]
        model, values = info.get("model"), info.get("values")
        if not isinstance(model, int) or model < 0 or not isinstance(values, list):
            return  # model -1: an optimizer's parameters outside every DDP model
        if "n_params" in info:  # with the names: the first record, and whenever they change
            self.n_params[model] = int(info["n_params"])
        n = self.n_params.get(model)
        if n is None or n > len(values):
            return
        skip = set(info.get("unsynced") or ())
        params = combine([v for i, v in enumerate(values[:n]) if i not in skip])
        buffers = combine(values[n:]) if len(values) > n else None
        checks = self.checks.pop(model, None) or deque(maxlen=self.keep)
        seq = self.steps.first_seq(int(step)) if self.steps is not None and info.get("at") == "step" else None
        record = [int(step), info.get("at"), params, buffers, seq]
        checks.append(record)
        if self.steps is not None and info.get("at") == "step":
            self._waiting.setdefault(int(step), []).append(record)
            while len(self._waiting) > KEEP_CHECKS * KEEP_MODELS:
                del self._waiting[next(iter(self._waiting))]
        self.checks[model] = checks  # last in order: the model checked most recently
        while len(self.checks) > KEEP_MODELS:
            del self.checks[next(iter(self.checks))]

    def _first(self, step: int, seq: int) -> None:
        for record in self._waiting.get(step, ()):
            if record[4] is None or seq < record[4]:
                record[4] = seq

    def status(self) -> dict[str, Any]:
        """The field this adds to ``status-rank{R}.json``."""
        return {
            "fingerprints": [
                {"model": m, "step": c[0], "at": c[1], "params": c[2], "buffers": c[3], "seq": c[4]}
                for m, checks in list(self.checks.items())
                for c in list(checks)
            ]
        }
