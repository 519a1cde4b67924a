"""Where the ranks first parted, named in the user's code: the branch after a forward that left
the iteration before its backward, and the lines that decide a gradient accumulation schedule
(read from the script itself, ``analysis/failed/source.py``), on hand-written traces."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ddpdoctor.analysis.failed.ledger import build
from ddpdoctor.analysis.failed.parting import first_divergence
from ddpdoctor.analysis.failed.points import Ledger, Point
from ddpdoctor.analysis.failed.rankonly import extra_call
from ddpdoctor.analysis.failed.source import exits_after, no_sync_schedule
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.trace.reader import load_run
from tests.test_ledger import _kinds, _skipping, _steps, _write

SKIPPING_LOOP = """\
import torch


def main(model, loader, opt):
    for x, y in loader:
        opt.zero_grad()
        loss = model(x).sum()
        if not torch.isfinite(loss):
            print("skipping a bad batch")
            continue
        loss.backward()
        opt.step()
"""

ACCUMULATING_LOOP = """\
import contextlib


def main(model, batches, rank):
    micro = {0: 8, 1: 16}[rank]
    accum = 64 // micro
    for i, x in enumerate(batches):
        boundary = (i + 1) % accum == 0
        with contextlib.nullcontext() if boundary else model.no_sync():
            loss = model(x).sum()
            loss.backward()
"""

GUARDED_NO_SYNC = """\
def main(model, batches, every):
    for i, x in enumerate(batches):
        last = (i + 1) % every == 0
        if not last:
            with model.no_sync():
                model(x).sum().backward()
"""


def _script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_the_branch_that_leaves_the_iteration_after_a_line(tmp_path: Path) -> None:
    path = str(_script(tmp_path, "loop.py", SKIPPING_LOOP))
    assert exits_after(path, 7) == [8, 10]  # the forward: the `if` and its `continue`
    assert exits_after(path, 11) == []  # nothing after the backward leaves early
    assert exits_after(str(tmp_path / "gone.py"), 7) == [], "a script no longer on disk: no lines"


def test_the_lines_that_decide_no_sync(tmp_path: Path) -> None:
    path = str(_script(tmp_path, "accum.py", ACCUMULATING_LOOP))
    # the `with`, its condition `boundary`, `accum` it reads, and `micro` (where the rank enters)
    assert no_sync_schedule(path, 10) == [9, 8, 6, 5]
    guarded = str(_script(tmp_path, "guarded.py", GUARDED_NO_SYNC))
    assert no_sync_schedule(guarded, 6) == [5, 3]  # `if not last:` around the with
    assert no_sync_schedule(path, 8) == [], "a line under no no_sync()"


def test_a_skipped_backward_names_the_branch_that_skipped_it(tmp_path: Path) -> None:
    # The site of the forward is line 7 of a script on disk whose loop `continue`s at line 10.
    script = _script(tmp_path, "train.py", SKIPPING_LOOP)
    run_dir = tmp_path / "run"

    def at_script(records: list[list]) -> list[list]:
        for rec in records:
            if rec[0] == "site":
                rec[4] = {**rec[4], "file": str(script), "line": 7}
        return records

    _write(run_dir, 0, at_script(_skipping(6, skipped=-1)), end=False)
    _write(run_dir, 1, at_script(_skipping(6, skipped=2)), end=False)
    f = _kinds(run_dir)["skipped_gradient_sync"]
    assert f["details"]["root_rank"] == 1 and f["details"]["place"] == "train.py:8"
    assert "the `if` at train.py:8 and train.py:10" in f["summary"]
    assert f["details"]["forward"] == "train.py:7"


def _accumulating(steps: int, micro: int) -> list[list]:
    """``steps`` optimizer steps of ``micro`` forwards each (the first micro - 1 under no_sync),
    one gradient all-reduce per step, at the backend's sequence numbers 3, 4, ..."""
    out = [r for r in _steps(0, loader=False)]
    t = 100
    for k in range(steps):
        for _ in range(micro):
            out.append(["forward", t, 100, k, 1, 1, 3 + k, 0])
            out.append(["backward", t + 150, 100, k])
            t += 300
        out.append(["allreduce", t - 100, 50, k, 0, 2704, 3 + k])
    return out


def test_all_reduces_over_different_numbers_of_micro_batches_are_schedules_that_differ(
    tmp_path: Path,
) -> None:
    _write(tmp_path, 0, _accumulating(4, micro=2), end=False)
    _write(tmp_path, 1, _accumulating(4, micro=1), end=False)
    div = first_divergence(build(load_run([tmp_path])))
    assert div is not None and div.what == "accumulation" and div.root == 0
    assert div.evidence == {"seq": 3, "step": 0, "micro_batches": {0: 2, 1: 1}}
    f = _kinds(tmp_path)["skipped_gradient_sync"]
    assert "accumulate gradients on different schedules" in f["summary"]
    assert "(rank 0: 2, rank 1: 1)" in f["summary"] and "no_sync()" in f["fix"]


def test_the_same_accumulation_on_every_rank_is_no_divergence(tmp_path: Path) -> None:
    for rank in (0, 1):
        _write(tmp_path, rank, _accumulating(4, micro=3))
    assert first_divergence(build(load_run([tmp_path]))) is None
    assert "skipped_gradient_sync" not in _kinds(tmp_path)


def test_an_except_that_leaves_the_iteration_is_the_branch(tmp_path: Path) -> None:
    """A step skipped because its loss raised: the `except` and its `continue`."""
    source = """
        for x in loader:
            try:
                loss = model(x).sum()
            except ValueError:
                print("skipping")
                continue
            loss.backward()
    """
    path = str(_script(tmp_path, "robust.py", source))
    assert exits_after(path, 4) == [5, 7]


RANK0_VALIDATES = """\
import torch.distributed as dist


def reduce_mean(value):
    t = value.clone()
    dist.all_reduce(t)
    return t


class Trainer:
    def fit(self, epochs, value):
        for epoch in range(epochs):
            if self.is_main:
                reduce_mean(value)
            else:
                print("waiting")
            dist.barrier()

    def fit_either(self, value):
        if self.is_main:
            reduce_mean(value)
        else:
            dist.barrier()
"""


