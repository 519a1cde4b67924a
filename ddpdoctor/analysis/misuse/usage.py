"""DDP misuse: samplers that do not shard, a missing set_epoch (its findings: ``epochs.py``),
checkpoints, collectives inside forward (unused parameters: ``unused.py``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.analysis.misuse import reads
from ddpdoctor.analysis.misuse.epochs import epoch_loop, no_epoch_finding, replayed
from ddpdoctor.analysis.slow.phases import StepGrid, step_times
from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import distinct
from ddpdoctor.trace.rankfile import rank_view
from ddpdoctor.trace.reader import RankTrace, Run


def training_loaders(trace: RankTrace) -> dict[int, int]:
    """Loader id -> batches it fed into a grad-mode DDP forward on this rank: the loader of the
    last data wait before each training forward. A loader read in between (an evaluation pass
    on ``model.module``) is not one, though a training forward follows its last batch too.
    Shared (a rank view, read by three detectors): never modify it."""
    return trace.view(_training_loaders)


@rank_view
def _training_loaders(trace: RankTrace) -> dict[int, int]:
    """``training_loaders``, computed where the trace is read."""
    waits, fwd = trace.kind(schema.DATA_WAIT), trace.kind(schema.FORWARD)
    if not len(waits) or not len(fwd):
        return {}
    order = np.argsort(waits.ts, kind="stable")
    prev = distinct(np.searchsorted(waits.ts[order], fwd.ts[fwd.ints(0) == 1]) - 1)
    prev = prev[prev >= 0]
    ids, counts = distinct(waits.ints(0)[order][prev], counts=True)
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))


def reads_everything(info: dict[str, Any]) -> bool:
    """Judged by effect: does one rank's pass cover the whole dataset (no sharding)? From the
    batches the loader gives this rank and its per-process batch size, whatever sampler, batch
    sampler or framework produced them; by the sampler's class only when those are unknown."""
    batches, size, total = info.get("batches"), info.get("batch_size"), info.get("dataset_len")
    if isinstance(batches, int) and isinstance(size, int) and isinstance(total, int) and total > 0:
        return batches * size >= total - (size - 1 if info.get("drop_last") else 0)
    return info.get("sampler") in ("RandomSampler", "SequentialSampler") and info.get("batch_sampler") in (
        "BatchSampler",
        None,
    )


@detector
def sampler_misuse(run: Run) -> Iterable[Finding]:
    if run.world_size < 2:
        return
    missing: dict[int, dict[str, Any]] = {}
    no_epoch: dict[int, dict[str, Any]] = {}
    unread: dict[int, dict[str, Any]] = {}  # set_epoch with no pass after it: a replay
    first: dict[int, reads.Digests | None] = {}  # each rank's first training pass
    for rank, trace in sorted(run.ranks.items()):
        fed = training_loaders(trace)
        by_sampler: dict[Any, list[tuple[dict[str, Any], reads.Digests | None]]] = defaultdict(list)
        for info, digests in reads.passes(trace):
            if info.get("id") in fed:
                by_sampler[info.get("sampler_id", info.get("id"))].append((info, digests))
                first.setdefault(rank, digests)
        for entries in by_sampler.values():
            infos = [info for info, _ in entries]
            info = infos[-1]
            if reads_everything(info):
                missing[rank] = info
            elif info.get("shuffle") and len(infos) >= 2:
                # By effect: a pass that begins as the one before did replays its order. By
                # the sampler's epoch only where the batches cannot tell.
                again = reads.replayed([d for _, d in entries])
                if again is None:
                    again = (
                        "DistributedSampler" in str(info.get("sampler"))
                        and len({i.get("epoch") for i in infos}) == 1
                    )
                if again:
                    no_epoch[rank] = dict(
                        info,
                        passes=len(infos),
                        proven=bool(reads.replayed([d for _, d in entries])),
                        one_epoch=len({i.get("epoch") for i in infos}) == 1,
                        epoch_loop=epoch_loop(trace, list(info.get("stack") or [])),
                    )
        replay = reads.unread_epochs(trace, fed)
        if replay is not None and rank not in no_epoch:
            unread[rank] = replay
    identical = reads.same_data(first)
    if identical and not missing:  # sharded by count, yet every rank read the same batches
        missing = {rank: infos for rank, infos in _first_infos(run).items()}
        if "DistributedSampler" in str(next(iter(missing.values())).get("sampler")):
            yield _one_shard(missing)
            return
    if missing:
        info = next(iter(missing.values()))
        differ = identical is False
        evidence = (
            "every rank's passes begin with identical batches"
            if identical
            else f"every rank reads all {info.get('dataset_len', '?')} samples"
        )
        yield Finding(
            "missing_distributed_sampler",
            "info" if differ else "warning",
            sorted(missing),
            f"the training DataLoader uses a {info['sampler']} on rank(s) {rank_list(missing)}: "
            + (
                f"each rank's pass covers all {info.get('dataset_len', '?')} samples of its dataset, "
                "but the ranks read different batches: fine if the dataset is already split per rank"
                if differ
                else f"{evidence}, so the ranks train on the same data"
                + ("" if identical else " (unless your dataset is already split per rank)")
            ),
            fix="Pass sampler=DistributedSampler(dataset) to the DataLoader (and drop shuffle=True "
            "there; it takes rank and num_replicas from the process group), then call "
            "sampler.set_epoch(epoch) at the start of every epoch.",
            details={
                "place": info.get("site"),
                "batches_per_rank": info.get("batches"),
                "sampler": info["sampler"],
                "dataset_len": info.get("dataset_len"),
                "batch_size": info.get("batch_size"),
                "ranks": sorted(missing),
                "same_batches": identical,  # null: the batches were not digested
            },
        )
    if unread and not missing:
        yield replayed(unread)
    if no_epoch:
        yield no_epoch_finding(no_epoch)


