"""The run as the device saw it: CPU span kinds replaced by their ``dev_*`` twins.

On a GPU, CPU spans time launches: a forward "ends" when its kernels are queued and a bucket's
future completes at enqueue. When every rank recorded device spans (``probes/cuda_timing.py``),
the timing analyses (stragglers, gradient sync, exposed communication) read this view instead,
so their arrival times and durations are the device's. Everything else (data waits, barriers,
metadata) stays as recorded.
"""

from __future__ import annotations

from dataclasses import replace

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

_CACHE = "device_timed"


def has_device_spans(run: Run) -> bool:
    """Every rank has device spans for its backward and its buckets."""
    return bool(run.ranks) and all(
        len(t.kind(schema.DEV_BACKWARD)) and len(t.kind(schema.DEV_ALLREDUCE)) for t in run.ranks.values()
    )


def device_timed(run: Run) -> Run:
    """``run`` with device spans in place of CPU spans, or ``run`` itself without them
    (cached in ``run.derived``; the view has its own, empty, ``derived``)."""
    if _CACHE in run.derived:
        return run.derived[_CACHE]
    view = run
    if has_device_spans(run):
        ranks = {}
        for rank, trace in run.ranks.items():
            events = dict(trace.events)
            for cpu, dev in schema.DEVICE_KINDS.items():
                if dev in events:
                    events[cpu] = events[dev]
            ranks[rank] = replace(trace, events=events)
        view = replace(run, ranks=ranks, derived={})
        view.derived[_CACHE] = view
    run.derived[_CACHE] = view
    return view


def clock(run: Run) -> str:
    """Which clock the timing analyses use for this run: "device" or "cpu"."""
    return "device" if has_device_spans(run) else "cpu"
