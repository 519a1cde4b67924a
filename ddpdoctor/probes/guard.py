"""A probe's own failure, or the patient's exception raised inside a probe by chance.

A probe catches what it raises, so that a broken probe costs the job nothing. But Python runs
signal handlers in the main thread between any two bytecodes, inside a probe as anywhere else:
the DataLoader's SIGCHLD handler raises "DataLoader worker ... is killed by signal" wherever
the training loop happens to be when the kernel's OOM killer strikes a worker, a user's SIGALRM
handler raises its timeout. Such an exception belongs to the program; caught by a probe, the
job would fail later with another error (the loader's "exited unexpectedly", its cause lost) or
not at all. Every probe's ``except Exception`` that goes on without re-raising calls
``passthrough`` first.
"""

from __future__ import annotations

import signal
from types import CodeType, TracebackType


def passthrough(exc: BaseException) -> None:
    """Re-raise ``exc`` when a signal handler raised it (it is the program's, not ours)."""
    if raised_by_signal_handler(exc):
        raise exc


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` came out of one of the process' Python signal handlers: its traceback
    passes through a handler's frame. Looked up only when a probe has caught something."""
    return handler_frame(exc.__traceback__) is not None


def handler_frame(tb: TracebackType | None) -> int | None:
    """The position in a traceback (outermost first) of the first frame of one of the process'
    Python signal handlers, None when it passes through none: the frames before it are the code
    the signal interrupted, which is where the program was."""
    codes = _handler_codes()
    i = 0
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return i
        tb, i = tb.tb_next, i + 1
    return None


def _handler_codes() -> set[CodeType]:
    codes = set()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)  # a bound method's too
        if isinstance(code, CodeType):
            codes.add(code)
    return codes