def _one_shard(infos: dict[int, dict[str, Any]]) -> Finding:
    """DistributedSamplers that shard by count and still gave every rank the same batches: what
    each was built with says why (one rank given to all, a single replica), where it says."""
    info = next(iter(infos.values()))
    ranks = {i.get("sampler_rank") for i in infos.values()}
    replicas = {i.get("sampler_replicas") for i in infos.values()}
    created = f" created at {info['sampler_site']}" if info.get("sampler_site") else ""
    if len(ranks) == 1 and None not in ranks and None not in replicas:
        built = f" was built with rank={ranks.pop()} on every rank (num_replicas={min(replicas)})"
    elif replicas == {1}:
        built = " was built with num_replicas=1"
    else:
        built = ""
    return Finding(
        "missing_distributed_sampler",
        "warning",
        sorted(infos),
        f"the training DataLoader's {info['sampler']}{created}{built}: every rank's passes begin "
        f"with identical batches (ranks {rank_list(infos)}), so the ranks train on the same data",
        fix="Give each rank its own shard: DistributedSampler(dataset) takes rank and num_replicas "
        "from the process group; if you pass them, pass dist.get_rank() and "
        "dist.get_world_size(). torchrun passes no --local_rank argument (a parser default of 0 "
        "gives every rank rank 0's shard), and LOCAL_RANK is the rank within a node, not the "
        "global rank the sampler needs.",
        details={
            "place": info.get("sampler_site") or info.get("site"),
            "loop": info.get("site"),
            "sampler": info["sampler"],
            "sampler_ranks": {r: i.get("sampler_rank") for r, i in infos.items()},
            "num_replicas": {r: i.get("sampler_replicas") for r, i in infos.items()},
            "batches_per_rank": info.get("batches"),
            "dataset_len": info.get("dataset_len"),
            "batch_size": info.get("batch_size"),
            "ranks": sorted(infos),
            "same_batches": True,
        },
    )


def _first_infos(run: Run) -> dict[int, dict[str, Any]]:
    """Each rank's first training pass's loader description."""
    out = {}
    for rank, trace in sorted(run.ranks.items()):
        fed = training_loaders(trace)
        for info, _ in reads.passes(trace):
            if info.get("id") in fed:
                out[rank] = info
                break
    return out


@detector
def checkpoint_misuse(run: Run) -> Iterable[Finding]:
    writers: dict[tuple[str, str], set[int]] = defaultdict(set)
    prefixed: set[int] = set()
    unmapped: dict[int, str] = {}
    gpu_job = any("nccl" in str(t.header.get("backend", "")) for t in run.ranks.values())
    for rank, trace in sorted(run.ranks.items()):
        for _, _, info in trace.meta.get(schema.SAVE, []):
            if info.get("path"):
                writers[(trace.host, info["path"])].add(rank)
            if info.get("module_prefix"):
                prefixed.add(rank)
        for _, _, info in trace.meta.get(schema.LOAD, []):
            if gpu_job and info.get("path") and not info.get("map_location"):
                unmapped.setdefault(rank, info["path"])
    shared = {key: ranks for key, ranks in writers.items() if len(ranks) > 1}
    if shared:
        (host, path), ranks = max(shared.items(), key=lambda kv: len(kv[1]))
        yield Finding(
            "duplicate_checkpoint_writes",
            "warning",
            sorted(ranks),
            f"rank(s) {rank_list(ranks)} all write the same checkpoint {path}: they race on one "
            "file and waste I/O (every rank holds the same weights)",
            fix="Save on one rank only: `if dist.get_rank() == 0: torch.save(model.module.state_dict(), "
            "path)`, then `dist.barrier()` before any rank loads it.",
            details={"path": path, "host": host, "ranks": sorted(ranks), "files": len(shared)},
        )
    if prefixed:
        yield Finding(
            "checkpoint_module_prefix",
            "info",
            sorted(prefixed),
            "a checkpoint was saved from the DDP wrapper: its keys start with 'module.', so it "
            "will not load into the bare model",
            fix="Save model.module.state_dict() instead of model.state_dict().",
            details={"ranks": sorted(prefixed)},
        )
    if len(unmapped) > 1:
        yield Finding(
            "load_without_map_location",
            "warning",
            sorted(unmapped),
            f"rank(s) {rank_list(unmapped)} call torch.load without map_location in a multi-GPU "
            "job: tensors land on the GPU they were saved from (usually GPU 0) on every rank",
            fix="Pass map_location: torch.load(path, map_location=f'cuda:{local_rank}') (or 'cpu').",
            details={"paths": sorted(set(unmapped.values())), "ranks": sorted(unmapped)},
        )


