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
            *(getattr(_fast, k, None) for k in ("RING_VOID", "RING_CALL_AT", "RING_BODY_AT", "RING_SEQ_AT")),
        )
        if built != (ring.HEADER_BYTES, ring.SLOT, ring.VOID, ring.CALL_AT, ring.BODY_AT, ring.SEQ_AT):
            return None  # built from another version of the ring's layout
        return _fast
    except Exception as exc:
        guard.passthrough(exc)
        return None


def seqs(mm: Any, mask: int) -> Any:
    """A ring's event numbers: held in C where the C module is, so that the C packers write
    through them (``trace/ring.py``'s ``Seqs``)."""
    fast = module()
    if fast is not None:
        return fast.RingSeqs(mm, mask)
    from ddpdoctor.trace.ring import Seqs

    return Seqs(mm, mask)


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
    the Python path, for everything else. It stays a Python function so that torch.compile
    inlines it and sees it compiling, as it does the Python path. Dynamo folds
    ``is_dynamo_compiling()`` to True, and eagerly it is one call that returns False; the rest of
    ``is_compiling()``, torch.export's flag, the C object reads from ``torch.compiler``'s dict.
    That leaves the eager call two Python frames fewer than ``is_compiling()`` did."""
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
        compiler=vars(torch.compiler) if hasattr(torch, "compiler") else {},
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
    )

    dynamo = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", compiling)

    def collective(*args: Any, **kwargs: Any) -> Any:
        if dynamo():
            return orig(*args, **kwargs)
        return fast(args, kwargs)

    return collective
