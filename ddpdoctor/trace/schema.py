"""The per-rank trace format, version 3: binary (versions 1 and 2, JSON lines, still read).

One file per rank, ``trace-rank{R}.bin`` (``trace-rank{R}-attempt{N}.bin`` after an elastic
restart), in the run directory: blocks appended by the rank (``trace/binfmt.py``), the events as
fixed-size records of each kind's declared layout (``record_dtype`` of its ``spec`` below),
strings and other variable-length values interned once in a side table, header and metadata
records as JSON. A torn last block (a rank killed mid-write) is dropped and counted; a cut or
damaged header block (a disk that filled at the first write) loses only the header, which
``trace/recover.py`` stands in for.
``ddpdoctor export --format jsonl`` writes each rank's trace as the JSON lines of version 2
(``trace-rank{R}.jsonl``, which the reader also reads), as described below.

The header::

    {"schema": "ddpdoctor.trace/3", "rank": 0, "world_size": 2, "local_rank": 0,
     "host": "node1", "pid": 123, "wall_ns": ..., "mono_ns": ..., "backend": "gloo",
     "torch": "2.13.0", "argv": [...], "restart": 0, "layout": [[kind, spec, [fields]]...]}

``wall_ns``/``mono_ns`` anchor the monotonic clock to wall time. Records hold the monotonic ns
at entry and exit as recorded; readers give every timestamp as microseconds since ``mono_ns``
and ``dur`` in microseconds too. ``step`` is the index of the last training step started (a DDP
forward in grad mode), -1 before the first, so events between the end of step k's backward and
the next forward carry step k.

To add a field to a kind: append its name to ``fields`` and its type letter (``FIELD_TYPES``)
to ``spec`` in the kind's ``declare`` below, and pass the value in the probe's ``emit``/
``leave`` call, last. To add a kind: one more ``declare``. Nothing else changes: the writer,
the ring, the reader and the export all follow the declarations, and each file carries its own
layout, so traces recorded before the change still read (a missing field reads as absent).

Event records are ``[kind, ts_us, dur_us, step, *fields]``:

==============  ===============================================================================
kind            fields after ``step``
==============  ===============================================================================
ddp_init        {params, param_bytes, buckets: [bytes...], options: {...}, module, site: the call
                site id (see ``site``) of the user's DistributedDataParallel(...) line}
forward         grad mode (0/1), module.training (0/1), seq at entry, call site id (see ``site``)
sync_buffers    seq at entry (DDP's buffer broadcast inside forward)
backward        (none): the backward of the step's DDP forward, ending after its all-reduces
allreduce       bucket index, bytes, seq at entry; ts is when the bucket was ready, dur until
                its reduction finished
collective      op, bytes, group ("WORLD" or a name), group size, seq at entry, async (0/1);
                op "barrier" is ``dist.barrier``; then the call site id (see ``site``); then
                the id of the rest of its signature (see ``signature``). Op "new_group" is
                ``dist.new_group`` (a collective of the default group)
data_wait       loader id: time blocked in the DataLoader iterator's ``__next__``
optimizer       optimizer class name: ``Optimizer.step``
graph_scan      (none): DDP's post-forward with find_unused_parameters (its autograd graph walk)
dev_forward     as ``forward``, timed on the device: CUDA events on the current stream at the
                forward's entry and exit (only when the model's parameters are on CUDA)
dev_backward    as ``backward``, on the device
dev_optimizer   as ``optimizer``, on the device
dev_bucket      as ``allreduce``, on the device: ts when the bucket's gradients were ready on
                the compute stream, dur until the reduction completed on the stream that
                waits for the collective
==============  ===============================================================================

``dev_*`` times are device times turned into this rank's monotonic clock off the training
thread (``probes/cuda_timing.py``); their lines come in the order the device finished them,
some time after the CPU events of the same step.

Metadata records (JSON, written at once) share the shape ``[kind, ts_us, 0, step, {...}]``:

==============  ===============================================================================
bucket          {index, bytes, params: [names without "module."]}: a gradient bucket's layout,
                written when first seen and whenever DDP rebuilds its buckets
loader          {id, sampler, epoch, shuffle, batch_size, drop_last, num_workers, dataset_len}:
                a DataLoader pass began (``iter(loader)``)
comm_hook       {name, user}: the comm hook that is being timed
unused          {params: [indices into ddp_init's param_names], used_on_ranks, scope}: after a
                step's backward, parameters that got no gradient; scope "local" (this rank,
                find_unused_parameters off) or "global" (DDP's used counts across ranks)
ddp_error       {error, params: [names], message}: DDP raised (e.g. unfinished reduction)
save            {path, module_prefix, ms}: ``torch.save`` to a file (module_prefix: the state
                came from the DDP wrapper, keys start with "module.")
load            {path, map_location}: ``torch.load`` from a file, and whether it was mapped
inplace         {model, params: [names], modules: {name: owner}}: parameters a DDP model's first
                forward changed in place (their version counters moved; ``owner`` the class of
                the module that holds each, with its ``max_norm`` when it has one), once per
                model and only when some did: a forward that edits weights by its own batch
                parts the replicas without an error
load_state      {target ("model" or "optimizer"), class, site, model}: ``load_state_dict`` on a
                module or an optimizer; ``model``: the index of the DDP model the module is
                (or is inside), null when it is in none (e.g. loaded before wrapping)
fingerprint     {model, at, values, [names, n_params, numels], [unsynced], [optimizer]}: a
                hash of every tensor of a DDP model (``probes/fingerprint.py``), ``at``
                "init" (after its constructor), "step" (after an optimizer step; ``step`` is
                the step) or "exit"; ``values`` in the order of ``names`` (parameters, then
                buffers from index ``n_params``), which is written with the first record of
                a model and again whenever the list changes; ``unsynced``: indices of
                parameters that have a gradient but that DDP never registered (never
                all-reduced); ``model`` -1: the parameters optimizer ``optimizer`` trains
                outside every DDP model
probe_error     {probe, error}: a probe failed and switched itself off
dropped         {count}: events lost because the buffer was full
end             {reason}: the rank's trace was closed cleanly ("exit")
clock           {offset_ns, rtt_ns, ref_rank}: add ``offset_ns`` to this rank's wall clock to get
                rank ``ref_rank``'s (0), measured by NTP-style ping-pongs through the store
                right after init; the error is at most ``rtt_ns / 2``. Rank 0 writes 0.
site            {id, file, line, func}: the user's line that issued a sync point (the first
                frame outside torch, the frameworks, ddpdoctor and the standard library),
                written once per site; forward and collective events carry its id (-1: none)
raised          {kind, fields, dur_us}: a span the rank entered and left by an exception (a
                collective that raised "Connection closed by peer", a forward that raised):
                ``kind`` and ``fields`` as the span would have had, ``ts`` its start. Never
                recorded as the span: it did not complete, and its time is no step's
signature       {id, dtype, numel, root, ranks}: the rest of a collective's signature, written
                once per distinct value (dtype of the first tensor, "" none; element count;
                root rank ``src``/``dst``, -1 none; the group's global ranks "0 1", "" for
                WORLD, for ``new_group`` the new group's); collective events carry its id
entered         {seq, signature, site}: the collective the rank entered last, from its ring's
                header (written before each call), appended when the trace is completed after
                the rank died: the call it died in, unless that call's record is there
sync_log        {site, name}: a framework's logging call that all-reduces (Lightning's
                ``self.log(..., sync_dist=True)``), once per (call site id, metric name): the
                user's hook line behind a collective the framework issues later
rank_error      {type, message, traceback, frames: [[file, line, function]...] (innermost
                last), thread, wall_ns}: an uncaught exception (sys.excepthook, or
                threading.excepthook for other threads), flushed at once
==============  ===============================================================================

Besides the trace, each rank rewrites ``status-rank{R}.json`` (schema ``ddpdoctor.status/1``,
see ``probes/liveness.py``) after every flush: its pid, a heartbeat, the sync point it is
inside and its collective sequence number. ``ddpdoctor run`` watches these for hangs and keeps
what it found in ``hang-N/summary.json`` and ``watch.json``.

Crash safety: each event is recorded into ``trace-rank{R}.ring``, a memory-mapped ring of
fixed 128-byte slots (its layout in ``trace/ring.py``), which the writer thread appends to the
trace every fraction of a second. Its pages outlive the process, so after the job ``ddpdoctor
run`` appends to a trace that has no ``end`` record the events the ring holds beyond the trace's
last block (a ``dropped`` record counts any the ring had already overwritten), and the C++
bucket timer's notes from ``trace-rank{R}.notes`` that never reached the ring
(``trace/notes.py``), then removes both. A rank also leaves ``fatal-rank{R}.txt`` (fatal
signal and Python stacks, from faulthandler), ``sigterm-rank{R}.txt``, ``exit-rank{R}.json``
(``os._exit`` code) and ``stderr-rank{R}.txt`` (the last 64 KiB of its stderr); the supervisor
sums them up per rank in ``ends.json`` (``supervisor/ends.py``). A process started as a rank
(``RANK`` set by the launcher) writes ``proc-rank{R}.json`` at its start, before
``init_process_group``, and takes those last words then (``probes/early.py``): a rank that
never initialises has no trace, and ``ends.json`` says how it ended (``initialised: false``).

GPU samples (``gpu-<host>.jsonl``, schema ``ddpdoctor.gpu/1``) are written by the supervisor's
NVML sampler (``supervisor/nvml.py``), one file per node, in the same line format. Its header
``["header", {"schema", "host", "pid", "wall_ns", "mono_ns", "interval_s", "driver",
"gpus": [{index, name, uuid, mem_total, max_sm_clock_mhz, power_limit_w}...]}]`` anchors its
monotonic clock like a rank's; the host's ranks share that clock. Records, ``[kind, ts_us, 0,
-1, {...}]``:

==============  ===============================================================================
gpu             {gpu, util, mem_util (%), mem_used, mem_total (bytes), power_w, sm_clock_mhz,
                temp_c, throttle (NVML clock event reason bits)}: one GPU, one sample; a
                metric NVML cannot give is absent
gpu_procs       {gpu, procs: [[pid, bytes or null]...]}: the GPU's compute processes, written
                when the list changes (bytes rounded to MiB); pids are as the driver sees them
unavailable     {error, message, reason}: no NVML here (no library, no driver, no GPU...)
unsupported     {gpu, metric, error}: one metric that NVML cannot give on that GPU
nvml_error      {gpu, metric, error, message}: an error mid-run; sampling stopped there
sampler_error   {error, message}: the sampler's own failure; sampling stopped there
end             {reason, samples}
==============  ===============================================================================

Readers must ignore kinds they do not know, so later versions can add records.

Every kind is declared once, below, as an ``EventKind`` (its fields, their binary types, its
title) and, if it is drawn, with one or more ``Phase`` entries (label, lane, colour, and
which of its events belong to the phase). The reader, the phase statistics, the HTML timeline
and the Perfetto export all iterate these declarations; ``declare`` adds a kind at run time.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SCHEMA = "ddpdoctor.trace/3"  # binary (trace/binfmt.py)
JSONL_SCHEMA = "ddpdoctor.trace/2"  # JSON lines: traces of earlier versions, and the export
SCHEMAS = ("ddpdoctor.trace/1", JSONL_SCHEMA, SCHEMA)  # the versions the reader accepts
GPU_SCHEMA = "ddpdoctor.gpu/1"
BARRIER_OP = "barrier"

# Record kinds. Spans (``[kind, ts, dur, step, *fields]``) and metadata (``[kind, ts, 0, step,
# {...}]``) are declared with their fields in ``KINDS`` below; these names are for code.
DDP_INIT = "ddp_init"
FORWARD = "forward"
SYNC_BUFFERS = "sync_buffers"
BACKWARD = "backward"
ALLREDUCE = "allreduce"
COLLECTIVE = "collective"
DATA_WAIT = "data_wait"
OPTIMIZER = "optimizer"
GRAPH_SCAN = "graph_scan"
DEV_FORWARD = "dev_forward"
DEV_BACKWARD = "dev_backward"
DEV_OPTIMIZER = "dev_optimizer"
DEV_ALLREDUCE = "dev_bucket"
# A CPU span kind -> the same span timed on the device.
DEVICE_KINDS = {
    FORWARD: DEV_FORWARD,
    BACKWARD: DEV_BACKWARD,
    OPTIMIZER: DEV_OPTIMIZER,
    ALLREDUCE: DEV_ALLREDUCE,
}

HEADER = "header"
BUCKET = "bucket"
LOADER = "loader"
BATCHES = "batches"  # digests of a DataLoader pass's first batches: what the rank actually read
INPUTS = "inputs"  # {elements}: tensor elements a training forward's inputs held, sampled steps
SET_EPOCH = "set_epoch"  # a DistributedSampler's set_epoch: which sampler, the epoch, the line
COMM_HOOK = "comm_hook"
UNUSED = "unused"
DDP_ERROR = "ddp_error"
SAVE = "save"
LOAD = "load"
LOAD_STATE = "load_state"  # load_state_dict on a module or an optimizer
INPLACE = "inplace"  # parameters a model's first forward changed in place
FINGERPRINT = "fingerprint"  # per-tensor hashes of a DDP model: are the ranks' copies equal?
OPT_SETTINGS = "opt_settings"  # an optimizer's settings (lr, momentum...) when they changed
PROBE_ERROR = "probe_error"
DROPPED = "dropped"
END = "end"
CLOCK = "clock"
RANK_ERROR = "rank_error"
RAISED = "raised"
SITE = "site"
SYNC_LOG = "sync_log"
SIGNATURE = "signature"
# The collective a rank entered last (seq, signature id, site id), from its ring after a death:
# written before the call, so it names the call a rank died in (trace/ring.py).
ENTERED = "entered"

# Not a record: the time a rank spent outside every sync point (its own code between them). A
# failure view draws it when a rank hung or died there; nothing is ever recorded under this name.
USER_CODE = "user_code"
USER_CODE_LABEL = "user code"
USER_CODE_COLOUR = "#8c8c8c"
# What a span is called that a rank entered and never left (a hang, a death, an exception).
DID_NOT_FINISH = "did not finish"

# The supervisor's GPU samples (gpu-<host>.jsonl).
GPU = "gpu"
GPU_PROCS = "gpu_procs"


class Lane(enum.IntEnum):
    """Where a phase is drawn: the rank's compute row, its communication lane beneath, and
    the same two on the device's clock (CUDA events) under them."""

    COMPUTE = 0
    COMM = 1
    DEVICE = 2
    DEVICE_COMM = 3


