"""The per-rank trace format, version 2 (version 1 lacks only the ``dev_*`` records; readers take both).

One file per rank, ``trace-rank{R}.jsonl`` (``trace-rank{R}-attempt{N}.jsonl`` after an elastic
restart), in the run directory. Each line is one JSON array; the first element names the record.
Files are append-only and flushed every fraction of a second, so a rank that hangs or dies still
leaves its data; the reader drops a truncated or corrupt line and counts it.

The first line is the header::

    ["header", {"schema": "ddpdoctor.trace/2", "rank": 0, "world_size": 2, "local_rank": 0,
                "host": "node1", "pid": 123, "wall_ns": ..., "mono_ns": ..., "backend": "gloo",
                "torch": "2.13.0", "argv": [...], "restart": 0}]

``wall_ns``/``mono_ns`` anchor the monotonic clock to wall time. Every timestamp below is
microseconds of ``time.monotonic_ns()`` since ``mono_ns``; ``dur`` is in microseconds too.
``step`` is the index of the last training step started (a DDP forward in grad mode), -1 before
the first, so events between the end of step k's backward and the next forward carry step k.

Event records are ``[kind, ts_us, dur_us, step, *fields]``:

==============  ===============================================================================
kind            fields after ``step``
==============  ===============================================================================
ddp_init        {params, param_bytes, buckets: [bytes...], options: {...}, module}
forward         training (1 = grad mode and module.training, 0 = eval or no_grad), seq at entry
sync_buffers    seq at entry (DDP's buffer broadcast inside forward)
backward        (none): the backward of the step's DDP forward, ending after its all-reduces
allreduce       bucket index, bytes, seq at entry; ts is when the bucket was ready, dur until
                its reduction finished
collective      op, bytes, group ("WORLD" or a name), group size, seq at entry, async (0/1);
                op "barrier" is ``dist.barrier``
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

``dev_*`` times are device times turned into this rank's monotonic clock by the writer
process (``probes/cuda_timing.py``); their lines come in the order the device finished them,
some time after the CPU events of the same step.

Metadata records share the shape ``[kind, ts_us, 0, step, {...}]``:

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
probe_error     {probe, error}: a probe failed and switched itself off
dropped         {count}: events lost because the buffer was full
end             {reason}: the rank's trace was closed cleanly ("exit")
clock           {offset_ns, rtt_ns, ref_rank}: add ``offset_ns`` to this rank's wall clock to get
                rank ``ref_rank``'s (0), measured by NTP-style ping-pongs through the store
                right after init; the error is at most ``rtt_ns / 2``. Rank 0 writes 0.
rank_error      {type, message, traceback, frames: [[file, line, function]...] (innermost
                last), thread, wall_ns}: an uncaught exception (sys.excepthook, or
                threading.excepthook for other threads), flushed at once
==============  ===============================================================================

Besides the trace, each rank rewrites ``status-rank{R}.json`` (schema ``ddpdoctor.status/1``,
see ``probes/liveness.py``) after every flush: its pid, a heartbeat, the sync point it is
inside and its collective sequence number. ``ddpdoctor run`` watches these for hangs and keeps
what it found in ``hang-N/summary.json`` and ``watch.json``.

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
"""

from __future__ import annotations

SCHEMA = "ddpdoctor.trace/2"
SCHEMAS = ("ddpdoctor.trace/1", SCHEMA)  # the versions the reader accepts
TRACE_GLOB = "trace-rank*.jsonl"

# Event kinds, as written by the probes.
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

# Metadata kinds.
HEADER = "header"
BUCKET = "bucket"
LOADER = "loader"
COMM_HOOK = "comm_hook"
UNUSED = "unused"
DDP_ERROR = "ddp_error"
SAVE = "save"
LOAD = "load"
PROBE_ERROR = "probe_error"
DROPPED = "dropped"
END = "end"
CLOCK = "clock"
RANK_ERROR = "rank_error"

BARRIER_OP = "barrier"

# The supervisor's GPU samples (gpu-<host>.jsonl).
GPU_SCHEMA = "ddpdoctor.gpu/1"
GPU_GLOB = "gpu-*.jsonl"
GPU = "gpu"
GPU_PROCS = "gpu_procs"


def trace_filename(rank: int, restart: int = 0) -> str:
    """The file a rank writes; one per elastic restart attempt so attempts never interleave."""
    if restart:
        return f"trace-rank{rank}-attempt{restart}.jsonl"
    return f"trace-rank{rank}.jsonl"
