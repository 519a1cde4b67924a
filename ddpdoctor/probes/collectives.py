"""``init_process_group`` (which makes a process a rank), ``new_group`` and every Python-level
collective.

Each collective records its whole signature: op, bytes, group, group size, the process group's
collective sequence number at entry (the number that lets a hang be pinned on ranks that
disagree), the user's call site, the first tensor's dtype and element count, the root
(``src``/``dst``) and the group's members. Ranks that disagree on any of them at one sequence
number cannot complete that collective together, and the diagnosis names which one differs.
``new_group`` is recorded as a collective of the default group: every rank must call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ddpdoctor.probes import callsite, fastpath, guard
from ddpdoctor.probes import collector as _c
from ddpdoctor.probes.patching import patch
from ddpdoctor.trace import schema
from ddpdoctor.trace.livephase import LivePhase
from ddpdoctor.trace.ring import CALL as _CALL
from ddpdoctor.trace.ring import CALL_AT as _CALL_AT
from ddpdoctor.trace.ring import HEADER_BYTES as _SLOTS_AT
from ddpdoctor.trace.ring import SLOT as _SLOT

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
# Where an op takes its root rank: (position in *args, keyword names, default when not given).
_ROOT_ARG: dict[str, tuple[int, tuple[str, ...], int]] = {
    "broadcast": (1, ("src", "group_src"), -1),
    "reduce": (1, ("dst", "group_dst"), -1),
    "gather": (2, ("dst", "group_dst"), 0),
    "scatter": (2, ("src", "group_src"), 0),
    "broadcast_object_list": (1, ("src", "group_src"), 0),
    "gather_object": (2, ("dst", "group_dst"), 0),
    "scatter_object_list": (2, ("src", "group_src"), 0),
    "send": (1, ("dst", "group_dst"), -1),
    "recv": (1, ("src", "group_src"), -1),
    "isend": (1, ("dst", "group_dst"), -1),
    "irecv": (1, ("src", "group_src"), -1),
}
_dtypes: dict[Any, str] = {}  # torch.dtype -> "float32", named once
_members: dict[int, str] = {}  # id(process group) -> "0 1" (its global ranks; "" for WORLD)
_enter = _CALL.pack_into
_sigs: dict[tuple[str, int, int, str], int] = {}  # signature -> its interned id
_sig_owner: list[Any] = [None]  # the collector the ids were declared to


def install() -> None:
    global _compiling
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
    patch(c10d, "init_process_group", _wrap_init)
    _mirror(dist, c10d, "init_process_group")
    if patch(c10d, "new_group", _wrap_new_group):
        _mirror(dist, c10d, "new_group")
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

        if _c.activate(dist) is not None:
            from ddpdoctor.probes import native

            native.module()  # the C++ timer, where built: the C probes read sequence numbers with it
            try:
                from ddpdoctor.probes import lightning

                lightning.install()
            except Exception as exc:  # lose the probe, not the job
                if _c.ACTIVE is not None:
                    _c.ACTIVE.fail("lightning", exc)
        return result

    return init_process_group


def _wrap_new_group(new_group: Callable[..., Any]) -> Callable[..., Any]:
    """A collective of the default group: a rank that calls it waits for every other rank to."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c = _c.ACTIVE
        if c is None or c.in_collective() or PROBE in c.disabled:
            return new_group(*args, **kwargs)
        try:
            ranks = kwargs.get("ranks", args[0] if args else None)
            new_ranks = " ".join(str(int(r)) for r in sorted(ranks)) if ranks else ""
            pg, _, gsize, seq = group_info(None, c)
            sig = ("", 0, -1, new_ranks)
            fields = ("new_group", 0, "WORLD", gsize, seq, 0, callsite.site(c), sig_id(c, sig))
        except Exception as exc:
            c.fail(PROBE, exc)
            return new_group(*args, **kwargs)
        prev = c.enter(LivePhase.COLLECTIVE, "new_group", seq, group=("WORLD", gsize, 0, pg, sig))
        try:
            return new_group(*args, **kwargs)
        finally:
            c.leave(prev, schema.COLLECTIVE, *fields)

    return wrapper


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
    except Exception as exc:
        guard.passthrough(exc)
        seq = -1
    return pg, known[1], known[2], seq