# A field's type in a binary record, one letter in ``EventKind.spec``: its numpy type in the
# file and its ``struct`` code on the recording thread. "s" (a string) and "v" (any JSON value:
# a list, a dict) are interned: the record holds the id of the value in the trace's side table,
# written once per distinct value (``trace/binfmt.py``).
FIELD_TYPES: dict[str, tuple[str, str]] = {
    "i": ("<i8", "q"),  # integer (64-bit)
    "n": ("<i4", "i"),  # narrow integer (32-bit): ids, counts, sizes of groups
    "b": ("<i1", "b"),  # flag or tiny integer (-128..127)
    "f": ("<f8", "d"),  # float
    "s": ("<u4", "I"),  # string, interned
    "v": ("<u4", "I"),  # JSON value (list, dict...), interned by its JSON text
}
INTERNED = frozenset("sv")
MAX_RECORD = 116  # bytes of step, t0, t1 and fields: a ring slot's room (trace/ring.py)


@dataclass(frozen=True)
class EventKind:
    """One span kind: ``[kind, ts_us, dur_us, step, *fields]``.

    ``spec`` gives each field's type, one letter of ``FIELD_TYPES`` per field: the binary
    record's layout (``record_dtype``). ``title`` names one event in the timeline and the export
    from its fields (a format string over ``fields``' names, or a function of the field dict)."""

    name: str
    fields: tuple[str, ...] = ()
    spec: str = ""
    title: str | Callable[[Mapping[str, Any]], str] = ""

    def __post_init__(self) -> None:
        if len(self.spec) != len(self.fields) or not set(self.spec) <= set(FIELD_TYPES):
            raise ValueError(f"{self.name}: spec {self.spec!r} does not match fields {self.fields}")
        if record_dtype(self.spec).itemsize > MAX_RECORD:
            raise ValueError(f"{self.name}: a record of {self.spec!r} exceeds {MAX_RECORD} bytes")

    def args(self, fields: tuple) -> dict[str, Any]:
        """The named fields of one event (extra or missing ones are left out)."""
        return dict(zip(self.fields, fields, strict=False))

    def describe(self, fields: tuple) -> str:
        """This event's name on the timeline."""
        args = self.args(fields)
        try:
            if callable(self.title):
                return self.title(args)
            return self.title.format_map(args) if self.title else self.name
        except (KeyError, IndexError, ValueError):
            return self.name