def test_the_side_inside_an_if_the_other_side_went_past_is_the_root(tmp_path: Path) -> None:
    """Rank 0 waits in an all_reduce its validation made inside `if self.is_main:`; rank 1 in the
    barrier after that whole if: rank 0's call is the extra one. In an if and its else, or when
    the file was edited (the function at the line is not the stack's), nobody is blamed."""
    from ddpdoctor.analysis.failed.rankonly import took_branch
    from ddpdoctor.analysis.failed.source import branch_passed

    path = str(tmp_path / "train.py")
    Path(path).write_text(RANK0_VALIDATES)
    top = [(path, 30, "<module>")]
    zero = [*top, (path, 14, "Trainer.fit"), (path, 6, "reduce_mean")]
    one = [*top, (path, 17, "Trainer.fit")]
    assert branch_passed(path, "Trainer.fit", 14, 17) == (13, "if self.is_main:")
    assert branch_passed(path, "Trainer.fit", 17, 14) is None  # the barrier is in no if before
    main = "`if self.is_main:` (train.py:13)"
    assert took_branch({0: zero, 1: one, 2: one}, [[0], [1, 2]]) == ([0], main, "")
    assert took_branch({0: zero, 1: one}, [[1], [0]]) == ([0], main, "")
    either = {0: [*top, (path, 21, "fit_either")], 1: [*top, (path, 23, "fit_either")]}
    assert took_branch(either, [[0], [1]]) is None  # if and else: both took a branch
    edited = {0: [*top, (path, 14, "Trainer.train")], 1: [*top, (path, 17, "Trainer.train")]}
    assert took_branch(edited, [[0], [1]]) is None
    assert took_branch({0: zero, 1: one, 2: zero}, [[0], [1, 2]]) is None  # a side's ranks differ
    gone = [(str(tmp_path / "gone.py"), n, f) for _, n, f in zero]
    assert took_branch({0: gone, 1: [gone[0], (gone[0][0], 17, "Trainer.fit")]}, [[0], [1]]) is None


HELPER_BRANCH = """
import torch.distributed as dist

def pull(table):
    dist.broadcast(table, src=0)

def encode(items, table):
    for c in items:
        if c < 0:
            pull(table)
    return items

def evaluate(batches, table, stats):
    for b in batches:
        encode(b, table)
    dist.all_reduce(stats)
"""


def test_a_helpers_branch_the_other_side_ran_past_names_the_side_that_took_it(tmp_path: Path) -> None:
    """Rank 1 waits in a broadcast that a helper makes under a test of its own data (`if c < 0:`),
    reached from evaluate()'s loop; rank 0 left that loop (it ran the helper, never took the
    branch) and waits in the all_reduce after it: rank 1's call is the extra one (held-out set
    24). While rank 0 is still at the loop's line, or the file was edited, nobody is blamed."""
    from ddpdoctor.analysis.failed.rankonly import took_branch
    from ddpdoctor.analysis.failed.source import went_past

    path = str(tmp_path / "train.py")
    Path(path).write_text(HELPER_BRANCH)
    one = [(path, 15, "evaluate"), (path, 10, "encode"), (path, 5, "pull")]
    zero = [(path, 16, "evaluate")]
    assert went_past(path, "evaluate", 15, 16) and not went_past(path, "evaluate", 16, 15)
    assert took_branch({0: zero, 1: one}, [[0], [1]]) == ([1], "`if c < 0:` (train.py:9)", "train.py:10")
    assert took_branch({0: [(path, 14, "evaluate")], 1: one}, [[0], [1]]) is None  # not past it
    edited = [(path, 15, "evaluate"), (path, 10, "decode"), (path, 5, "pull")]
    assert took_branch({0: zero, 1: edited}, [[0], [1]]) is None


EARLY_STOP = """
import torch.distributed as dist


def fit(model, stopper, batches, evaluate):
    for epoch in range(40):
        for x in batches:
            model(x).sum().backward()
        if stopper.should_stop(evaluate(model)):
            break
    dist.barrier()


def fit_while(model, batches, state):
    while not state.done:
        for x in batches:
            model(x).sum().backward()
    dist.barrier()


def fit_plain(model, batches):
    for x in batches:
        model(x).sum().backward()
    dist.barrier()


def fit_two_ways(model, batches, a, b):
    for x in batches:
        model(x).sum().backward()
        if a:
            break
        if b:
            break
    dist.barrier()


def fit_target(model, batches, target):
    for epoch in range(6):
        for x in batches:
            loss = model(x).sum()
            if loss < target:
                return epoch
    return -1


def fit_two_returns(model, batches, a):
    for x in batches:
        loss = model(x).sum()
        if loss < a:
            return 1
        if loss > 2 * a:
            return 2
"""


def test_the_way_out_of_the_loop_a_rank_left(tmp_path: Path) -> None:
    """The rank at the barrier left the loop the others still run at their backward: by the one
    `break` of that loop, or a `while` condition; a `for` that ran out of items, two breaks, an
    edited file or one that is gone give no answer (then the DataLoader-less rank ran out)."""
    from ddpdoctor.analysis.failed.source import loop_left

    path = str(tmp_path / "train.py")
    Path(path).write_text(EARLY_STOP)
    stop = "`break` at train.py:10, under `if stopper.should_stop(evaluate(model)):` (train.py:9)"
    assert loop_left(path, "fit", 8, 11) == (10, stop)
    assert loop_left(path, "fit_while", 17, 18) == (15, "`while not state.done:` ending (train.py:15)")
    assert loop_left(path, "fit_plain", 23, 24) is None
    # a rank that has left the function (returned from it) left its every loop
    assert loop_left(path, "fit", 8, None) == (10, stop)
    assert loop_left(path, "fit_plain", 23, None) is None
    assert loop_left(path, "fit_two_ways", 29, 34) is None
    # a rank that left the function (held-out set 17) may have left by its loops' one `return`;
    # a rank still in the function did not, and two ways out give no answer
    assert loop_left(path, "fit_target", 40, None) == (
        42,
        "`return` at train.py:42, under `if loss < target:` (train.py:41)",
    )
    assert loop_left(path, "fit_target", 40, 43) is None
    assert loop_left(path, "fit_two_returns", 48, None) is None
    assert loop_left(path, "train", 8, 11) is None  # the function there has another name: edited
    assert loop_left(str(tmp_path / "gone.py"), "fit", 8, 11) is None


