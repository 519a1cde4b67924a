"""The probes' hot paths in C (``probes/_fast.c``): a collective called from a call site seen
before is recorded without a Python frame, tuple or integer object per field (the Python path,
``collectives.py``, describes each new call site); every other event is packed into the ring
in C (``trace/writer.py``'s pack); a call site learnt before is found in C (``callsite.py``).

The C module is optional: built at install where a compiler is (pyproject's ext-modules), it
is skipped where it is not, where it was built for another interpreter, and under
``DDPDOCTOR_PURE_PYTHON=1`` (A/B measurements; tests that compare both paths' records).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes import guard

_UNSET: Any = object()
_module: Any = _UNSET


def module() -> Any:
    """The C module, or None where the Python path runs alone (decided once per process)."""
    global _module
    if _module is _UNSET:
        _module = _load()
    return _module


def _load() -> Any:
    if os.environ.get(_env.PURE_PYTHON) == "1":
        return None
    try:
        from ddpdoctor.probes import _fast
        from ddpdoctor.trace import ring

        built = (
            _fast.RING_HEADER,
            _fast.RING_SLOT,
            *(getattr(_fast, k, None) for k in ("RING_VOID", "RING_CALL_AT")),
        )
        if built != (ring.HEADER_BYTES, ring.SLOT, ring.VOID, ring.CALL_AT):
            return None  # built from another version of the ring's layout
        return _fast
    except Exception as exc:
        guard.passthrough(exc)
        return None


def packer(fmt: str, kid: int) -> Callable[..., Any] | None:
    """The C packer of one kind's events (``struct`` format ``fmt``), or None (Python's)."""
    fast = module()
    try:
        return fast.Packer(fmt, kid) if fast is not None else None
    except Exception as exc:  # a layout the C packer does not know
        guard.passthrough(exc)
        return None


def _broke(c: Any, exc: BaseException) -> None:
    """The C path's ``except Exception`` before the call: log it, switch the probe off."""
    from ddpdoctor.probes.collectives import PROBE

    c.fail(PROBE, exc)


def collective(
    fast_module: Any,
    op: str,
    orig: Callable[..., Any],
    slow: Callable[..., Any],
    always_async: int,
    compiling: Callable[[], bool],
) -> Callable[..., Any]:
    """The wrapper that runs ``_fast.Collective`` (a call site seen before, in C) and ``slow``,
    the Python path, for everything else. It is a Python function so that torch.compile inlines
    it and sees ``is_compiling()``, as it does the Python path, until ``direct_calls()`` can hand
    dynamo a stand-in and put the C call itself in its place."""
    import torch
    from torch import Tensor

    from ddpdoctor.probes import callsite
    from ddpdoctor.probes import collector as _c
    from ddpdoctor.probes.collectives import _COLLECTIVE, _KIND, _ROOT_ARG
    from ddpdoctor.trace import schema
    from ddpdoctor.trace.ring import slot_struct

    pos, names, default = _ROOT_ARG.get(op, (0, None, -1))
    fast = fast_module.Collective(
        orig=orig,
        slow=slow,
        failed=_broke,
        of_frame=callsite.of_frame,
        globals=vars(_c),
        tensor=Tensor,
        phase=_COLLECTIVE,
        op=op,
        kind=_KIND,
        fmt=slot_struct(schema.KINDS[_KIND].spec).format,
        always_async=bool(always_async),
        root_pos=pos,
        root_names=names,
        root_default=default,
        depth=1,  # the user's frame is this wrapper's caller
        compiler=vars(torch.compiler),
    )

    def collective(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return orig(*args, **kwargs)
        return fast(args, kwargs)

    collective.__ddpdoctor_probe__ = fast  # type: ignore[attr-defined]
    return collective


_wrappers: dict[str, Any] = {}  # op -> the Python wrapper a C call stands in for
_native: dict[str, Any] = {}  # op -> the C call in torch's place: dynamo keys its stand-in by id


def direct_calls(ops: tuple[str, ...]) -> None:
    """Put each collective's C call (``Collective.call``) where torch.distributed's name points
    at the Python wrapper: no Python frame, tuple of arguments or ``is_compiling()`` call per
    collective. Dynamo cannot inline a C function, so it is first given a Python stand-in that
    calls the wrapper (``torch.compiler.substitute_in_graph``). That needs ``torch._dynamo``,
    which is not imported for it (its import reads the user's settings): this runs once it is
    (DDP's constructor imports it). Names imported before keep the Python wrapper, which
    records the same."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if getattr(dynamo, "substitute_in_graph", None) is None:
        return
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if not hasattr(torch.compiler, "_is_compiling_flag"):
            return  # is_compiling() reads another flag in this torch: the wrapper asks it
        for op in ops:
            wrapper = getattr(c10d, op, None)
            fast = getattr(wrapper, "__ddpdoctor_probe__", None)
            if op in _native or fast is None:
                continue
            call = fast.call
            _wrappers[op] = wrapper
            torch.compiler.substitute_in_graph(call, skip_signature_check=True)(_stand_in(op))
            _native[op] = call
            setattr(c10d, op, call)
            if getattr(dist, op, None) is wrapper:
                setattr(dist, op, call)
    except Exception as exc:  # a dynamo that refuses it: the wrappers stay
        guard.passthrough(exc)


def _stand_in(op: str) -> Callable[..., Any]:
    """What dynamo inlines for a collective's C call: the Python wrapper, which it rewrites to
    its traceable collective (``torch.distributed._functional_collectives`` keys its remaps by
    the function c10d's name held when it was imported: the wrapper if that was after us) or
    inlines, calling torch's function. Read from this module's ``_wrappers``: dynamo builds
    the stand-in with no source, and rewrites only a value read from somewhere it can name."""

    def collective(*args: Any, **kwargs: Any) -> Any:
        return _wrappers[op](*args, **kwargs)

    return collective