@dataclass(frozen=True)
class Phase:
    """A named share of a rank's time, drawn and tabulated: the events of ``kind`` (those whose
    field ``where[0]`` equals ``where[1]`` when ``where`` is set, or differs when ``negate``)."""

    name: str
    kind: str
    label: str
    lane: Lane = Lane.COMPUTE
    colour: str = "#9e9e9e"
    where: tuple[int, Any] | None = None
    negate: bool = False
    per_step: bool = True  # happens every step (DDP init does not): compared across runs


def record_dtype(spec: str) -> Any:
    """The numpy dtype of one binary record of a kind with this ``spec``: step, t0 and t1
    (monotonic ns, as recorded), then the fields (``f0``, ``f1``...), packed."""
    import numpy as np

    cols = [("step", "<i4"), ("t0", "<i8"), ("t1", "<i8")]
    return np.dtype(cols + [(f"f{i}", FIELD_TYPES[c][0]) for i, c in enumerate(spec)])


def _forward_title(args: Mapping[str, Any]) -> str:
    return "forward" if args.get("grad", 1) == 1 else "forward (no grad)"


KINDS: dict[str, EventKind] = {}
PHASES: dict[str, Phase] = {}  # in drawing order: later phases draw over earlier ones
META_KINDS = frozenset(
    (
        HEADER,
        BUCKET,
        LOADER,
        BATCHES,
        COMM_HOOK,
        UNUSED,
        DDP_ERROR,
        SAVE,
        LOAD,
        PROBE_ERROR,
        DROPPED,
        END,
        CLOCK,
    )
    + (RANK_ERROR, LOAD_STATE, INPLACE, FINGERPRINT, OPT_SETTINGS, RAISED, SYNC_LOG, SIGNATURE, ENTERED)
    + (SET_EPOCH, INPUTS)
)