def test_a_line_inside_the_loop_the_others_run_has_not_left_it(tmp_path: Path) -> None:
    """A rank waiting at a line of the loop the others still run (a call in a branch of its
    iteration: held-out set 22's rank-0-only barrier in a checkpoint helper, no DataLoader) has
    not run out of data; at a line after that loop, it may have."""
    from ddpdoctor.analysis.failed.source import in_their_loop

    path = str(tmp_path / "train.py")
    Path(path).write_text(EARLY_STOP)
    assert in_their_loop(path, 9, 8) is False, "the epoch loop's line: after the batch loop"
    assert in_their_loop(path, 8, 8) is True
    assert in_their_loop(path, 24, 23) is False and in_their_loop(path, 11, 8) is False
    assert in_their_loop(path, 40, 8) is None, "another function"
    assert in_their_loop(path, 2, 11) is None, "no loop holds theirs"
    assert in_their_loop(str(tmp_path / "gone.py"), 8, 8) is None


def _ledger(rank: int, calls: list[tuple[int, str, str, str]]) -> Ledger:
    points = [Point(seq, op, 16, "WORLD", 3, site, func=func) for seq, op, site, func in calls]
    points[-1].in_flight = True
    return Ledger(rank, points=points)


def test_an_extra_call_that_paired_silently_is_the_root_not_the_mismatch_it_led_to() -> None:
    """Rank 1 made an all_reduce (:52) that rank 0 never makes; gloo paired it with rank 0's
    all_reduce at :67 (same size), so the ranks met different calls only at the next number,
    rank 0's barrier against rank 1's :67. The root is rank 1's call at :52, one number back."""
    r0 = _ledger(
        0,
        [
            (5, "all_reduce", "t.py:60", "fit"),
            (6, "all_reduce", "t.py:67", "run"),
            (7, "barrier", "t.py:97", "main"),
        ],
    )
    r1 = _ledger(
        1,
        [
            (5, "all_reduce", "t.py:60", "fit"),
            (6, "all_reduce", "t.py:52", "audit"),
            (7, "all_reduce", "t.py:67", "run"),
        ],
    )
    found = extra_call({0: r0.points[-1], 1: r1.points[-1]}, {0: r0, 1: r1}, {})
    assert found is not None and found.ranks == [1], found
    assert (
        found.details["root_rank"] == 1 and found.details["place"] == "t.py:52" and found.details["seq"] == 6
    )
    assert "in audit()" in found.summary and "(a consequence)" in found.summary
    assert "t.py:52" in found.fix

    # An if and its else that each make an all_reduce (at :52 and :54) pair as they should; what
    # follows is not one side one call behind, so no side is named.
    r1 = _ledger(
        1,
        [
            (5, "all_reduce", "t.py:60", "fit"),
            (6, "all_reduce", "t.py:54", "run"),
            (7, "all_reduce", "t.py:70", "run"),
        ],
    )
    r0 = _ledger(
        0,
        [
            (5, "all_reduce", "t.py:60", "fit"),
            (6, "all_reduce", "t.py:52", "run"),
            (7, "barrier", "t.py:97", "main"),
        ],
    )
    assert extra_call({0: r0.points[-1], 1: r1.points[-1]}, {0: r0, 1: r1}, {}) is None
    # Lines that part only at the mismatch: the rank-only rule's case, not this one.
    r1 = _ledger(1, [(5, "all_reduce", "t.py:60", "fit"), (6, "all_reduce", "t.py:70", "run")])
    r0 = _ledger(0, [(5, "all_reduce", "t.py:60", "fit"), (6, "barrier", "t.py:97", "main")])
    assert extra_call({0: r0.points[-1], 1: r1.points[-1]}, {0: r0, 1: r1}, {}) is None


def test_an_all_reduce_whose_count_one_rank_changed_from_its_own_earlier_calls_names_that_rank() -> None:
    """Per-domain sums all-reduced from one line every 10 steps (held-out set 17): rank 1 starts
    to see a new domain and sends 8 values where it, like rank 0, had always sent 6. gloo does
    not refuse it: rank 0 returns, rank 1 waits. The rank whose count changed is the root; when
    both changed, or neither had called from that line before, no rank is named."""

    def ledger(rank: int, counts: list[int]) -> Ledger:
        points = [
            Point(seq, "all_reduce", 4 * n, "WORLD", seq, "t.py:56", dtype="float32", numel=n, func="report")
            for seq, n in enumerate(counts, start=10)
        ]
        points[-1].in_flight = rank == 1
        return Ledger(rank, points=points)

    found = first_divergence({0: ledger(0, [6, 6, 6]), 1: ledger(1, [6, 6, 8])})
    assert found is not None and found.what == "mismatch" and found.root == 1 and found.others == [0]
    assert found.evidence["changed"] == "rank 1's earlier calls from that line had 6 elements"
    both = first_divergence({0: ledger(0, [6, 6, 4]), 1: ledger(1, [6, 6, 8])})
    assert both is not None and both.what == "mismatch" and both.root is None
    fresh = first_divergence({0: ledger(0, [6]), 1: ledger(1, [8])})
    assert fresh is not None and fresh.what == "mismatch" and fresh.root is None


def test_a_call_every_earlier_round_made_that_one_rank_went_past_names_that_rank() -> None:
    """An evaluation helper returns early on rank 1 (held-out set 17): each round was the last
    step's gradient all-reduce, the helper's all_reduce (:53), then a barrier (:95); this time
    rank 1 goes from the gradient all-reduce straight to the barrier while rank 0 is in :53."""
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE
    from ddpdoctor.analysis.failed.wentpast import went_past

    def ledger(rank: int, last: list[tuple[str, str]]) -> Ledger:
        calls = [(GRAD_ALLREDUCE, "t.py:86"), ("all_reduce", "t.py:53"), ("barrier", "t.py:95")] * 2
        calls += [(GRAD_ALLREDUCE, "t.py:86")] + last
        points = [Point(seq, op, 8, "WORLD", seq, site, func="f") for seq, (op, site) in enumerate(calls)]
        points[-1].in_flight = True
        return Ledger(rank, points=points)

    def judge(r0: list[tuple[str, str]], r1: list[tuple[str, str]]) -> Finding | None:
        ledgers = {0: ledger(0, r0), 1: ledger(1, r1)}
        return went_past({r: lg.points[-1] for r, lg in ledgers.items()}, ledgers, {})

    found = judge([("all_reduce", "t.py:53")], [("barrier", "t.py:95")])
    assert found is not None and found.kind == "rank_only_collective" and found.ranks == [1], found
    assert found.details["root_rank"] == 1 and found.details["place"] == "t.py:53"
    said = " ".join(found.summary.split())
    assert "rank 1 went past the all_reduce at t.py:53 in f() this time" in said, said
    assert "in each of its 2 earlier round(s) it made that call after the gradient all-reduce" in said, said
    assert "skipped the barrier" not in said and "t.py:53" in found.fix
    # A call the rank never made before, with nothing on record between: not a call it went past.
    assert judge([("all_reduce", "t.py:53")], [("broadcast", "t.py:70")]) is None
    assert judge([("barrier", "t.py:95")], [("barrier", "t.py:95")]) is None  # no disagreement


