"""Which training framework drove DDP (Lightning, Accelerate, or plain DDP), judged from what the
ranks recorded, and fixes in that framework's terms.

A Lightning user does not construct DistributedDataParallel, so "pass
find_unused_parameters=True" is advice they cannot follow as written; they need the strategy
string. The plain-DDP fix stays beside it: it says what the framework setting does.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

LIGHTNING = "lightning"
ACCELERATE = "accelerate"

# Class names only these frameworks put in a rank's records (the wrapped module, the batch
# sampler that shards a prepared DataLoader).
_MODULE_HINTS = {"_LightningModuleWrapperBase": LIGHTNING, "LightningModule": LIGHTNING}
_SAMPLER_HINTS = {
    "BatchSamplerShard": ACCELERATE,
    "SeedableRandomSampler": ACCELERATE,
    "SkipBatchSampler": ACCELERATE,
}

_FIXES: dict[tuple[str, str], str] = {
    ("unused_parameters", LIGHTNING): 'In Lightning: Trainer(strategy="ddp_find_unused_parameters_true") '
    "(or DDPStrategy(find_unused_parameters=True)).",
    ("unused_parameters", ACCELERATE): "In Accelerate: Accelerator(kwargs_handlers=["
    "DistributedDataParallelKwargs(find_unused_parameters=True)]).",
    ("find_unused_parameters_unneeded", LIGHTNING): 'In Lightning: strategy="ddp" (not '
    '"ddp_find_unused_parameters_true").',
    ("find_unused_parameters_unneeded", ACCELERATE): "In Accelerate: drop find_unused_parameters=True "
    "from DistributedDataParallelKwargs.",
    ("missing_distributed_sampler", ACCELERATE): "In Accelerate: pass the DataLoader to "
    "accelerator.prepare(...), which shards it across ranks.",
    ("missing_distributed_sampler", LIGHTNING): "In Lightning: keep Trainer(use_distributed_sampler=True) "
    "(the default) so it injects a DistributedSampler.",
    ("forward_sync_cost", LIGHTNING): "In Lightning: DDPStrategy(broadcast_buffers=False); "
    "self.log(..., sync_dist=True) all-reduces on every call: log per epoch, or without sync_dist.",
    (
        "forward_sync_cost",
        ACCELERATE,
    ): "In Accelerate: DistributedDataParallelKwargs(broadcast_buffers=False).",
    ("rank_only_collective", LIGHTNING): "In Lightning: call collectives (self.all_gather, "
    "self.trainer.strategy.barrier/broadcast, self.log(..., sync_dist=True)) on every rank; guard "
    "only the rank-0 work with `if self.trainer.is_global_zero:` or @rank_zero_only.",
    ("rank_only_collective", ACCELERATE): "In Accelerate: call accelerator.gather/reduce/"
    "wait_for_everyone() on every process; guard only the main process's own work with `if "
    "accelerator.is_main_process:`.",
    ("awaited_work", ACCELERATE): "In Accelerate: run the main process's work inside `with "
    "accelerator.main_process_first():` or before accelerator.prepare(), or raise the timeout "
    "with InitProcessGroupKwargs(timeout=...).",
    ("awaited_work", LIGHTNING): "In Lightning: raise the timeout with DDPStrategy(timeout=...), or "
    "move rank-0 work to prepare_data() (run before the ranks start waiting on each other).",
}

_KILLED = {
    "SIGABRT": "SIGABRT is a native abort (a failed C++ check in gloo/NCCL/torch, e.g. collectives of "
    "different sizes, or a library's assert), not the OOM killer: read that rank's stderr for the "
    "C++ message just before it died.",
    "SIGSEGV": "SIGSEGV is a crash in native code (an extension, a driver, a corrupted tensor, a bad "
    "address handed to ctypes or a C library).",
    "SIGTERM": "SIGTERM came from outside (the scheduler's time limit or preemption, or torchrun "
    "stopping the job after another rank failed).",
}
_KILLED_DEFAULT = (
    "Nothing in Python sees SIGKILL: look for the OOM killer (dmesg | grep -i 'killed process') and "
    "reduce host memory (batch size, DataLoader workers, pinned memory), or for a scheduler limit."
)


def detect(run: Run) -> str | None:
    """'lightning', 'accelerate', or None for plain DDP."""
    for trace in run.ranks.values():
        loaded = trace.header.get("frameworks") or []
        if "lightning" in loaded or "pytorch_lightning" in loaded:
            return LIGHTNING
        if "accelerate" in loaded:
            return ACCELERATE
    for trace in run.ranks.values():
        init = trace.kind(schema.DDP_INIT)
        for fields in init.fields if len(init) else []:
            info = fields[0] if fields and isinstance(fields[0], dict) else {}
            hint = _MODULE_HINTS.get(str(info.get("module", "")))
            if hint:
                return hint
        for _, _, info in trace.meta.get(schema.LOADER, []):
            for key in ("batch_sampler", "sampler"):
                hint = _SAMPLER_HINTS.get(str(info.get(key, "")))
                if hint:
                    return hint
    return None


def advice(key: str) -> str:
    """The fix for a rank killed by a signal ('rank_killed_SIGABRT', ...)."""
    return _KILLED.get(key.removeprefix("rank_killed_"), _KILLED_DEFAULT)


def adapt(findings: list[Any], framework: str | None) -> None:
    """Add the framework's own wording of each fix (in place)."""
    if framework is None:
        return
    for finding in findings:
        extra = _FIXES.get((finding.kind, framework))
        if extra and extra not in finding.fix and not finding.fix.startswith("In "):
            finding.fix = f"{extra} {finding.fix}".strip()