def declare(kind: EventKind, *phases: Phase) -> EventKind:
    """Add a span kind (and the phases it feeds) to the vocabulary every consumer iterates."""
    if kind.name in META_KINDS:
        raise ValueError(f"{kind.name} is a metadata kind")
    KINDS[kind.name] = kind
    for phase in phases:
        if phase.kind != kind.name:
            raise ValueError(f"phase {phase.name} reads {phase.kind}, not {kind.name}")
        PHASES[phase.name] = phase
    return kind


declare(
    EventKind(DDP_INIT, ("info",), "v", "DDP init"),
    Phase("ddp_init", DDP_INIT, "DDP init", per_step=False),
)
declare(
    EventKind(DATA_WAIT, ("loader",), "i", "data wait"),
    Phase("data_wait", DATA_WAIT, "data wait", colour="#f2b134"),
)
declare(
    EventKind(FORWARD, ("grad", "training", "seq", "site"), "bbin", _forward_title),
    Phase("forward", FORWARD, "forward", colour="#4e79a7"),
)
# runq: the thread's run-queue delay so far (µs, -1 unknown; probes/cpuwait.py), read at its end.
declare(
    EventKind(BACKWARD, ("runq",), "i", "backward"),
    Phase("backward", BACKWARD, "backward", colour="#59a14f"),
)
declare(
    EventKind(OPTIMIZER, ("optimizer",), "s", "optimizer {optimizer}"),
    Phase("optimizer", OPTIMIZER, "optimizer", colour="#b07aa1"),
)
declare(
    EventKind(
        COLLECTIVE, ("op", "bytes", "group", "group_size", "seq", "async", "site", "sig"), "sisnibnn", "{op}"
    ),
    Phase("barrier", COLLECTIVE, "barrier", colour="#e15759", where=(0, BARRIER_OP)),
    Phase("collective", COLLECTIVE, "collective", colour="#ff9da7", where=(0, BARRIER_OP), negate=True),
)
declare(
    EventKind(SYNC_BUFFERS, ("seq",), "i", "buffer broadcast"),
    Phase("sync_buffers", SYNC_BUFFERS, "buffer broadcast", Lane.COMM, "#76b7b2"),
)
declare(
    EventKind(ALLREDUCE, ("bucket", "bytes", "seq"), "nii", "allreduce bucket {bucket}"),
    Phase("allreduce", ALLREDUCE, "bucket all-reduce", Lane.COMM, "#edc948"),
)
declare(EventKind(GRAPH_SCAN, (), "", "unused-parameter graph scan"))
# Device spans: the fields and titles of their CPU twins (less backward's runq, a host thread's
# measure), drawn under them.
declare(
    EventKind(DEV_FORWARD, ("grad", "training", "seq", "site"), "bbin", _forward_title),
    Phase("dev_forward", DEV_FORWARD, "forward (GPU)", Lane.DEVICE, "#2b4a6b"),
)
declare(
    EventKind(DEV_BACKWARD, (), "", "backward"),
    Phase("dev_backward", DEV_BACKWARD, "backward (GPU)", Lane.DEVICE, "#35652f"),
)
declare(
    EventKind(DEV_OPTIMIZER, ("optimizer",), "s", "optimizer {optimizer}"),
    Phase("dev_optimizer", DEV_OPTIMIZER, "optimizer (GPU)", Lane.DEVICE, "#6b4a63"),
)
declare(
    EventKind(DEV_ALLREDUCE, ("bucket", "bytes", "seq"), "nii", "allreduce bucket {bucket}"),
    Phase("dev_bucket", DEV_ALLREDUCE, "bucket all-reduce (GPU)", Lane.DEVICE_COMM, "#a38a2f"),
)
