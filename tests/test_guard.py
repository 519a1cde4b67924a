"""guard.passthrough: an exception a signal handler raised inside a probe is the program's."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ddpdoctor.probes import guard


@contextlib.contextmanager
def handler_installed(handler: Callable[[int, Any], None]) -> Iterator[Callable[[], Exception]]:
    """While ``handler`` handles SIGUSR2: a function that raises the signal and returns what the
    handler raised, caught as a probe's ``except`` would catch it."""

    def fire() -> Exception:
        try:
            signal.raise_signal(signal.SIGUSR2)
            time.sleep(0)  # the handler runs at the next bytecode, if it has not already
        except Exception as exc:
            return exc
        raise AssertionError("the handler did not raise")

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        yield fire
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_an_exception_from_a_signal_handler_is_passed_through() -> None:
    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("from the handler")

    with handler_installed(on_alarm) as fire:
        exc = fire()
        assert guard.raised_by_signal_handler(exc)
        with pytest.raises(TimeoutError, match="from the handler"):
            guard.passthrough(exc)


def test_a_bound_method_handler_counts_too() -> None:
    class Watchdog:
        def fire(self, signum: int, frame: Any) -> None:
            raise RuntimeError("watchdog")

    with handler_installed(Watchdog().fire) as fire:
        assert guard.raised_by_signal_handler(fire())


def test_a_probes_own_error_is_not() -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        assert not guard.raised_by_signal_handler(exc)
        guard.passthrough(exc)  # returns: the probe logs it and switches off


def test_the_error_record_marks_where_the_signal_came_in() -> None:
    """The rank's error record says which frame is the handler's: the frames before it are the
    code the signal interrupted, where the analysis places the error."""
    from ddpdoctor.analysis.failed.stacks import raised_where
    from ddpdoctor.probes.liveness import _format_error

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("step over budget")

    def slow_step(fire: Callable[[], Exception]) -> Exception:
        return fire()

    with handler_installed(on_alarm) as fire:  # recorded as the excepthook does: handler in place
        exc = slow_step(fire)
        record = _format_error(TimeoutError, exc, exc.__traceback__, "MainThread")
    at = record["signal_handler"]
    assert record["frames"][at][2] == "on_alarm" and record["frames"][at - 1][2] == "fire"
    text = raised_where(record["frames"], at)
    assert "in fire, where the signal handler on_alarm (test_guard.py:" in text, text
    assert "signal_handler" not in _format_error(KeyError, KeyError("x"), None, "MainThread")