def test_a_call_one_rank_went_past_into_its_gradient_all_reduce_names_that_rank() -> None:
    """Held-out set 21: a helper's all_gather (:86) runs under `if labeled.any():` between one
    step's gradient all-reduce and the next; on a batch with no label rank 1 goes from its forward
    straight to its backward. Rank 0 waits in :86, rank 1 in the gradient all-reduce, which a hang
    places at the backward's line (:112) where every earlier one was recorded at the forward's
    (:103): the same call of the program all the same."""
    from ddpdoctor.analysis.failed.causes import _explain
    from ddpdoctor.analysis.failed.parting import Divergence
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE

    def ledger(rank: int, last: tuple[str, str]) -> Ledger:
        calls = [("all_gather", "t.py:86"), (GRAD_ALLREDUCE, "t.py:103")] * 3 + [last]
        points = [Point(n, op, 8, "WORLD", n // 2, site, func="f") for n, (op, site) in enumerate(calls)]
        points[-1].in_flight = True
        return Ledger(rank, points=points, last_step=3)

    ledgers = {0: ledger(0, ("all_gather", "t.py:86")), 1: ledger(1, (GRAD_ALLREDUCE, "t.py:112"))}
    div = Divergence("mismatch", None, [], {r: lg.points[-1] for r, lg in ledgers.items()}, {"seq": 6})
    found = _explain(div, ledgers)
    assert found is not None and found.kind == "rank_only_collective" and found.ranks == [1], found
    assert found.details["root_rank"] == 1 and found.details["place"] == "t.py:86"
    said = " ".join(found.summary.split())
    assert "rank 1 went past the all_gather at t.py:86 in f() this time" in said, said
    assert "in each of its 2 earlier round(s) it made that call between one gradient all-reduce" in said
    # Rounds in which every rank skipped the all_gather together (a decision they shared): going
    # straight on is usual for rank 1 too, which side parted is not on record, and no rank is named.
    both = [("all_gather", "t.py:86"), (GRAD_ALLREDUCE, "t.py:103"), (GRAD_ALLREDUCE, "t.py:103")] * 2
    for lg in ledgers.values():
        lg.points[:6] = [Point(n, op, 8, "WORLD", n, site, func="f") for n, (op, site) in enumerate(both)]
    found = _explain(div, ledgers)
    assert found is not None and found.kind == "collective_mismatch" and found.details["root_rank"] is None


def test_a_call_one_rank_made_once_more_than_every_earlier_round_names_that_rank() -> None:
    """Each round syncs two metrics with one all_reduce line (:99), then the next step's gradient
    all-reduce; this time rank 1's dict had a third metric: it is in a third :99 while rank 0
    went on to its gradient all-reduce. The extra call is rank 1's. With fewer than two earlier
    rounds of the same shape on record, nothing is said."""
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE
    from ddpdoctor.analysis.failed.wentpast import went_past_rounds

    grad, metric = (GRAD_ALLREDUCE, "t.py:118"), ("all_reduce", "t.py:99")

    def judge(rounds: list[tuple[str, str]], r0: tuple[str, str], r1: tuple[str, str]) -> Finding | None:
        ledgers = {}
        for rank, last in ((0, r0), (1, r1)):
            calls = [*rounds, grad, grad, metric, metric, last]
            points = [
                Point(n, op, 4, "WORLD", n // 5, site, func="sync") for n, (op, site) in enumerate(calls)
            ]
            points[-1].died_in = True
            ledgers[rank] = Ledger(rank, points=points)
        return went_past_rounds(ledgers, {})

    found = judge([grad, grad, metric, metric] * 2, grad, metric)
    assert found is not None and found.ranks == [1] and found.details["root_rank"] == 1, found
    said = " ".join(found.summary.split())
    assert "rank 1 made the all_reduce at t.py:99 one more time than in any earlier round" in said, said
    assert "every rank made it 2 time(s), then gradient all-reduce; now rank 1 made it a 3rd time" in said, (
        said
    )
    assert "(the default group)" not in said and "fixed list" in found.fix
    assert judge([], grad, metric) is None, "the first round: which count is the usual one is not on record"
    assert judge([grad, grad, metric, metric, metric, grad, grad, metric, metric], grad, metric) is None


def test_a_call_on_another_group_one_rank_went_past_names_that_rank() -> None:
    """Held-out set 18: each epoch is 8 gradient all-reduces (the default group), then a metrics
    all_reduce on its own group (:76) in a try block; on a quiet day rank 1's metric raised, the
    except skipped the call, and rank 1 went on to the next epoch's gradient all-reduce while
    rank 0 waits in :76. Each group numbers its own calls, so only each rank's own order of
    calls across groups says who departed from the rounds every rank made."""
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE
    from ddpdoctor.analysis.failed.wentpast import went_past_rounds

    def ledger(rank: int, epoch: list[tuple[str, str, str]], last: tuple[str, str, str]) -> Ledger:
        calls = (epoch * 3 + [(GRAD_ALLREDUCE, "t.py:101", "WORLD")] * 8)[-30:] + [last]  # a tail window
        points = [
            Point(n, op, 8, group, n // 9, site, func="sync") for n, (op, site, group) in enumerate(calls)
        ]
        points[-1].in_flight = True
        return Ledger(rank, points=points)

    grad, metrics = (GRAD_ALLREDUCE, "t.py:101", "WORLD"), ("all_reduce", "t.py:76", "1")
    epoch = [grad] * 8 + [metrics]

    def judge(r0: tuple[str, str, str], r1: tuple[str, str, str], rounds: list = epoch) -> Finding | None:
        return went_past_rounds({0: ledger(0, rounds, r0), 1: ledger(1, rounds, r1)}, {})

    found = judge(metrics, (GRAD_ALLREDUCE, "t.py:103", "WORLD"))  # a hang places it at the backward
    assert found is not None and found.kind == "rank_only_collective" and found.ranks == [1], found
    assert found.details["root_rank"] == 1 and found.details["place"] == "t.py:76"
    said = " ".join(found.summary.split())
    assert "rank 1 went past the all_reduce at t.py:76 in sync() (process group 1) this time" in said, said
    assert "in each of 2 earlier round(s), every rank made that call after 8 gradient all-reduce(s)" in said
    assert "rank 0 is in all_reduce #30" in said and "t.py:76" in found.fix
    assert judge(metrics, ("barrier", "t.py:90", "WORLD")).ranks == [1], (
        "went elsewhere: departed all the same"
    )
    # Not a claim: both in one group's call (sequence numbers say it, elsewhere); rounds that end
    # in different calls; a run never seen before; a rank not waiting.
    assert judge(metrics, ("all_reduce", "t.py:76", "1")) is None
    mixed = [grad] * 8 + [metrics] + [grad] * 8 + [("broadcast", "t.py:80", "1")]
    assert judge(metrics, grad, mixed) is None, "after 8 gradient all-reduces came two different calls"
    assert judge(metrics, grad, [grad] * 7 + [metrics]) is None, "8 in a row never happened before"
    ledgers = {0: ledger(0, epoch, metrics), 1: ledger(1, epoch, grad)}
    ledgers[1].points[-1].in_flight = False
    assert went_past_rounds(ledgers, {}) is None


def test_ranks_that_part_inside_a_run_of_one_call_are_told_how_many_times_each_made_it() -> None:
    """The first metrics sync of a job (held-out set 22): rank 1's dict had a third metric, so it
    is in a third all_reduce at :99 while rank 0 made two and went on to its gradient all-reduce.
    No earlier round says which count is right: no root, but the counts and the fix for them."""
    from ddpdoctor.analysis.failed.causes import _explain
    from ddpdoctor.analysis.failed.parting import Divergence
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE

    def ledger(rank: int, calls: list[tuple[str, str]]) -> Ledger:
        points = [
            Point(n, op, 4, "WORLD", min(n, 14), site, func="sync") for n, (op, site) in enumerate(calls)
        ]
        points[-1].died_in = True
        return Ledger(rank, points=points, last_step=14)

    grad, metric = (GRAD_ALLREDUCE, "t.py:118"), ("all_reduce", "t.py:99")
    ledgers = {0: ledger(0, [grad] * 14 + [metric, metric, grad]), 1: ledger(1, [grad] * 14 + [metric] * 3)}
    div = Divergence("mismatch", None, [], {r: lg.points[-1] for r, lg in ledgers.items()}, {"seq": 16})
    found = _explain(div, ledgers)
    assert found is not None and found.kind == "collective_mismatch" and found.details["root_rank"] is None
    said = " ".join(found.summary.split())
    assert "a different number of times in a row (3 time(s) on rank(s) 1, 2 time(s) on rank(s) 0)" in said, (
        said
    )
    assert "parted before this point" not in said and "fixed list of names" in found.fix


MODEL = """
import torch.nn as nn


class Forecaster(nn.Module):
    def forward(self, speed, reports):
        out = self.head(speed)
        if reports.sum() == 0:
            return out
        return out - self.incident(reports)


class Gated(nn.Module):
    def forward(self, x, long):
        h = self.front(x)
        if long:
            h = h + self.context(h)
        return self.out(h) + (self.aux(h) if self.training else 0)


class TwoWays(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        if x.sum() < -1:
            return self.b(x)
        return self.c(x)


class CodeLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(9, 4)
        self.extra = nn.Linear(4, 4)

    def embed(self, idx):
        return self.tok(idx) + self.extra(self.tok(idx))

    def forward(self, idx):
        return self.embed(idx)
"""


def test_the_branch_of_a_forward_that_leaves_a_submodule_out(tmp_path: Path) -> None:
    """Parameters that got no gradient belong to a submodule some steps skip: an early return
    under an if, an if holding every use, a conditional expression; a submodule used before
    any branch, two ways out, or a class not in the file give no answer."""
    from ddpdoctor.analysis.misuse.leftout import skips_module

    path = str(tmp_path / "model.py")
    Path(path).write_text(MODEL)
    found = skips_module(path, "Forecaster", "incident")
    assert found is not None and (found["how"], found["line"], found["code"], found["use"]) == (
        "return",
        9,
        "return out",
        10,
    )
    assert found["test"] == "reports.sum() == 0" and found["forward"] == 6
    assert skips_module(path, "Gated", "context") == {
        "how": "guard", "line": 16, "code": "if long:", "test": "long", "use": 17, "forward": 14,
        "params": ["self", "x", "long"],
    }  # fmt: skip
    aux = skips_module(path, "Gated", "aux")
    assert aux is not None and aux["code"] == "self.aux(h) if self.training else 0", aux
    assert skips_module(path, "Forecaster", "head") is None, "used before the branch"
    assert skips_module(path, "TwoWays", "c") is None, "two returns before it: which one, unsaid"
    # Made in __init__ and read by no other method (held-out set 24's position embedding); one a
    # helper of the forward reads is used, the forward's own lines notwithstanding.
    never = skips_module(path, "CodeLM", "pos")
    assert never is not None and (never["how"], never["line"], never["use"]) == ("never", 40, 34), never
    assert skips_module(path, "CodeLM", "extra") is None
    assert (
        skips_module(path, "Missing", "a") is None
        and skips_module(str(tmp_path / "gone.py"), "Gated", "x") is None
    )


def test_what_the_models_call_passes_for_a_forward_parameter(tmp_path: Path) -> None:
    from ddpdoctor.analysis.misuse.leftout import passed_to_module

    path = str(tmp_path / "train.py")
    Path(path).write_text(
        "out = model(x, use_aux=step < 4)\nout = model(x, step % 2 == 0)\ny = f(model(x, 1))\n"
    )
    params = ["self", "x", "use_aux"]
    assert passed_to_module(path, 1, params, "use_aux") == "step < 4"
    assert passed_to_module(path, 2, params, "use_aux") == "step % 2 == 0"
    assert passed_to_module(path, 3, params, "use_aux") is None, (
        "two calls on the line: whose argument, unsaid"
    )
    assert (
        passed_to_module(path, 1, params, "self") is None and passed_to_module(path, 1, params, "z") is None
    )


VALIDATE = """\
import torch.distributed as dist


def global_mean(t):
    dist.all_reduce(t)
    return t


def validate(model):
    return global_mean(model.score())


def main(model, rank):
    for step in range(1, 100):
        if step % 10 == 0:
            global_mean(model.loss())
        if step % 20 == 0:
            if rank == 0:
                validate(model)
            dist.barrier()
"""


def test_a_helpers_collective_reached_from_a_rank_0_branch_is_the_extra_call(tmp_path: Path) -> None:
    """Held-out set 23: every rank averages its loss through global_mean (:5); rank 0 alone also
    validates through it, under `if rank == 0:`, and blocks there while rank 1 waits in the
    barrier after the branch, a line rank 0 has not reached yet. Rank 0's call is the extra one,
    named with the way to it, not rank 1's barrier as one rank 0 "skipped"."""
    from ddpdoctor.analysis.failed.rankonly import rank_only_call

    path = str(tmp_path / "train.py")
    Path(path).write_text(VALIDATE)
    loss = (26, "all_reduce", "train.py:5", "global_mean")
    r0 = _ledger(0, [loss, (27, "all_reduce", "train.py:5", "global_mean")])
    r0.stack = [(path, 19, "main"), (path, 10, "validate"), (path, 5, "global_mean")]
    r1 = _ledger(1, [loss, (27, "barrier", "train.py:20", "main")])
    r1.stack = [(path, 20, "main")]
    f = rank_only_call({0: r0.points[-1], 1: r1.points[-1]}, {0: r0, 1: r1}, {})
    assert f is not None and f.ranks == [0] and f.details["root_rank"] == 0, f
    assert f.details["place"] == "train.py:19"
    said = " ".join(f.summary.split())
    assert (
        "from validate() at train.py:10, from main() at train.py:19, inside `if rank == 0:` (train.py:18)"
        in said
    )
    assert "never executed" not in said.split(";")[0] and "skipped" not in said
    # Without the stacks, rank 1's barrier line is the only one new to the other side.
    r0.stack, r1.stack = [], []
    f = rank_only_call({0: r0.points[-1], 1: r1.points[-1]}, {0: r0, 1: r1}, {})
    assert f is not None and f.details["root_rank"] == 1 and "skipped the barrier" in f.summary


WROTE = """\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def init_embeddings(model, vectors):
    with torch.no_grad():
        model.module.emb.weight.copy_(vectors)


def main(net, rank, vectors, other):
    model = DDP(net)
    if rank == 0:
        init_embeddings(model, vectors)
    other.fill_(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        model.module.emb.weight.copy_(vectors)
"""


def test_the_statement_that_wrote_a_parameter_after_wrapping(tmp_path: Path) -> None:
    """Held-out sets 22 and 23: rank 0 copies vectors into an embedding after DDP's constructor
    broadcast. The one statement after the wrapping (:11), before the loop, that writes
    emb.weight: the call under `if rank == 0:` (:13), into the helper's copy_ (:7). A write to
    another tensor, or inside the loop, is not it; neither is a parameter nothing there writes."""
    from ddpdoctor.analysis.misuse.wrote import wrote_after_wrapping

    path = str(tmp_path / "train.py")
    Path(path).write_text(WROTE)
    found = wrote_after_wrapping(path, 11, ["emb.weight"])
    assert found is not None and (found.line, found.under, found.write) == (
        13,
        (12, "if rank == 0:"),
        (7, "model.module.emb.weight.copy_(vectors)"),
    )
    assert found.text(path, 11) == (
        "`init_embeddings(model, vectors)` at train.py:13, under `if rank == 0:` (train.py:12), after the "
        "model was wrapped at train.py:11; it writes them at train.py:7 "
        "(`model.module.emb.weight.copy_(vectors)`)"
    )
    assert wrote_after_wrapping(path, 11, ["head.bias"]) is None
    assert wrote_after_wrapping(path, 13, ["emb.weight"]) is None  # after :13, only the loop writes it
    assert wrote_after_wrapping(str(tmp_path / "gone.py"), 11, ["emb.weight"]) is None


FINETUNE = """\
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.prototypes = nn.Parameter(torch.randn(10, 8))
        self.items = nn.Embedding(100, 8, max_norm=1.0)
        self.fc = nn.Linear(8, 2)

    def forward(self, z):
        with torch.no_grad():
            self.prototypes[z.argmax(1)] = 0.0
        self.fc.weight.requires_grad_(True)
        return z @ self.prototypes.t()

    def start_finetune(self):
        self.fc.reset_parameters()


def main(model, loader):
    for x in loader:
        model(x)
    model.module.start_finetune()
    for x in loader:
        model(x)
"""


def test_writes_every_rank_makes_its_own_way_and_writes_in_a_forward_are_placed(tmp_path: Path) -> None:
    """Held-out sets 17-19: a head reset after pretraining on every rank, each its own draw, no
    ``if`` (the call between the loops, into the method's reset_parameters); a forward that
    writes its parameter by index; torch's Embedding asked for max_norm where it is built. A
    flag set in place (requires_grad_) writes nothing."""
    from ddpdoctor.analysis.misuse.wrote import written_after, written_in_forward

    path = str(tmp_path / "train.py")
    Path(path).write_text(FINETUNE)
    (found,) = written_after(path, 22, ["fc.weight", "fc.bias"])
    assert (found.line, found.under, found.write) == (25, None, (19, "self.fc.reset_parameters()"))
    assert written_after(path, 22, ["prototypes"]) == []  # no module name to look for
    assert written_in_forward([path], "Head", "head.prototypes") == [
        (path, 14, "self.prototypes[z.argmax(1)] = 0.0")
    ]
    assert written_in_forward([path], "Head", "head.fc.weight") == []
    assert written_in_forward([path], "Embedding(max_norm=1.0)", "head.items.weight") == [
        (path, 9, "nn.Embedding(100, 8, max_norm=1.0)")
    ]


POLICY = """\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def normalise_by_steps(params, n):
    for p in params:
        if p.grad is not None:
            p.grad.div_(n)


def main(net, batches):
    model = DDP(net)
    for x in batches:
        loss = model(x).sum()
        loss.backward()
        normalise_by_steps(model.parameters(), len(x))
        if rank == 0 and step % 10 == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        x.requires_grad_(False)
"""


def test_gradients_a_script_writes_after_the_wrapping_are_placed(tmp_path: Path) -> None:
    """Held-out set 29: every rank divides its gradients by its own count after backward (DDP's
    all-reduce has averaged them by then), and clips them: the call into the helper's div_, and
    the clip. A flag set in place is no write."""
    from ddpdoctor.analysis.misuse.wrote import grads_written_after

    path = str(tmp_path / "policy.py")
    Path(path).write_text(POLICY)
    found = grads_written_after(path, 12)
    assert [(w.line, w.write, w.rank) for w in found] == [(16, (8, "p.grad.div_(n)"), None), (18, None, 0)]
    assert found[1].under == (17, "if rank == 0 and step % 10 == 0:")


def test_the_one_rank_an_if_holds_for() -> None:
    """Set 23's chess job clips its gradients under `if rank == 0 and step % 10 == 0:`: rank 0,
    the root. A test that any rank may pass names none."""
    import ast

    from ddpdoctor.analysis.failed.source import rank_of

    def of(test: str) -> int | None:
        return rank_of(ast.parse(test, mode="eval").body)

    assert [of("rank == 0 and step % 10 == 0"), of("dist.get_rank() == 1"), of("0 == global_rank")] == [
        0,
        1,
        0,
    ]
    assert [of("rank == 0 or step == 3"), of("not rank == 0"), of("is_main"), of("rank < 1")] == [None] * 4


WRITTEN_LATER = """\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


class EMA:
    def update(self, params):
        for s, p in zip(self.shadow, params):
            s.mul_(0.9).add_(p)

    def copy_to(self, params):
        for s, p in zip(self.shadow, params):
            p.copy_(s)


def main(net, rank, loader, ema):
    model = DDP(net, device_ids=[rank])
    params = list(model.module.parameters())
    model.module.head.weight.zero_()
    for x in loader:
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ema.update(params)
        if rank == 0:
            ema.copy_to(params)
        if x is None:
            tally(rank)


def tally(r):
    COUNTS.add_(r)
"""


def test_the_statements_in_the_loop_that_write_the_weights_under_a_condition(tmp_path: Path) -> None:
    """Held-out sets 12 and 24: rank 0 swaps an average's weights into the model under `if rank
    == 0:` (:24) through a method that copies into each parameter (:12). Not the write before the
    loop (the weights would part at the first check), not the average's update of its own copy
    at every step on every rank, not a library's clip of the gradients, nor a helper handed the
    rank the wrapper was given (`device_ids=[rank]`), which is not the model."""
    from ddpdoctor.analysis.misuse.wrote import Wrote, written_later

    path = str(tmp_path / "train.py")
    Path(path).write_text(WRITTEN_LATER)
    swap = Wrote(24, "ema.copy_to(params)", (23, "if rank == 0:"), (12, "p.copy_(s)"))
    assert written_later(path, 16) == [swap]
    assert written_later(str(tmp_path / "gone.py"), 16) == []


MADE = """\
import torch.distributed as dist


def ink_profile(batch):
    return batch.mean(dim=(0, 1, 2))


def main(batches):
    for x in batches:
        prof = ink_profile(x)
        dist.all_reduce(prof)
        dist.all_reduce(x.sum())
"""


def test_where_a_collectives_tensor_got_its_size(tmp_path: Path) -> None:
    """Held-out set 23: the ranks all-reduce a per-column profile of their padded batch, whose
    width is each rank's own. The size was set where the tensor was made, one call down."""
    from ddpdoctor.analysis.failed.made import tensor_made

    path = str(tmp_path / "ocr.py")
    Path(path).write_text(MADE)
    assert tensor_made(path, 11, "all_reduce") == (
        "its tensor `prof` is made at ocr.py:10 (`prof = ink_profile(x)`), which returns "
        "`batch.mean(dim=(0, 1, 2))` (ocr.py:5)"
    )
    assert tensor_made(path, 12, "all_reduce") == ""  # made in the call itself
    assert (
        tensor_made(path, 11, "broadcast") == ""
        and tensor_made(str(tmp_path / "gone.py"), 11, "all_reduce") == ""
    )


SHARDED = """\
def shard_manifest(items, rank, world):
    mine = items[rank::world]
    mine = [it for it in mine if it["frames"] <= 90]
    return mine


def main(manifest, rank, world, model):
    shard = shard_manifest(manifest, rank, world)
    bs = 16
    n_batches = len(shard) // bs
    for b in range(n_batches):
        model(shard[b * bs : (b + 1) * bs])
"""


def test_where_the_data_of_the_loop_a_rank_ran_out_of_was_made(tmp_path: Path) -> None:
    """Held-out sets 22 and 23: ranks shard by hand, and a filter after the round-robin split (or
    a hash split) leaves them different lengths. From the loop the other ranks are still in, back
    through its function's assignments, into the shard function's lines that build what it returns."""
    from ddpdoctor.analysis.failed.made import loop_data

    path = str(tmp_path / "kws.py")
    Path(path).write_text(SHARDED)
    said = loop_data([(path, 12, "main")])
    assert said.startswith("the loop at kws.py:11 (`for b in range(n_batches):`) iterates what kws.py:10 "), (
        said
    )
    assert "kws.py:8 (`shard = shard_manifest(manifest, rank, world)`) made" in said
    assert said.endswith(
        "shard_manifest() makes it at kws.py:2 (`mine = items[rank::world]`), kws.py:3 "
        "(`mine = [it for it in mine if it['frames'] <= 90]`)"
    )
    assert loop_data([(path, 8, "main")]) == ""  # not in a loop
    assert loop_data([]) == "" and loop_data([(str(tmp_path / "gone.py"), 12, "main")]) == ""


FRAUD = """\
import torch


def load_days(paths):
    parts = [torch.load(p) for p in paths]
    return torch.cat(parts), torch.cat(parts)


def main(day_files, model):
    rank, world = dist.get_rank(), dist.get_world_size()
    my_days = day_files[rank::world]
    x, y = load_days(my_days)
    n_batches = len(x) // 64
    for b in range(n_batches):
        model(x[b * 64 : (b + 1) * 64])
"""


def test_the_trail_of_uneven_data_reaches_the_line_that_split_it_by_rank(tmp_path: Path) -> None:
    """Held-out set 25: each rank loads the day files a rank-strided slice gives it through a
    helper that never reads the rank. The trail goes from the loop into the helper, and names the
    argument's assignment, the line that reads the rank, too; a trail whose lines read the rank
    already (the helper slices by rank itself) is left as it was."""
    from ddpdoctor.analysis.failed.made import loop_data

    path = str(tmp_path / "fraud.py")
    Path(path).write_text(FRAUD)
    said = loop_data([(path, 15, "main")])
    assert (
        "fraud.py:12 (`x, y = load_days(my_days)`), fraud.py:11 (`my_days = day_files[rank::world]`) made"
        in (said)
    ), said
    assert said.endswith("load_days() makes it at fraud.py:5 (`parts = [torch.load(p) for p in paths]`)")
    kws = str(tmp_path / "kws.py")
    Path(kws).write_text(SHARDED)
    whole = loop_data([(kws, 12, "main")])
    assert "kws.py:8 (`shard = shard_manifest(manifest, rank, world)`) made, and" in whole, whole


SORTED = """\
def main(rank, world, sessions, model):
    sessions = sorted(sessions, key=len)
    per_rank = len(sessions) // world
    mine = sessions[rank * per_rank : (rank + 1) * per_rank]
    buckets = make_buckets(len(mine))
    for b in buckets:
        padded, lengths = collate(mine, b)
        out = model(padded, lengths)
    for x in loader:
        model(x)
"""


def test_a_forwards_inputs_are_followed_back_to_the_line_that_cut_them_by_rank(tmp_path: Path) -> None:
    """Held-out set 25's clickstream straggler: sessions sorted by length, then each rank a
    contiguous slice. From the forward's line through `padded` and `mine` to the slice that
    reads the rank (not through the loop over bucket indices, which does not); a forward whose
    inputs no line of its function cuts by rank (a DistributedSampler's loader) names none."""
    from ddpdoctor.analysis.failed.made import rank_split_feeding

    path = str(tmp_path / "clicks.py")
    Path(path).write_text(SORTED)
    said = rank_split_feeding(path, 8)
    assert said == "clicks.py:4 (`mine = sessions[rank * per_rank:(rank + 1) * per_rank]`)", said
    assert rank_split_feeding(path, 10) == ""
    assert rank_split_feeding(str(tmp_path / "gone.py"), 8) == ""


COUNTS = """\
import torch


def recall(y, pred):
    support = torch.bincount(y)
    fixed = torch.bincount(y, minlength=10)
    dist.all_reduce(support)
    dist.all_reduce(fixed)
"""


def test_a_tensor_whose_size_the_data_sets_is_named_with_what_fixes_it(tmp_path: Path) -> None:
    """Held-out set 25: per-class counts from `torch.bincount(y)` are as long as the largest
    label a rank saw; the fix says minlength. One given minlength is sized by the code: nothing."""
    from ddpdoctor.analysis.failed.made import sized_by_data

    path = str(tmp_path / "counts.py")
    Path(path).write_text(COUNTS)
    said = sized_by_data(path, 7, "all_reduce")
    assert said.startswith(
        "`bincount` returns as many counts as the largest value it saw plus one: pass minlength="
    )
    assert said.endswith("(counts.py:5).")
    assert sized_by_data(path, 8, "all_reduce") == "" and sized_by_data(path, 5, "all_reduce") == ""


CHECKPOINTED = """\
import torch.distributed as dist


def main(model, opt, batches, evaluate):
    best = float("inf")
    for epoch in range(8):
        for x in batches:
            model(x).sum().backward()
            opt.step()
        loss = evaluate()
        if loss < best:
            best = loss
            dist.barrier()
"""


def test_a_call_every_rank_made_on_a_schedule_that_one_rank_went_past_is_not_uneven_inputs(
    tmp_path: Path,
) -> None:
    """Held-out set 25: a barrier under `if loss < best:`, the loss each rank's own. For seven
    epochs of four steps every rank improved and made it after the same steps; in the eighth rank
    0 made it after step 31, on schedule, while rank 1 went on to step 32's gradient all-reduce.
    Rank 0's round was as long as every earlier one, so it did not run out of batches: rank 1
    went past the barrier, and the `if` that holds it is named. Where rank 0 reaches the barrier
    early (after step 29), the schedule says nothing and this is not said."""
    from ddpdoctor.analysis.failed.causes import _explain
    from ddpdoctor.analysis.failed.parting import Divergence
    from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE

    path = _script(tmp_path, "t.py", CHECKPOINTED)

    def ledger(rank: int, last: tuple[str, int]) -> Ledger:
        points: list[Point] = []
        for epoch in range(7):
            for step in range(4 * epoch, 4 * epoch + 4):
                points.append(Point(len(points), GRAD_ALLREDUCE, 8, "WORLD", step, "t.py:8", func="main"))
            points.append(Point(len(points), "barrier", 0, "WORLD", 4 * epoch + 3, "t.py:13", func="main"))
        for step in range(28, 28 + (last[1] - 28 if last[0] == "barrier" else 4)):
            points.append(Point(len(points), GRAD_ALLREDUCE, 8, "WORLD", step, "t.py:8", func="main"))
        op, step = last
        points.append(
            Point(len(points), op, 8, "WORLD", step, "t.py:13" if op == "barrier" else "t.py:8", func="main")
        )
        points[-1].in_flight = True
        return Ledger(rank, points=points, last_step=step, files={"t.py": str(path)})

    def judge(waits_after: int) -> Finding | None:
        ledgers = {0: ledger(0, ("barrier", waits_after)), 1: ledger(1, (GRAD_ALLREDUCE, 32))}
        seq = ledgers[0].points[-1].seq
        for lg in ledgers.values():
            lg.points[-1].seq = seq
        div = Divergence("mismatch", None, [], {r: lg.points[-1] for r, lg in ledgers.items()}, {"seq": seq})
        return _explain(div, ledgers)

    found = judge(31)
    assert found is not None and found.kind == "rank_only_collective" and found.ranks == [1], found
    assert found.details["root_rank"] == 1 and found.details["every_steps"] == 4
    said = " ".join(found.summary.split())
    assert said.startswith(
        "rank 1 went past the barrier at t.py:13 in main() this time: in each of the 7 "
    ), said
    assert (
        "every 4 steps (after steps 3, 7, 11, ... 27); now rank 0 made it on schedule, after step 31" in said
    )
    assert "the `if loss < best:` (t.py:11) holding it decided differently on rank 1" in said
    assert (
        "Not uneven inputs" in said and "`if loss < best:` (t.py:11) decides on each rank's own" in found.fix
    )
    early = judge(29)
    assert early is None or "went past" not in early.summary, early
