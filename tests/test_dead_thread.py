"""A rank stuck in its own code waiting on a primitive, after one of its threads died of an
exception: the thread is named as the cause, only when both facts hold."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.hung.threads import dead_thread
from ddpdoctor.trace import schema

JOIN = [
    {"function": "Condition.wait", "file": "/usr/lib/python3.11/threading.py", "line": 327},
    {"function": "Queue.join", "file": "/usr/lib/python3.11/queue.py", "line": 90},
    {"function": "MetricsWriter.flush", "file": "/job/train.py", "line": 58},
    {"function": "main", "file": "/job/train.py", "line": 100},
]
SPIN = [{"function": "busy", "file": "/job/train.py", "line": 12}, JOIN[-1]]
DIED = {
    "type": "ValueError",
    "message": "Out of range float values are not JSON compliant",
    "thread": "metrics-writer",
    "frames": [
        ["/usr/lib/python3.11/threading.py", 982, "run"],
        ["/job/train.py", 51, "_run"],
        ["/usr/lib/python3.11/json/__init__.py", 238, "dumps"],
    ],
}


def _judge(stack: list[dict[str, Any]], errors: list[dict[str, Any]], pattern: str = "user_code") -> Finding:
    said = "Rank(s) 1 never reached collective #15."
    finding = Finding("hang", "error", [1], said, fix="Look at the stack.")
    finding.details.update({"pattern": pattern, "ranks": {"1": {"stack": stack}, "0": {"stack": []}}})
    run = SimpleNamespace(ranks={1: SimpleNamespace(meta={schema.RANK_ERROR: [(5, 9, e) for e in errors]})})
    return dead_thread(finding, run)  # type: ignore[arg-type]


def test_a_wait_on_a_queue_after_its_thread_died_names_the_thread_and_its_error() -> None:
    f = _judge(JOIN, [DIED])
    said = " ".join(f.summary.split())
    assert "It waits in Queue.join() (train.py:58) for work of a thread that died" in said, said
    assert "'metrics-writer' raised ValueError: Out of range float values" in said, said
    assert "train.py:51 in _run()" in said, said
    assert "'metrics-writer' died of ValueError at train.py:51 in _run()" in f.fix and "task_done" in f.fix
    assert f.details["dead_thread"]["thread"] == "metrics-writer" and f.details["dead_thread"]["step"] == 9


def test_either_fact_alone_says_nothing_more() -> None:
    for stack, errors, pattern in (
        (SPIN, [DIED], "user_code"),  # its own loop, no wait on another thread
        (JOIN, [], "user_code"),  # waits, but no thread of its died
        (JOIN, [dict(DIED, thread="MainThread")], "user_code"),  # the main thread's own error
        (JOIN, [DIED], "rank_only_collective"),  # another hang's shape
    ):
        f = _judge(stack, errors, pattern)
        assert f.summary == "Rank(s) 1 never reached collective #15." and f.fix == "Look at the stack."
        assert "dead_thread" not in f.details