def signature(op: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, int, int]:
    """(dtype of the first tensor, element count of the tensors, root rank or -1): attribute
    reads and a dict lookup, no formatting on the hot path (about a microsecond)."""
    first = args[0] if args else next((v for k, v in kwargs.items() if k != "group"), None)
    root = _root(op, args, kwargs) if op in _ROOT_ARG else -1
    if first.__class__ is list or first.__class__ is tuple:
        tensors = first[:1024]
        if not tensors:
            return "", 0, root
        head = tensors[0]
    else:
        tensors, head = None, first
    dtype = getattr(head, "dtype", None)
    if dtype is None:
        return "", 0, root
    name = _dtypes.get(dtype)
    if name is None:
        name = _dtypes[dtype] = str(dtype).replace("torch.", "")
    if tensors is None:
        return name, head.numel(), root
    return name, sum(int(t.numel()) for t in tensors if hasattr(t, "numel")), root


def _root(op: str, args: tuple, kwargs: dict[str, Any]) -> int:
    pos, names, default = _ROOT_ARG[op]
    for name in names:
        value = kwargs.get(name)
        if value is not None:
            return int(value)
    if len(args) > pos and isinstance(args[pos], int):
        return int(args[pos])
    return default


def sig_id(c: _c.Collector, sig: tuple[str, int, int, str]) -> int:
    """The interned id of a signature: one dict lookup; the first time, one metadata record
    (an event stays one ring slot, and a loop's repeated call costs no bytes)."""
    if _sig_owner[0] is not c:
        _sigs.clear()
        _sig_owner[0] = c
    sid = _sigs.get(sig)
    if sid is None:
        sid = _sigs[sig] = len(_sigs)
        dtype, numel, root, ranks = sig
        c.meta(schema.SIGNATURE, {"id": sid, "dtype": dtype, "numel": numel, "root": root, "ranks": ranks})
    return sid


def members(pg: Any, name: str) -> str:
    """The group's global ranks ("0 1"), "" for WORLD; looked up once per group."""
    if name == "WORLD":
        return ""
    key = id(pg)
    text = _members.get(key)
    if text is None:
        try:
            import torch.distributed as dist

            text = " ".join(str(int(r)) for r in dist.get_process_group_ranks(pg))
        except Exception as exc:
            guard.passthrough(exc)
            text = ""
        _members[key] = text
    return text


_CALLS_MAX = 4096  # call sites x shapes remembered per rank (a loop of ever-new sizes stops here)