@detector
def forward_sync_cost(run: Run) -> Iterable[Finding]:
    """broadcast_buffers and SyncBatchNorm make every forward a sync point: what it costs."""
    per_step: list[float] = []
    kind = ""
    for trace in run.ranks.values():
        sync = trace.kind(schema.SYNC_BUFFERS)
        if len(sync):
            kind = "buffer broadcast (broadcast_buffers=True)"
            per_step.append(_median_per_step(sync.step, sync.dur))
        else:
            fwd, coll = trace.kind(schema.FORWARD), trace.kind(schema.COLLECTIVE)
            inside = _inside(coll, fwd)
            if inside.any():
                kind = _forward_collective_source(trace, coll, inside)
                per_step.append(_median_per_step(coll.step[inside], coll.dur[inside]))
    if not per_step:  # the common case: no step times read (80 MB at 1,024 ranks)
        return
    all_steps = np.concatenate([step_times(trace) for trace in run.ranks.values()])
    if not len(all_steps):
        return
    cost_ms, step_ms = float(np.median(per_step)) / 1e3, float(np.median(all_steps)) * 1e3
    if cost_ms < 0.05 * step_ms or cost_ms < 0.2:
        return
    own = "your code" in kind
    yield Finding(
        "forward_sync_cost",
        "info",
        sorted(run.ranks),
        f"every forward is a sync point: the {kind} takes {cost_ms:.1f} ms per step "
        f"({100 * cost_ms / step_ms:.0f}% of a {step_ms:.1f} ms step), and a slow rank makes the "
        "others wait there",
        fix="Sync metrics less often (once per epoch, or log without a per-step all_reduce)."
        if own
        else "If buffers need no syncing (they are identical, or BatchNorm statistics may differ per "
        "rank), pass broadcast_buffers=False; use SyncBatchNorm only where small per-rank batches "
        "need it.",
        details={"kind": kind, "ms_per_step": round(cost_ms, 3), "step_ms": round(step_ms, 3)},
    )


def _median_per_step(steps: np.ndarray, durs: np.ndarray) -> float:
    """The typical step's total (µs): a median over steps, so one long wait (a peer that died,
    a checkpoint) is not spread over every step as a mean would."""
    grid = StepGrid.spanning([steps])
    sums, present = grid.put(steps, durs, np.add)
    return float(np.median(sums[present])) if present.any() else 0.0


def _forward_collective_source(trace: Any, coll: Any, inside: np.ndarray) -> str:
    """What issues the collectives inside forward, judged by op and call site: SyncBatchNorm
    all-gathers its statistics; an all_reduce or broadcast from the user's line (a metric, a
    framework's logging such as Lightning's self.log(sync_dist=True)) is the user's own."""
    ops = [str(f[0]) for f, keep in zip(coll.fields, inside.tolist(), strict=True) if keep]
    top = Counter(ops).most_common(1)[0][0]
    if top.startswith("all_gather"):
        return "collectives inside forward (SyncBatchNorm's statistics all-gather)"
    sites = {int(i["id"]): f"{i.get('file', '?').rsplit('/', 1)[-1]}:{i.get('line')}" for _, _, i in
             trace.meta.get(schema.SITE, []) if isinstance(i.get("id"), int)}  # fmt: skip
    ids = [f[6] for f, keep in zip(coll.fields, inside.tolist(), strict=True) if keep and len(f) > 6]
    where = sites.get(Counter(ids).most_common(1)[0][0], "") if ids else ""
    at = f" at {where}" if where else ""
    return f"collectives your code issues inside forward ({top}{at}: a metric or logging sync)"


def _inside(inner: Any, outer: Any) -> np.ndarray:
    """Which ``inner`` events start inside some ``outer`` event (both sorted by start)."""
    if not len(inner) or not len(outer):
        return np.zeros(len(inner), dtype=bool)
    starts, ends = outer.ts, outer.end
    if not (np.diff(starts) > 0).all():  # strictly in order (the usual trace): no sort to do
        order = np.argsort(starts)
        starts, ends = starts[order], ends[order]
    idx = np.searchsorted(starts, inner.ts, side="right") - 1
    ok = idx >= 0
    result = np.zeros(len(inner), dtype=bool)
    result[ok] = inner.ts[ok] < ends[idx[ok]]
    return result
