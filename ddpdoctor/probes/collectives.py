"""``init_process_group`` (which makes a process a rank) and every Python-level collective.

Each collective records op, bytes, group, group size and the process group's collective
sequence number at entry: the number that lets a hang be pinned on ranks that disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema
from ddpdoctor.trace.schema import LivePhase

# Ops called from Python; DDP's own gradient all-reduce runs in C++ and is timed by the comm hook.
COLLECTIVE_OPS = (
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
PROBE = "collectives"
_now = time.monotonic_ns
_COLLECTIVE = LivePhase.COLLECTIVE
_KIND = schema.COLLECTIVE


def install() -> None:
    global _compiling
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
    patch(c10d, "init_process_group", _wrap_init)
    _mirror(dist, c10d, "init_process_group")
    for op in COLLECTIVE_OPS:
        if patch(c10d, op, _collective_wrapper(op)):
            _mirror(dist, c10d, op)


def _mirror(dist: Any, c10d: Any, name: str) -> None:
    """``torch.distributed`` re-exports c10d's functions: point its name at our wrapper too."""
    from ddpdoctor.probes.patching import original

    if getattr(dist, name, None) is original(getattr(c10d, name)):
        setattr(dist, name, getattr(c10d, name))


def _wrap_init(init: Callable[..., Any]) -> Callable[..., Any]:
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        import torch.distributed as dist

        _c.activate(dist)
        return result

    return init_process_group


def _never() -> bool:
    return False


_compiling: Callable[[], bool] = _never


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a collective's arguments (tensors, or lists of them)."""
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x) for x in obj[:1024])
    return 0


def group_info(group: Any, collector: _c.Collector) -> tuple[Any, str, int, int]:
    """(process group, its name, its size, its collective sequence number now); the name and
    size are looked up once per group."""
    pg = group if group is not None else collector.default_pg
    known = collector.groups.get(id(pg))
    if known is None or known[0] is not pg:
        name = "WORLD" if pg is collector.default_pg else str(getattr(pg, "group_name", "?"))
        known = collector.groups[id(pg)] = (pg, name, int(pg.size()))
    try:
        seq = int(pg._get_sequence_number_for_group())
    except Exception:
        seq = -1
    return pg, known[1], known[2], seq


def _collective_wrapper(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    always_async = op in ("isend", "irecv")

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            c = _c.ACTIVE
            if c is None or c.in_bucket_hook or PROBE in c.disabled or _compiling():
                return orig(*args, **kwargs)
            prev = c.progress
            if prev is not None and prev[0] is _COLLECTIVE:  # c.in_collective(), inlined
                return orig(*args, **kwargs)
            try:
                group = kwargs.get("group") if kwargs else None
                if group is None and len(args) > 1:
                    group = next((a for a in args if _is_group(a)), None)
                pg, gname, gsize, seq = group_info(group, c)
                nbytes = tensor_bytes(args[0]) if args else 0
                if not nbytes and kwargs:
                    nbytes = sum(tensor_bytes(v) for k, v in kwargs.items() if k != "group")
                is_async = 1 if always_async or (kwargs and kwargs.get("async_op")) else 0
                where = callsite.site(c)
            except Exception as exc:
                c.fail(PROBE, exc)
                return orig(*args, **kwargs)
            # c.enter and c.leave, inlined: this is the hottest probe
            t0 = _now()
            c.progress = (_COLLECTIVE, op, seq, t0, gname, gsize, nbytes, pg)
            try:
                result = orig(*args, **kwargs)
            except BaseException:
                c.raised(prev, _KIND, op, nbytes, gname, gsize, seq, is_async, where)
                raise
            t1 = _now()
            c.progress = prev
            c.events += 1
            c.record(_KIND, t0, t1, c.step, (op, nbytes, gname, gsize, seq, is_async, where))
            return result

        return collective

    return make


def _is_group(obj: Any) -> bool:
    return type(obj).__name__ in ("ProcessGroup", "ProcessGroupGloo", "ProcessGroupNCCL")
