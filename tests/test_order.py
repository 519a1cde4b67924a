"""Calls of one line issued in an order that differs by rank (analysis/failed/order.py): named
with the loop and the line that set its order only when each rank's call is one the line makes
every round; a size the line never made is a size that differs, not an order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, diagnose_json, read_lines, run_doctor, torchrun

from ddpdoctor.analysis.failed.order import order_differs
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Ledger, Point
from ddpdoctor.trace import schema

ZOO = REPO / "tests" / "zoo"
SCRIPT = """\
def report(meters, losses):
    order = sorted(meters, key=lambda t: losses[t])
    for task in order:
        sync(meters[task])


def sync(meter):
    all_reduce(meter)
"""


def _ledger(rank: int, path: Path, rounds: list[list[int]], now: list[int], died: bool) -> Ledger:
    """Rounds of a report's all_reduces at sync()'s line, each after a step's gradient
    all-reduce; then the round that broke (``now``, the last call in flight if ``died``)."""
    site, points, seq = f"{path.name}:8", [], 0
    for sizes in [*rounds, now]:
        points.append(Point(seq, GRAD_ALLREDUCE, 4096, "WORLD", seq, "train.py:1"))
        seq += 1
        for numel in sizes:
            call = Point(seq, "all_reduce", 8 * numel, "WORLD", seq, site, dtype="float64", numel=numel)
            points.append(call)
            seq += 1
    last = points[-1]
    if died:
        last.in_flight = last.died_in = True
    stack = [(str(path), 4, "report"), (str(path), 8, "sync")]
    return Ledger(rank, points=points, stack=stack)


@pytest.mark.parametrize(
    ("now", "found"),
    [
        (([5], [2]), True),  # both calls the line makes each round, another order
        (([2, 5], [2, 2]), True),
        (([5], [3]), False),  # a size the line never made: a size that differs
        (([2, 2, 2], [2, 2, 5]), False),  # one 2 more than a round holds
    ],
)
def test_an_order_is_named_only_for_calls_the_line_makes_every_round(
    tmp_path: Path, now: tuple[list[int], list[int]], found: bool
) -> None:
    path = tmp_path / "report.py"
    path.write_text(SCRIPT)
    ledgers = {r: _ledger(r, path, [[5, 2, 2], [5, 2, 2]], now[r], died=False) for r in (0, 1)}
    points = {r: lg.points[-1] for r, lg in ledgers.items()}
    finding = order_differs(points, ledgers, points[0].seq, {}, said=False)
    assert (finding is not None) == found, finding
    if finding is not None:
        assert finding.details["differs"] == "order" and finding.details["root_rank"] is None
        assert finding.details["place"] == "report.py:2" and finding.details["loop"] == "report.py:3"
        assert "all_reduce of 5, 2 and 2 float64 elements" in finding.summary


def test_a_rank_that_died_in_the_call_counts_only_with_the_backends_word(tmp_path: Path) -> None:
    """Its call's size is not on record: an order is said only when the other rank's call
    moved from where it stood in the round before, and the backend said the calls differed."""
    path = tmp_path / "report.py"
    path.write_text(SCRIPT)
    for moved, said in ((True, True), (True, False), (False, True)):
        first = [2] if moved else [5]
        ledgers = {0: _ledger(0, path, [[5, 2, 2]] * 2, first, died=False)}
        ledgers[1] = _ledger(1, path, [[5, 2, 2]] * 2, [2], died=True)
        ledgers[1].points[-1].numel = 0  # died inside it: no size
        points = {r: lg.points[-1] for r, lg in ledgers.items()}
        finding = order_differs(points, ledgers, points[0].seq, {}, said=said)
        assert (finding is not None) == (moved and said), (moved, said, finding)


@pytest.mark.e2e
def test_meters_synced_in_a_rank_local_sorted_order_name_the_sort(tmp_path: Path) -> None:
    """The held-out job: each rank sorts its meters by its own loss before syncing them; at the
    fourth report the orders differ and gloo aborts rank 1 on the size. The rank killed inside
    the call left its size in its ring (``entered``), so both sides' sizes are known."""
    script = ZOO / "mismatch_multitask_report_heldout14.py"
    lines = script.read_text().splitlines()
    place = next(n for n, text in enumerate(lines, 1) if "# zoo: place" in text)
    loop = next(n for n, text in enumerate(lines, 1) if text.strip() == "for task in order:")
    job = run_doctor(tmp_path, torchrun(2, script), "--hang-timeout", "8", "--on-hang", "kill")
    assert job.returncode != 0
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "collective_mismatch"]
    assert f["details"]["differs"] == "order", f
    assert f["details"]["place"] == f"{script.name}:{place}"
    assert f["details"]["loop"] == f"{script.name}:{loop}"
    assert "5 float64 elements" in f["summary"] and "2 float64 elements" in f["summary"], f["summary"]
    assert "sorted(" in f["summary"] and "sorted(d)" in f["fix"]
    aborted = [r for r in (0, 1) if "SIGABRT" in str(f["details"].get("deaths", {}).get(str(r), ""))]
    for rank in aborted:  # its ring named the call it died in, and its signature says its size
        trace = read_lines(job.run_dir / f"trace-rank{rank}.jsonl")
        (entered,) = [r[4] for r in trace if r[0] == schema.ENTERED]
        sigs = {r[4]["id"]: r[4] for r in trace if r[0] == schema.SIGNATURE}
        assert sigs[entered["signature"]]["numel"] in (2, 5), (entered, sigs)


