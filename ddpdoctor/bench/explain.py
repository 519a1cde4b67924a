"""The bench's verdict in plain words: why DDP is (or is not) faster here than DataParallel.

Each note is tied to a number in the result, and says when a comparison cannot be made
(no GPU: DataParallel has one replica) rather than printing a misleading ratio.
"""

from __future__ import annotations

from typing import Any


def _pct(part: float | None, whole: float | None) -> str:
    if not part or not whole:
        return "0%"
    return f"{100.0 * part / whole:.0f}%"


def notes(result: dict[str, Any]) -> list[str]:
    """Plain-language notes, most important first."""
    cfg, modes = result["config"], result["modes"]
    single, dp, ddp = modes.get("single", {}), modes.get("dp", {}), modes.get("ddp", {})
    out: list[str] = []
    for name, mode in modes.items():
        if not mode.get("ok"):
            out.append(f"{name}: failed (exit code {mode.get('exit_code')}); see the messages above.")
    gpus = len(cfg.get("cuda_devices") or [])
    if dp.get("ok"):
        if gpus == 0:
            out.append(
                "No GPU: DataParallel only splits a batch across GPUs, so here it ran one replica "
                "on the CPU: the single process plus the wrapper. DataParallel vs DDP cannot be "
                "compared on this machine; single vs DDP can."
            )
        elif dp.get("replicas", 1) < 2:
            out.append(
                "One GPU: DataParallel ran one replica (no scatter, replicate or gather), so it "
                "measures the wrapper only; DataParallel vs DDP needs two or more GPUs."
            )
        else:
            b = dp.get("breakdown_s", {})
            overhead = sum(b.get(k, 0.0) for k in ("scatter", "replicate", "gather"))
            out.append(
                f"DataParallel spent {_pct(overhead, dp['step_time_mean_s'])} of each step in scatter, "
                f"replicate and gather: it copies the whole model to all {dp['replicas']} GPUs on "
                "every step, scatters the batch from and gathers the outputs (and the loss) on "
                "one device, and runs the replicas as threads of one Python process that take "
                "turns on the GIL."
            )
    if ddp.get("ok"):
        probes = ddp.get("probes") or {}
        step = ddp.get("step_time_mean_s") or 0.0
        ar, exposed = probes.get("allreduce_s"), probes.get("exposed_allreduce_s")
        overlap = probes.get("overlap")
        if ar is not None:
            size = probes.get("allreduce_bytes_per_step") or 0
            out.append(
                f"DDP keeps one model per process and only all-reduces gradients "
                f"({size / 1e6:.1f} MB per step): the bucket all-reduces took {ar * 1e3:.1f} ms "
                f"per step in total, {_pct(exposed, step)} of the step was spent waiting for "
                f"them after backward, and {100 * (overlap or 0):.0f}% of their span overlapped "
                "backward."
            )
        if single.get("ok") and ddp.get("speedup") is not None:
            n = ddp["world_size"]
            eff = ddp["scaling_efficiency"]
            line = (
                f"DDP with {n} processes ran {ddp['speedup']:.2f}x the single process's throughput "
                f"(efficiency {100 * eff:.0f}% of an ideal {n}x)."
            )
            if gpus < n:
                cores = cfg.get("cpu_count") or 0
                line += (
                    f" On CPU the {n} processes share {cores} core(s) "
                    f"({ddp['threads_per_process']} thread(s) each, against "
                    f"{single['threads_per_process']} for the single process), so this measures "
                    "the cost of the gradient all-reduce and process overhead, not what more "
                    "devices would buy."
                )
            out.append(line)
            if eff > 1.1:
                load = (cfg.get("load_average") or [None])[0]
                out.append(
                    "Above-ideal scaling means the single process was slow, not DDP fast: on CPU, "
                    "usually its multi-threaded ops competing for busy cores"
                    + (f" (load average {load} on {cfg.get('cpu_count')} cores)" if load is not None else "")
                    + "; rerun with OMP_NUM_THREADS=1 on an idle machine for a fair baseline."
                )
    if dp.get("ok") and ddp.get("ok") and gpus >= 2 and dp.get("replicas", 1) >= 2:
        ratio = (ddp["samples_per_s"] / dp["samples_per_s"]) if dp["samples_per_s"] else 0.0
        out.append(f"DDP ran {ratio:.2f}x DataParallel's throughput with the same global batch.")
    if gpus == 0:
        out.append("Memory per GPU: no GPU.")
    return out
