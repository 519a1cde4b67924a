"""DataLoader waits and DataLoader passes (sampler, epoch, batch size, what the first batches
held), and where each DistributedSampler was created and had ``set_epoch`` called: a training
loop that calls ``set_epoch`` on another sampler (a name reused for the validation one) is then
told where both are (called once per sampler or epoch: a stack walk each)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import guard
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase

PROBE = "data"
_now = time.monotonic_ns
_LOADER_ID = "_ddpdoctor_loader"
_PASSES = "_ddpdoctor_passes"  # on the DataLoader: passes begun so far
_PASS = "_ddpdoctor_pass"  # on the iterator: (pass number, batches given so far)
DIGESTED = 2  # first batches of each pass digested: enough to tell orders and ranks apart
SAMPLE = 4096  # elements of each tensor hashed, evenly spaced: microseconds, whatever its size
VISITS = 512  # objects a digest looks at, nested lists of lists included
_NEXT = LivePhase.DATA.op
_SITE = "_ddpdoctor_site"  # on a DistributedSampler: the user's line that created it
_SET_EPOCH = "_ddpdoctor_set_epoch"  # on it: (set_epoch calls, the last call's line)
_LAST_SET_EPOCH: list[tuple[int, str, str] | None] = [None]  # (sampler id, its line, the call's)


def install() -> None:
    from torch.utils.data import dataloader, distributed

    patch(dataloader._BaseDataLoaderIter, "__next__", _wrap_next)
    patch(dataloader.DataLoader, "__iter__", _wrap_iter)
    patch(distributed.DistributedSampler, "__init__", _wrap_sampler_init)
    patch(distributed.DistributedSampler, "set_epoch", _wrap_set_epoch)


def _wrap_sampler_init(init: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _c.ACTIVE is not None and not hasattr(self, _SITE):  # a subclass's super(): its caller's
            try:
                setattr(self, _SITE, _caller_site())
            except Exception as exc:
                guard.passthrough(exc)

    return __init__


def _wrap_set_epoch(set_epoch: Callable[..., None]) -> Callable[..., None]:
    def wrapped(self: Any, epoch: int) -> None:
        set_epoch(self, epoch)
        if _c.ACTIVE is not None:
            try:
                site = _caller_site()
                calls = getattr(self, _SET_EPOCH, (0, ""))[0]
                setattr(self, _SET_EPOCH, (calls + 1, site))
                _LAST_SET_EPOCH[0] = (id(self), str(getattr(self, _SITE, "")), site)
                # when: a set_epoch no pass of its loader follows never reaches the batches
                _c.ACTIVE.meta(schema.SET_EPOCH, {"sampler_id": id(self), "epoch": int(epoch), "site": site})
            except Exception as exc:
                guard.passthrough(exc)

    return wrapped


def _wrap_next(next_: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __next__(self: Any) -> Any:
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return next_(self)
        prev = c.enter(LivePhase.DATA, _NEXT, -1)
        try:
            batch = next_(self)
        except StopIteration:  # the end of the pass: nothing was waited for
            c.leave(prev, None)
            raise
        except BaseException:  # a worker died, a sample raised: the rank stopped in this wait
            c.raised(prev, schema.DATA_WAIT, getattr(self, _LOADER_ID, 0))
            raise
        c.leave(prev, schema.DATA_WAIT, getattr(self, _LOADER_ID, 0))
        counted = getattr(self, _PASS, None)
        if counted is not None and counted[1] < DIGESTED:
            try:
                setattr(self, _PASS, (counted[0], counted[1] + 1))
                info = {"id": getattr(self, _LOADER_ID, 0), "pass": counted[0], "batch": counted[1]}
                info["digest"], info["elements"] = digest(batch)
                c.meta(schema.BATCHES, info)
            except Exception as exc:
                c.fail(PROBE, exc)
        return batch

    return __next__


def _wrap_iter(iter_: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def __iter__(self: Any) -> Any:
        it = iter_(self)
        c = _c.ACTIVE
        if c is None or PROBE in c.disabled:
            return it
        try:
            setattr(it, _LOADER_ID, id(self))
            passes = getattr(self, _PASSES, 0)
            setattr(self, _PASSES, passes + 1)
            setattr(it, _PASS, (passes, 0))
            info = describe_loader(self)
            where = _caller()
            if where:
                info["site"] = where[0].split(" ")[0]
                info["stack"] = where
            c.meta(schema.LOADER, info)
        except Exception as exc:
            c.fail(PROBE, exc)
        return it

    return __iter__


# Training steps whose forward inputs are counted (``count_inputs``): the first few, then one
# in every INPUT_EVERY, so that a job that makes its own batches (no DataLoader) still says how
# much each rank's steps held. A counted forward takes the Python path and writes a record at
# once: about 75 µs with cold caches, which once in 64 steps added 1.2 µs to every forward
# (docs/overhead.md, twenty-ninth round); once in 1,024, 0.07 µs.
INPUT_SAMPLES = 8
INPUT_EVERY = 1024


def count_inputs(c: Any, inputs: tuple, kwargs: dict) -> None:
    """Record the tensor elements a training forward's inputs hold (the DDP forward probe calls
    this at step ``c.inputs_at``, which the C path reads to come here) and the next step due."""
    step = c.step
    c.inputs_at = step + 1 if step + 1 < INPUT_SAMPLES else (step // INPUT_EVERY + 1) * INPUT_EVERY
    c.meta(schema.INPUTS, {"elements": digest((inputs, kwargs), hashed=False)[1]})


def digest(batch: Any, hashed: bool = True) -> tuple[str | None, int]:
    """(a short hash of what a batch holds, its tensors' elements). The hash: each CPU tensor's
    dtype, shape and up to ``SAMPLE`` evenly spaced elements, and plain values (labels, paths);
    two ranks that read the same samples in the same order get the same digest; None when
    nothing in it can be read without a device sync (tensors already on a GPU), or not
    ``hashed``. The elements say how much work the batch is (sequence lengths, image sizes that
    differ by rank)."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    seen = [0, 0, 0]  # values hashed, tensor elements, objects visited

    def visit(x: Any, depth: int) -> None:
        if depth > 4 or seen[0] > 32 or seen[2] > VISITS:
            return
        seen[2] += 1
        if isinstance(x, torch.Tensor):
            seen[1] += x.numel()
            if x.device.type != "cpu" or x.is_sparse or not hashed:
                return
            flat = x.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].contiguous()
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
            seen[0] += 1
        elif isinstance(x, dict):
            for key in sorted(x, key=str):
                h.update(str(key).encode())
                visit(x[key], depth + 1)
        elif isinstance(x, (list, tuple)):
            for item in x[:64]:
                visit(item, depth + 1)
        elif isinstance(x, (str, bytes, int, float, bool)) and hashed:
            h.update(repr(x)[:256].encode())
            seen[0] += 1

    visit(batch, 0)
    return (h.hexdigest() if seen[0] else None), seen[1]