METERS = """\
def report(meters):
    for meter in meters.values():
        meter.sync()


class Tags:
    def sync(self):
        all_reduce(self.confusion)


class Matches:
    def sync(self):
        all_gather(self.bank)


def summary(stats, bad):
    all_reduce(stats)
    if bad:
        return
    all_gather(stats)
"""


def _two_calls(rank: int, path: Path, first: tuple[str, int, str], now: tuple[str, int, str]) -> Ledger:
    """Two rounds of (all_reduce of 36 int64, all_gather of 4096 float32), each after a step's
    gradient all-reduce, then a round whose first call is ``now``: (op, line, function)."""
    calls = {"all_reduce": ("int64", 36), "all_gather": ("float32", 4096)}
    points, seq = [], 0

    def call(op: str, line: int) -> Point:
        dtype, numel = calls[op]
        return Point(seq, op, 4 * numel, "WORLD", seq, f"{path.name}:{line}", dtype=dtype, numel=numel)

    then = ("all_gather", first[1] + 5 if first[2] != "summary" else 21, "")
    for round_ in ([first, then], [first, then], [now]):
        points.append(Point(seq, GRAD_ALLREDUCE, 4096, "WORLD", seq, "train.py:1"))
        seq += 1
        for op, line, _ in round_:
            points.append(call(op, line))
            seq += 1
    caller = (str(path), 3, "report") if now[2] != "summary" else (str(path), 30, "main")
    stack = [(str(path), 40, "main"), caller, (str(path), now[1], now[2])]
    return Ledger(rank, points=points, stack=stack)


def test_calls_of_several_lines_from_one_loop_line_are_an_order_and_a_skip_is_not(tmp_path: Path) -> None:
    """Each item's own method called from one line of a loop: the ranks went through the items
    in their own order (rank 0 in Tags.sync, rank 1 in Matches.sync, below the same line). One
    function on both ranks, at two of its lines, is a rank that went past a call: no order."""
    path = tmp_path / "meters.py"
    path.write_text(METERS)
    tags, matches = ("all_reduce", 8, "Tags.sync"), ("all_gather", 13, "Matches.sync")
    ledgers = {0: _two_calls(0, path, tags, tags), 1: _two_calls(1, path, tags, matches)}
    points = {r: lg.points[-1] for r, lg in ledgers.items()}
    finding = order_differs(points, ledgers, points[0].seq, {}, said=True)
    assert finding is not None and finding.details["differs"] == "order"
    assert finding.details["root_rank"] is None and finding.details["loop"] == "meters.py:2"
    assert "all_reduce of 36 int64 elements at meters.py:8" in finding.summary
    assert "all_gather of 4096 float32 elements at meters.py:13" in finding.summary

    first, second = ("all_reduce", 17, "summary"), ("all_gather", 21, "summary")
    ledgers = {0: _two_calls(0, path, first, first), 1: _two_calls(1, path, first, second)}
    points = {r: lg.points[-1] for r, lg in ledgers.items()}
    assert order_differs(points, ledgers, points[0].seq, {}, said=True) is None


@pytest.mark.e2e
def test_a_death_stack_cut_short_leaves_the_call_its_ring_entered(tmp_path: Path) -> None:
    """Held-out set 16's order mismatch: gloo aborts rank 0 (SIGABRT) inside the all_reduce whose
    size it did not expect. Once in CI a second fault cut faulthandler's dump short (no frame of
    the collective), and the verdict became rank 0's failure. The ring's entered call, with the
    op and group of the rank's earlier records at its line, says where it died all the same."""
    script = ZOO / "order_load_max_segment_heldout16.py"
    lines = script.read_text().splitlines()
    place = next(n for n, text in enumerate(lines, 1) if "# zoo: place" in text)
    job = run_doctor(tmp_path, torchrun(2, script), "--hang-timeout", "8", "--on-hang", "kill")
    ends_path = job.run_dir / "ends.json"
    ends = json.loads(ends_path.read_text())
    aborted = [r for r, e in ends["ranks"].items() if e.get("signal") == "SIGABRT"]
    assert aborted, ends  # gloo aborts the rank that received the unexpected size
    for rank in aborted:
        ends["ranks"][rank]["stack"] = (
            "Fatal Python error: Aborted\n\nThread 0x00007f7efe5ff6c0 (most recent call first):\n"
            '  File "/usr/lib/python3.11/inspect.py", line 2516 in _signature_from_callable\n'
            '  File "/usr/lib/python3.11/inspect.py"Fatal Python error: Segmentation fault\n'
        )
    ends_path.write_text(json.dumps(ends))
    (f,) = [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "collective_mismatch"]
    assert f["details"]["differs"] == "order" and f"{script.name}:{place}" in f["summary"], f
    assert not [f for f in diagnose_json(job.run_dir)["findings"] if f["kind"] == "rank_failure"]