def _collective_wrapper(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    import sys

    from torch import Tensor

    always_async = 1 if op in ("isend", "irecv") else 0
    has_root = op in _ROOT_ARG
    getframe = sys._getframe
    fast_module = fastpath.module()

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        depth = 1  # the user's frame; 2 when this runs under fastpath's wrapper

        def collective(*args: Any, **kwargs: Any) -> Any:
            c = _c.ACTIVE
            if c is None or c.in_bucket_hook or PROBE in c.disabled or _compiling():
                return orig(*args, **kwargs)
            prev = c.progress
            if prev is not None and prev[0] is _COLLECTIVE:  # c.in_collective(), inlined
                return orig(*args, **kwargs)
            try:
                if kwargs:
                    group = kwargs.get("group")
                    async_ = 1 if always_async or kwargs.get("async_op") else 0
                else:
                    group, async_ = None, always_async
                if group is None and len(args) > 1:
                    group = next((a for a in args if _is_group(a)), None)
                root = _root(op, args, kwargs) if has_root else -1
                frame = getframe(depth)
                head = args[0] if args else None
                # What a record shares with every call from this instruction on a tensor of
                # this dtype and size: all but the times and the sequence number.
                key = None
                if isinstance(head, Tensor):
                    key = (id(frame.f_code), frame.f_lasti, group, async_, root, head.dtype, head.nbytes)
                known = c.calls.get(key) if key is not None else None
                if known is None:
                    known = _describe(c, op, args, kwargs, group, async_, root, frame, key)
                pg, gname, gsize, nbytes, sig, op_id, gid, async_, site, sid, seq_of, walk, _ = known
                if walk:  # called from a library: whose line called it varies
                    site = callsite.of_frame(c, frame)[0]
                seq = seq_of()
                ring = c.writer.ring
                if ring is not None:  # the call it died in, if it dies in it (trace/ring.py)
                    _enter(ring.mm, _CALL_AT, seq, sid, site)
            except Exception as exc:
                c.fail(PROBE, exc)
                return orig(*args, **kwargs)
            # c.enter, c.leave and writer.pack, inlined: this is the hottest probe
            t0 = _now()
            c.progress = (_COLLECTIVE, op, seq, t0, gname, gsize, nbytes, pg, sig)
            try:
                result = orig(*args, **kwargs)
            except BaseException:
                c.raised(prev, _KIND, op, nbytes, gname, gsize, seq, async_, site, sid)
                raise
            t1 = _now()
            c.progress = prev
            c.events += 1
            ring = c.writer.ring
            if ring is not None:
                # the C packer claims and fills the slot in one call: no signal handler runs
                # between (one raised after a claim would leave the slot unwritten: ring.py)
                fast = c.collective_kind.fast
                if fast is not None:
                    fields = (op_id, nbytes, gid, gsize, seq, async_, site, sid)
                    if fast(ring, c.step, t0, t1, fields) is None:
                        return result
                n = ring.seqs.next()
                at = _SLOTS_AT + (n & ring.mask) * _SLOT
                pack, kid = c.collective_pack
                try:
                    pack(
                        ring.mm, at, kid, c.step, t0, t1, op_id, nbytes, gid, gsize, seq, async_, site, sid, n
                    )
                except Exception as exc:  # a value that does not fit its declared type
                    guard.passthrough(exc)
                    fields = (op_id, nbytes, gid, gsize, seq, async_, site, sid)
                    c.writer.pack_odd(c.collective_kind, ring, at, (c.step, t0, t1), fields, n)
                ring.seqs.head = n
            return result

        if fast_module is None:
            return collective
        try:
            wrapper = fastpath.collective(fast_module, op, orig, collective, always_async, _compiling)
        except Exception as exc:  # a record layout the C path does not know: Python's alone
            guard.passthrough(exc)
            return collective
        depth = 2
        return wrapper

    return make


def _describe(
    c: _c.Collector,
    op: str,
    args: tuple,
    kwargs: dict[str, Any],
    group: Any,
    is_async: int,
    root: int,
    frame: Any,
    key: tuple | None,
) -> tuple:
    """A collective call's fixed part, kept for ``key``: (process group, its name, its size,
    bytes, signature, then the record's interned fields but the sequence number: op, group,
    async, site, signature id; how to read the group's sequence number, whether the call came
    from a library's line, whose user's line must be looked up on each call, and the code)."""
    pg, gname, gsize, seq = group_info(group, c)
    seq_of = pg._get_sequence_number_for_group if seq >= 0 else _no_seq
    nbytes = tensor_bytes(args[0]) if args else 0
    if not nbytes and kwargs:
        nbytes = sum(tensor_bytes(v) for k, v in kwargs.items() if k != "group")
    where, direct = callsite.of_frame(c, frame)
    dtype, numel, _ = signature(op, args, kwargs)
    sig = (dtype, numel, root, "" if gname == "WORLD" else members(pg, gname))
    sid = sig_id(c, sig)
    intern = c.writer.intern
    known = (  # the code: its id is in key, so it must outlive the entry
        *(pg, gname, gsize, nbytes, sig, intern(op), intern(gname), is_async, where, sid),
        *(seq_of, not direct, frame.f_code),
    )
    if key is not None and len(c.calls) < _CALLS_MAX:
        c.calls[key] = known
    return known


def _no_seq() -> int:
    return -1


def _is_group(obj: Any) -> bool:
    return type(obj).__name__ in ("ProcessGroup", "ProcessGroupGloo", "ProcessGroupNCCL")