def describe_loader(loader: Any) -> dict[str, Any]:
    """What the misuse findings need: sampler type, its epoch and shuffle, batch sizes."""
    sampler = loader.sampler
    try:
        dataset_len: int | None = len(loader.dataset)
    except Exception as exc:
        guard.passthrough(exc)
        dataset_len = None
    try:
        batches: int | None = len(loader)
    except Exception as exc:
        guard.passthrough(exc)
        batches = None
    batch_size = loader.batch_size
    if batch_size is None:  # a batch sampler (Accelerate's shards, a custom one) holds it
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    return {
        "id": id(loader),
        "sampler": type(sampler).__name__,
        "sampler_id": id(sampler),
        "epoch": getattr(sampler, "epoch", None),
        "shuffle": bool(getattr(sampler, "shuffle", type(sampler).__name__ == "RandomSampler")),
        "batch_size": batch_size if isinstance(batch_size, int) else None,
        "batches": batches,  # this rank's batches per pass: what it reads, whatever shards it
        "drop_last": bool(loader.drop_last),
        "num_workers": int(loader.num_workers),
        "dataset_len": dataset_len,
        "batch_sampler": type(loader.batch_sampler).__name__ if loader.batch_sampler else None,
        **_sampler_sites(sampler),
    }


def _sampler_sites(sampler: Any) -> dict[str, Any]:
    """Where a DistributedSampler was created, the shard it was built to deal (rank and
    num_replicas), its set_epoch calls, and the last set_epoch on another sampler when it had
    none."""
    if not hasattr(sampler, _SITE):
        return {}
    calls, site = getattr(sampler, _SET_EPOCH, (0, ""))
    out: dict[str, Any] = {"sampler_site": getattr(sampler, _SITE), "set_epoch_calls": calls}
    for key, attr in (("sampler_rank", "rank"), ("sampler_replicas", "num_replicas")):  # its shard
        value = getattr(sampler, attr, None)
        if isinstance(value, int):
            out[key] = value
    if site:
        out["set_epoch_site"] = site
    last = _LAST_SET_EPOCH[0]
    if not calls and last is not None and last[0] != id(sampler):
        out["set_epoch_elsewhere"] = {"site": last[2], "sampler_site": last[1]}
    return out


def _caller_site() -> str:
    """The user's line (file:line) that called the wrapper calling this, "" when none."""
    where = _caller(3)
    return where[0].split(" ")[0] if where else ""


def _caller(depth: int = 2) -> list[str]:
    """ "file:line func" of the user's loop over the loader and of up to two user frames that
    called it (once per pass, so a plain stack walk): a loop inside a helper is named with the
    line that called the helper."""
    import os
    import sys

    from ddpdoctor.trace.stacktext import is_user_frame

    frame, found = sys._getframe(depth), []
    for _ in range(64):
        if frame is None or len(found) == 3:
            break
        code = frame.f_code
        if is_user_frame(code.co_filename):
            found.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return found
