"""The ledger and its causes on small hand-written traces: each rule against the fact that
decides it (which rank left, mid-pass or out of data, sizes at one sequence number), and the
helpers (period detection, nested phase times) against plain references."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddpdoctor.analysis import diagnose
from ddpdoctor.analysis.failed.ledger import build
from ddpdoctor.analysis.failed.parting import first_divergence
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE
from ddpdoctor.analysis.slow.periodic import beat_in, beat_of
from ddpdoctor.analysis.slow.phases import exclusive_durations
from ddpdoctor.trace.reader import load_run

LOADER = {"id": 7, "sampler": "DistributedSampler", "batch_size": 8, "dataset_len": 128, "batches": 8}
PEER_ERROR = {"type": "RuntimeError", "message": "Connection closed by peer", "thread": "MainThread"}


def _steps(n: int, loader: bool = True) -> list[list]:
    """n training steps: data wait, forward (site 0), bucket all-reduce, backward, optimizer."""
    out: list[list] = [["site", 1, 0, -1, {"id": 0, "file": "/job/train.py", "line": 21, "func": "main"}]]
    if loader:
        out.append(["loader", 2, 0, -1, LOADER])
    for k in range(n):
        t = 100 + 1000 * k
        if loader:
            out.append(["data_wait", t, 10, k - 1, 7])
        out += [
            ["forward", t + 20, 100, k, 1, 1, 3 + k, 0],
            ["allreduce", t + 200, 300, k, 0, 2704, 3 + k],
            ["backward", t + 150, 400, k],
            ["optimizer", t + 600, 50, k, "SGD"],
        ]
    return out


def _write(
    run_dir: Path, rank: int, records: list[list], end: bool = True, error: dict | None = None
) -> None:
    header = [
        "header",
        {"schema": "ddpdoctor.trace/1", "rank": rank, "world_size": 2, "wall_ns": 0, "mono_ns": 0},
    ]
    lines = [header, *records]
    if error is not None:
        lines.append(["rank_error", 90_000, 0, 5, error])
    if end:
        lines.append(["end", 99_000, 0, -1, {"reason": "exit"}])
    run_dir.mkdir(exist_ok=True)
    (run_dir / f"trace-rank{rank}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def _kinds(run_dir: Path) -> dict[str, dict]:
    return {f.kind: f.to_json() for f in diagnose(load_run([run_dir])).findings}


def test_a_rank_that_leaves_mid_pass_is_the_root_and_the_survivors_error_a_consequence(
    tmp_path: Path,
) -> None:
    _write(tmp_path, 0, _steps(6), error=PEER_ERROR)
    _write(tmp_path, 1, _steps(3))  # read 3 of its 8 batches, then exited cleanly
    found = _kinds(tmp_path)
    assert "rank_left_early" in found and "rank_failure" not in found
    f = found["rank_left_early"]
    assert f["details"]["root_rank"] == 1 and "train.py:21" in json.dumps(f)
    assert any("rank_failure" in c for c in f["details"]["consequences"])


def test_a_rank_that_ran_out_of_data_is_uneven_inputs(tmp_path: Path) -> None:
    short = dict(LOADER, batches=3)
    _write(tmp_path, 0, [r if r[0] != "loader" else ["loader", 2, 0, -1, short] for r in _steps(3)])
    _write(tmp_path, 1, _steps(6), error=PEER_ERROR)
    found = _kinds(tmp_path)
    assert found["uneven_inputs"]["details"]["root_rank"] == 0 and "join" in found["uneven_inputs"]["fix"]
    assert found["uneven_inputs"]["summary"].endswith(
        "its DataLoader gives 3 batches a pass, from 128 samples, rank 1's 8, from 128 samples: the same "
        "number of samples on every rank, dealt into unequal batches by its sampler, a DistributedSampler"
    )


def test_uneven_inputs_from_datasets_of_unequal_length_say_so(tmp_path: Path) -> None:
    short = dict(LOADER, batches=3, dataset_len=24, site="train.py:40")
    _write(tmp_path, 0, [r if r[0] != "loader" else ["loader", 2, 0, -1, short] for r in _steps(3)])
    _write(tmp_path, 1, _steps(6), error=PEER_ERROR)
    summary = _kinds(tmp_path)["uneven_inputs"]["summary"]
    assert (
        "its DataLoader (iterated at train.py:40) gives 3 batches a pass, from 24 samples, rank 1's 8, "
        in summary
    )
    assert summary.endswith(
        "from 128 samples: the ranks' datasets differ in length (each rank builds or is given "
        "a shard of its own size: start where that shard is made)"
    )


def _epochs(passes: list[int], batches: int) -> list[list]:
    """Steps in passes of the given lengths over one loader that says it gives ``batches``."""
    steps = _steps(sum(passes))
    out, k = [r for r in steps if r[0] != "loader"], 0
    for n in passes:  # a pass begins just before its first batch's wait
        out.append(["loader", 100 + 1000 * k - 5, 0, k - 1, dict(LOADER, batches=batches)])
        k += n
    return out


def test_a_rank_out_of_data_behind_longer_passes_before_is_uneven_not_left_early(tmp_path: Path) -> None:
    # Rank 1 read all of each pass (3 and 3 batches) and exited; rank 0's passes give 4, so it
    # is still inside its second pass at step 6 with fewer batches of it read than rank 1 had.
    _write(tmp_path, 0, _epochs([4, 3], 4), error=PEER_ERROR)
    _write(tmp_path, 1, _epochs([3, 3], 3))
    found = _kinds(tmp_path)
    assert "rank_left_early" not in found, found.get("rank_left_early")
    assert found["uneven_inputs"]["details"]["root_rank"] == 1


def test_a_rank_that_stops_after_a_whole_pass_the_others_match_left_early(tmp_path: Path) -> None:
    # The same passes on both ranks: rank 1 stopped after its first, rank 0 began the next.
    _write(tmp_path, 0, _epochs([3, 2], 3), error=PEER_ERROR)
    _write(tmp_path, 1, _epochs([3], 3))
    found = _kinds(tmp_path)
    assert "uneven_inputs" not in found and found["rank_left_early"]["details"]["root_rank"] == 1


def test_unequal_steps_that_end_cleanly_on_every_rank_are_not_a_failure(tmp_path: Path) -> None:
    _write(tmp_path, 0, _steps(3, loader=False))  # e.g. under model.join()
    _write(tmp_path, 1, _steps(6, loader=False))
    assert not [f for f in diagnose(load_run([tmp_path])).findings if f.severity != "info"]


def test_different_sizes_at_one_sequence_number_are_a_mismatch_with_both_sites(tmp_path: Path) -> None:
    for rank, nbytes in ((0, 8), (1, 12)):
        site = ["site", 5, 0, 2, {"id": 1, "file": "/job/train.py", "line": 27 + rank, "func": "main"}]
        coll = ["collective", 5000, 30, 2, "all_reduce", nbytes, "WORLD", 2, 9, 0, 1]
        _write(tmp_path, rank, [*_steps(3, loader=False), site, coll])
    ledgers = build(load_run([tmp_path]))
    div = first_divergence(ledgers)
    assert div is not None and div.what == "mismatch" and div.evidence["seq"] == 9
    assert div.evidence["differs"] == "size"
    assert "rank 0 8 bytes, rank 1 12 bytes" in div.evidence["disagreement"]
    f = _kinds(tmp_path)["collective_mismatch"]
    assert "train.py:27" in f["summary"] and "train.py:28" in f["summary"] and "size" in f["fix"]


def test_same_ledgers_have_no_divergence(tmp_path: Path) -> None:
    for rank in (0, 1):
        _write(tmp_path, rank, _steps(5))
    assert first_divergence(build(load_run([tmp_path]))) is None


def test_the_beat_of_late_steps() -> None:
    assert beat_of(np.array([4, 9, 14, 19, 24])) == (5, 4)
    assert beat_of(np.array([4, 9, 14, 20, 24, 29])) == (5, 4)  # one gap off: still regular
    assert beat_of(np.array([1, 2, 7, 8, 20])) is None
    assert beat_of(np.array([4, 9])) is None
    assert beat_of(np.array([1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23])) is None  # ranks taking turns


def _row(n: int, late: dict[int, float], noise: dict[int, float] | None = None) -> np.ndarray:
    row = np.zeros(n)
    for step, ms in {**(noise or {}), **late}.items():
        row[step] = ms * 1e3
    return row


def test_a_beat_is_checked_on_the_whole_row() -> None:
    k, late = beat_in(_row(24, {7: 80, 15: 80, 23: 80}))
    assert (k, late.tolist()) == (8, [7, 15, 23])  # the end of each epoch
    # Late steps that share a residue by chance are not work every k steps: most steps on
    # that beat are on time, or as many off it are as late.
    assert beat_in(_row(24, {3: 9, 9: 9, 11: 9, 17: 9, 21: 9})) is None
    noisy = {s: 4.0 for s in (1, 2, 4, 5, 9, 12, 16, 20, 22)}
    assert beat_in(_row(24, {0: 11, 7: 11, 14: 11, 18: 11}, noisy)) is None
    # A first occurrence that warms a cache, and a last step that saves, far above the rest:
    # the beat is still every 5th step, every one of its steps late.
    warm = {5: 350, **{s: 90 for s in range(10, 60, 5)}}
    k, late = beat_in(_row(60, warm, {59: 300}))
    assert k == 5 and late.tolist() == list(range(5, 60, 5))


def test_optimizer_time_excludes_the_forward_and_backward_run_inside_it(tmp_path: Path) -> None:
    records = [
        ["optimizer", 100, 1000, 0, "SGD"],  # closure: forward and backward inside
        ["forward", 150, 200, 0, 1, 1, 3, -1],
        ["backward", 400, 500, 0],
        ["optimizer", 2000, 50, 1, "SGD"],  # plain: nothing inside
        ["forward", 2100, 100, 1, 1, 1, 4, -1],
    ]
    _write(tmp_path, 0, records)
    _write(tmp_path, 1, records)
    trace = load_run([tmp_path]).ranks[0]
    assert exclusive_durations(trace, "optimizer").tolist() == [300, 50]


def test_periodic_work_is_timed_once_not_once_per_bucket() -> None:
    # Rank 1 spends 40 ms more every 9th step; rank 0 waits for it in each of 3 overlapping
    # bucket all-reduces, which summed said 80 ms.
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.simulate import Slowdown, simulate_run

    run = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 40.0, {6, 15, 24, 33}))
    (f,) = [f for f in diagnose(run).findings if f.kind == "periodic_rank_work"]
    assert f.ranks == [1] and f.details["period_steps"] == 9
    assert f.details["ms_each"] == pytest.approx(40.0, rel=0.1)


def test_periodic_work_compares_only_steps_every_rank_numbered_alike() -> None:
    """Under a Join context the rank that ran out of batches shadows the others' last all-reduces
    with no steps of its own, so its step 28 is another rank's step 40: the gradient buckets'
    sequence numbers differ. Held-out set 25's healthy twin (28 and 40 batches an epoch) read as
    "every 28 steps rank 0 spends 22 ms in its own code". Steps whose last buckets the ranks
    numbered differently are not compared: here rank 1's beat after step 10 is left out, and one
    late step is no beat."""
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace import schema
    from ddpdoctor.trace.columns import Events
    from ddpdoctor.trace.simulate import Slowdown, simulate_run

    run = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 40.0, {6, 15, 24, 33}))
    ar = run.ranks[1].events[schema.ALLREDUCE]
    steps = ar.step.tolist()
    fields = [(f[0], f[1], f[2] + 100 * (s >= 10)) for f, s in zip(ar.fields, steps, strict=True)]
    run.ranks[1].events[schema.ALLREDUCE] = Events(
        np.asarray(ar.ts), np.asarray(ar.dur), np.asarray(steps), fields
    )
    assert [f for f in diagnose(run).findings if f.kind == "periodic_rank_work"] == []


def test_periodic_lateness_spent_waiting_for_a_cpu_is_the_hosts_not_rank_only_work() -> None:
    """Late every 9th step only because the rank sat in the run queue (a crowded host) is not
    work of its own; late with some of it spent waiting still is, and says how much."""
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.simulate import Slowdown, simulate_run

    beat = {6, 15, 24, 33}
    starved = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 40.0, beat, starved=1.0))
    assert [f for f in diagnose(starved).findings if f.kind == "periodic_rank_work"] == []
    stretched = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 40.0, beat, starved=0.25))
    (f,) = [f for f in diagnose(stretched).findings if f.kind == "periodic_rank_work"]
    assert f.ranks == [1] and f.details["period_steps"] == 9
    assert f.details["cpu_wait_ms"] == pytest.approx(10.0, rel=0.1)
    assert (
        f.details["ms_each"] == pytest.approx(30.0, rel=0.1) and "10 ms more waiting for a CPU" in f.summary
    )


C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
GLOO_WORDS = [
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 676 vs 4. Received "
    "data size doesn't match expected size. Is there a distributed collective mismatch in your code?",
]


def _stack(*frames: tuple[str, int, str], header: str = "Fatal Python error: Aborted") -> str:
    """A faulthandler dump: a writer thread, then the main thread (innermost frame first)."""
    lines = [header, "", "Thread 0x00007f19c71ff6c0 (most recent call first):"]
    lines += ['  File "/usr/lib/python3.11/threading.py", line 331 in wait']
    lines += ["", "Thread 0x00007f19ece1eb80 (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    lines += ['  File "/job/train.py", line 50 in <module>']
    return "\n".join(lines) + "\n"


def _ends(run_dir: Path, ranks: dict[int, dict]) -> None:
    (run_dir / "ends.json").write_text(json.dumps({"schema": "ddpdoctor.ends/1", "ranks": ranks}))


# Rank 1's stack when the launcher's SIGTERM caught it formatting the exception its backward
# raised (in ddpdoctor's excepthook, before the rank_error record was written): no frame of its
# own code is left, only its trace's ``raised`` record says where the exception came from.
_EXCEPTHOOK_STACK = (
    "Thread 0x00007fdd8d1ff6c0 (most recent call first):\n"
    '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
    "Current thread 0x00007fddaec1bb80 (most recent call first):\n"
    '  File "<frozen abc>", line 123 in __subclasscheck__\n'
    '  File "/usr/lib/python3.11/traceback.py", line 869 in format_exception_only\n'
    '  File "/venv/lib/python3.11/site-packages/ddpdoctor/probes/liveness.py", line 241 in _chain_text\n'
    '  File "/venv/lib/python3.11/site-packages/ddpdoctor/probes/liveness.py", line 279 in excepthook\n'
)


@pytest.mark.parametrize("stopped", ["in its backward", "formatting what its backward raised"])
def test_a_rank_killed_inside_a_collective_its_peer_never_issued_is_the_root_not_a_failure(
    tmp_path: Path, stopped: str
) -> None:
    """Rank 0 aborts (SIGABRT: gloo saw a size it did not expect) inside an all_reduce after its
    last step; rank 1 was in its next step's gradient all-reduce when the launcher stopped it.
    The traces hold neither in-flight call: the death stacks say where each rank was, or, where
    rank 1's stack shows only its exception being handled, its trace's raised backward does."""
    _write(tmp_path, 0, _steps(3), end=False)  # 3 of its pass's 8 batches: not out of data
    raised = ["raised", 4150, 0, 3, {"kind": "backward", "fields": [1], "dur_us": 51_457}]
    last = [["forward", 4000, 100, 3, 1, 1, 6, 0], *([raised] if stopped.startswith("formatting") else [])]
    _write(tmp_path, 1, [*_steps(3), *last], end=False)
    abort = _stack((C10D, 3252, "all_reduce"), ("/job/train.py", 40, "main"))
    term = _stack(
        ("/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 395, "backward"),
        ("/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward"),
        ("/job/train.py", 22, "main"),
        header="",
    )
    if stopped.startswith("formatting"):
        term = _EXCEPTHOOK_STACK
    _ends(
        tmp_path,
        {
            "0": {"how": "signal", "signal": "SIGABRT", "stack": abort, "words": GLOO_WORDS, "at_wall": 1.0},
            "1": {"how": "signal", "signal": "SIGTERM", "stack": term, "words": [], "at_wall": 2.0},
        },
    )
    ledgers = build(load_run([tmp_path]))
    assert ledgers[0].points[-1].died_in and ledgers[0].points[-1].seq == 6
    div = first_divergence(ledgers)
    assert div is not None and div.what == "mismatch" and div.evidence["differs"] == "op"
    found = _kinds(tmp_path)
    assert "rank_failure" not in found
    f = found["rank_only_collective"]
    assert f["severity"] == "error" and f["details"]["root_rank"] == 0
    assert f["details"]["place"] == "train.py:40" and "branch" in f["fix"]
    assert "SIGABRT" in f["details"]["deaths"]["0"] and "SIGABRT inside it" in f["summary"]
    assert any("SIGABRT" in c for c in f["details"]["consequences"])


def test_ranks_killed_inside_the_same_collective_the_backend_says_disagree_are_a_mismatch(
    tmp_path: Path,
) -> None:
    """Both ranks die inside all_reduce #6 at different lines; sizes are not in a stack, but
    the backend's last words say the sizes differ."""
    for rank in (0, 1):
        _write(tmp_path, rank, _steps(3, loader=False), end=False)
    stacks = {r: _stack((C10D, 3252, "all_reduce"), ("/job/train.py", 40 + r, "main")) for r in (0, 1)}
    _ends(
        tmp_path,
        {
            "0": {"how": "signal", "signal": "SIGABRT", "stack": stacks[0], "words": GLOO_WORDS},
            "1": {"how": "signal", "signal": "SIGTERM", "stack": stacks[1], "words": []},
        },
    )
    f = _kinds(tmp_path)["collective_mismatch"]
    assert "train.py:40" in f["summary"] and "train.py:41" in f["summary"] and "size" in f["fix"]
    assert "collective mismatch" in f["details"]["backend_said"]


@pytest.mark.parametrize("peer", ["raised", "completed"])
def test_a_rank_aborted_by_the_backend_in_a_collective_its_peer_raised_out_of_is_a_mismatch(
    tmp_path: Path, peer: str
) -> None:
    """Rank 0 aborts inside all_reduce #6 (gloo: the sizes differ) before any status said its
    size; rank 1 raised out of the same all_reduce when its peer died (its size is on record).
    The collective completed on no rank: the backend's words stand. Had rank 1's completed, they
    would contradict it, and the abort stays a rank failure."""
    _write(tmp_path, 0, _steps(3, loader=False), end=False)
    one = _steps(3, loader=False)
    if peer == "raised":
        one += [
            [
                "raised",
                3500,
                0,
                2,
                {"kind": "collective", "fields": ["all_reduce", 40, "WORLD", 2, 6, 0, 0, 0]},
            ],
            ["rank_error", 3600, 0, 2, PEER_ERROR],
        ]
    else:
        one += [["collective", 3500, 10, 2, "all_reduce", 24, "WORLD", 2, 6, 0, 0, 0]]
    _write(tmp_path, 1, one, end=False)
    abort = _stack((C10D, 3252, "all_reduce"), ("/job/train.py", 21, "main"))
    _ends(tmp_path, {"0": {"how": "signal", "signal": "SIGABRT", "stack": abort, "words": GLOO_WORDS}})
    found = _kinds(tmp_path)
    if peer == "completed":
        assert "collective_mismatch" not in found and "rank_failure" in found
        return
    f = found["collective_mismatch"]
    assert f["ranks"] == [0, 1] and f["details"]["root_rank"] is None and "rank_failure" not in found
    assert "40 bytes, raised" in f["summary"] and "size" in f["fix"]
    assert "collective mismatch" in f["details"]["backend_said"]


def test_the_signature_of_the_call_a_rank_died_in_is_the_one_described_after_its_last_record(
    tmp_path: Path,
) -> None:
    """The probe writes a call's signature just before the call: rank 0, aborted inside
    all_reduce #6 before its record, left a float32 signature no record names, newer than its
    last collective; rank 1 raised out of it with an int64 one. The dtypes differ, and that is
    what the finding and its fix say. An older signature (named by a record) is not taken."""
    site = ["site", 3400, 0, 2, {"id": 1, "file": "/job/train.py", "line": 61, "func": "sync"}]
    old = ["signature", 3000, 0, 2, {"id": 0, "dtype": "float32", "numel": 8, "root": -1, "ranks": ""}]
    used = ["collective", 3100, 10, 2, "all_reduce", 32, "WORLD", 2, 5, 0, 1, 0]
    zero = [*_steps(3, loader=False), site, old, used]
    float32 = ["signature", 3450, 0, 2, {"id": 1, "dtype": "float32", "numel": 2, "root": -1, "ranks": ""}]
    _write(tmp_path, 0, [*zero, float32], end=False)
    int64 = ["signature", 3450, 0, 2, {"id": 1, "dtype": "int64", "numel": 2, "root": -1, "ranks": ""}]
    raised = {"kind": "collective", "fields": ["all_reduce", 16, "WORLD", 2, 6, 0, 1, 1]}
    error = ["rank_error", 3600, 0, 2, PEER_ERROR]
    _write(tmp_path, 1, [*zero, int64, ["raised", 3500, 0, 2, raised], error], end=False)
    abort = _stack((C10D, 3252, "all_reduce"), ("/job/train.py", 61, "sync"))
    _ends(tmp_path, {"0": {"how": "signal", "signal": "SIGABRT", "stack": abort, "words": GLOO_WORDS}})
    f = _kinds(tmp_path)["collective_mismatch"]
    said = "ranks disagree on the all_reduce's dtype at collective #6: rank 0 float32, rank 1 int64"
    assert said in f["summary"], f["summary"]
    assert "dtype=torch.float32" in f["fix"] and "int64" in f["fix"]
    # Without the newer signature, rank 0's call is only known by its stack: nothing compared.
    _write(tmp_path, 0, zero, end=False)
    f = _kinds(tmp_path)["collective_mismatch"]
    assert "dtype" not in f["summary"] and "float32" not in f["summary"]


def test_gathered_sizes_that_differ_where_the_backend_aborted_name_the_rank_whose_size_changed(
    tmp_path: Path,
) -> None:
    """all_gather into a list may take sizes that differ on some backends, so its element count
    is not compared by itself; once gloo aborts on it, it is the mismatch. Rank 1's count at
    that line changed from its own earlier calls (a batch short by one sample): the root."""
    site = ["site", 3000, 0, 2, {"id": 1, "file": "/job/train.py", "line": 97, "func": "gather"}]
    full = ["signature", 3001, 0, 2, {"id": 0, "dtype": "float32", "numel": 2048, "root": -1, "ranks": ""}]
    before = ["collective", 3100, 10, 2, "all_gather", 8192, "WORLD", 2, 5, 0, 1, 0]
    zero = [*_steps(3, loader=False), site, full, before]
    at6 = ["collective", 3500, 10, 2, "all_gather", 8192, "WORLD", 2, 6, 0, 1, 0]
    _write(tmp_path, 0, [*zero, at6, ["rank_error", 3600, 0, 2, PEER_ERROR]], end=False)
    short = ["signature", 3450, 0, 2, {"id": 1, "dtype": "float32", "numel": 1984, "root": -1, "ranks": ""}]
    _write(tmp_path, 1, [*zero, short], end=False)
    abort = _stack((C10D, 3252, "all_gather"), ("/job/train.py", 97, "gather"))
    _ends(tmp_path, {"1": {"how": "signal", "signal": "SIGABRT", "stack": abort, "words": GLOO_WORDS}})
    f = _kinds(tmp_path)["collective_mismatch"]
    said = "rank 0 2,048 elements, rank 1 1,984 elements; rank 1's earlier calls from that line had 2,048"
    assert said in f["summary"], f["summary"]
    assert f["details"]["root_rank"] == 1 and "rank_failure" not in _kinds(tmp_path)


def test_a_rank_killed_outside_any_collective_stays_a_rank_failure(tmp_path: Path) -> None:
    """os.abort() in the user's own code: no sync point in its stack, so nothing diverged first."""
    _write(tmp_path, 0, _steps(5, loader=False), end=False)
    _write(tmp_path, 1, _steps(3, loader=False), end=False)
    abort = _stack(("/job/train.py", 33, "main"))
    backward = ("/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward")
    term = _stack(backward, ("/job/train.py", 22, "main"))
    _ends(
        tmp_path,
        {
            "0": {"how": "signal", "signal": "SIGTERM", "stack": term, "words": [], "at_wall": 2.0},
            "1": {"how": "signal", "signal": "SIGABRT", "stack": abort, "words": [], "at_wall": 1.0},
        },
    )
    findings = diagnose(load_run([tmp_path])).findings
    assert any(f.kind == "rank_failure" and 1 in f.ranks and "SIGABRT" in f.summary for f in findings)
    assert not any(f.kind in ("rank_only_collective", "collective_mismatch") for f in findings)


def _skipping(n: int, skipped: int) -> list[list]:
    """n steps whose all-reduces carry the backend's sequence numbers, without step ``skipped``'s."""
    out, seq = [], 3
    for rec in _steps(n):
        if rec[0] == "allreduce":
            if rec[3] == skipped:
                continue
            rec = [*rec[:6], seq]
            seq += 1
        out.append(rec)
    return out


def test_a_sync_point_matched_across_steps_is_the_first_divergence_and_names_the_skipped_step(
    tmp_path: Path,
) -> None:
    # Rank 1 ran step 2's forward but no all-reduce: its step 3 pairs with rank 0's step 2.
    _write(tmp_path, 0, _skipping(6, skipped=-1), end=False)
    _write(tmp_path, 1, _skipping(6, skipped=2), end=False)
    div = first_divergence(build(load_run([tmp_path])))
    assert div is not None and div.what == "steps" and div.root == 1
    assert div.evidence == {"seq": 5, "steps": {0: 2, 1: 3}}
    f = _kinds(tmp_path)["skipped_gradient_sync"]
    assert f["details"]["root_rank"] == 1 and f["details"]["step"] == 2
    assert "rank 1 ran step 2's forward at train.py:21 but no gradient all-reduce" in f["summary"]


def _untimed(records: list[list]) -> list[list]:
    """The same steps with their buckets untimed (DDPDOCTOR_BUCKET_TIMING): no all-reduce
    records; each training forward holds the sequence number it found, as the probe records it."""
    out, seq = [], 3
    reductions = {rec[3]: rec[6] for rec in records if rec[0] == "allreduce"}
    for rec in records:
        if rec[0] == "allreduce":
            continue
        if rec[0] == "forward":
            rec = [*rec[:6], seq, *rec[7:]]
            seq += rec[3] in reductions
        out.append(rec)
    return out


def test_untimed_buckets_are_the_gaps_in_the_sequence_numbers_and_part_the_ranks_the_same_way(
    tmp_path: Path,
) -> None:
    _write(tmp_path, 0, _untimed(_skipping(6, skipped=-1)), end=False)
    _write(tmp_path, 1, _untimed(_skipping(6, skipped=2)), end=False)
    ledgers = build(load_run([tmp_path]))
    grads = {
        r: [(p.seq, p.step) for p in lg.points if p.op == "gradient all-reduce"] for r, lg in ledgers.items()
    }
    # The last step, with no recorded call after it, uses as many numbers as the step before.
    assert grads[0] == [(3, 0), (4, 1), (5, 2), (6, 3), (7, 4), (8, 5)]
    assert grads[1] == [(3, 0), (4, 1), (5, 3), (6, 4), (7, 5)]
    div = first_divergence(ledgers)
    assert div is not None and div.what == "steps" and div.root == 1
    assert div.evidence == {"seq": 5, "steps": {0: 2, 1: 3}}
    f = _kinds(tmp_path)["skipped_gradient_sync"]
    assert f["details"]["root_rank"] == 1 and f["details"]["step"] == 2


def test_a_recorded_collective_keeps_its_number_among_untimed_buckets(tmp_path: Path) -> None:
    records = _untimed(_skipping(4, skipped=-1))
    for k, rec in enumerate(records):  # step 1 also calls all_reduce after its backward
        if rec[0] == "optimizer" and rec[3] == 1:
            records.insert(k, ["collective", rec[1] - 5, 3, 1, "all_reduce", 4, "WORLD", 2, 5, 0])
            break
    for rec in records:  # ... so the forwards after it find numbers one higher
        if rec[0] == "forward" and rec[3] >= 2:
            rec[6] += 1
    _write(tmp_path, 0, records)
    points = [(p.seq, p.op) for p in build(load_run([tmp_path]))[0].points]
    expected = [(3, GRAD_ALLREDUCE), (4, GRAD_ALLREDUCE), (5, "all_reduce"), (6, GRAD_ALLREDUCE)]
    assert points == [*expected, (7, GRAD_ALLREDUCE)]


def test_the_same_schedule_on_every_rank_is_no_divergence(tmp_path: Path) -> None:
    for rank in (0, 1):  # both skip step 2's all-reduce (no_sync on every rank)
        _write(tmp_path, rank, _skipping(6, skipped=2))
    assert first_divergence(build(load_run([tmp_path]))) is None
    assert "skipped_gradient_sync" not in _kinds(tmp_path)


def test_a_broadcast_whose_src_differs_is_a_mismatch_that_names_the_src(tmp_path: Path) -> None:
    for rank in (0, 1):
        site = ["site", 5, 0, 2, {"id": 1, "file": "/job/train.py", "line": 30, "func": "main"}]
        sig = ["signature", 5, 0, 2, {"id": 0, "dtype": "int64", "numel": 1, "root": rank, "ranks": ""}]
        coll = ["collective", 5000, 30, 2, "broadcast", 8, "WORLD", 2, 9, 0, 1, 0]
        _write(tmp_path, rank, [*_steps(3, loader=False), site, sig, coll])
    f = _kinds(tmp_path)["collective_mismatch"]
    said = "ranks disagree on the broadcast's src at collective #9: rank 0 src=0, rank 1 src=1"
    assert said in f["summary"]
    assert "src=0" in f["fix"]


def test_a_timeout_is_charged_to_the_work_the_waiting_rank_awaited(tmp_path: Path) -> None:
    # Rank 0 waited 3 s in monitored_barrier and raised; rank 1 was in its own function when the
    # launcher stopped it (the stack it left): the root is rank 1's work, rank 0's error follows.
    site = ["site", 5, 0, 2, {"id": 1, "file": "/job/train.py", "line": 34, "func": "main"}]
    barrier = ["collective", 5000, 3_000_000, 2, "monitored_barrier", 0, "WORLD", 2, 9, 0, 1, 0]
    message = "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 3000 ms\nTimed out waiting 3000ms"
    error = {"type": "RuntimeError", "message": message, "thread": "MainThread"}
    _write(tmp_path, 0, [*_steps(3, loader=False), site, barrier], error=error)
    _write(tmp_path, 1, _steps(3, loader=False), end=False)
    stack = (
        "Current thread 0x00007fe1ed408b80 (most recent call first):\n"
        '  File "/job/train.py", line 19 in rebuild_feature_cache\n'
        '  File "/job/train.py", line 33 in main\n'
        '  File "/job/train.py", line 39 in <module>\n'
    )
    end = {"how": "signal", "signal": "SIGSEGV", "stack": stack, "at_wall": 9.0, "consequence": False}
    (tmp_path / "ends.json").write_text(json.dumps({"ranks": {"1": end}}))
    assert "awaited_work" not in _kinds(tmp_path), "a rank that crashed on its own was not awaited"
    stopped = dict(end, signal="SIGTERM", consequence=True, source="the launcher, after rank 0 failed")
    (tmp_path / "ends.json").write_text(json.dumps({"ranks": {"1": stopped}}))
    found = _kinds(tmp_path)
    f = found["awaited_work"]
    assert f["ranks"] == [1] and f["severity"] == "error" and f["details"]["place"] == "train.py:19"
    assert "rank 1 was running rebuild_feature_cache() at train.py:19" in f["summary"]
    assert "rank 0 waited 3.0 s in monitored_barrier #9 at train.py:34" in f["summary"]
    assert "monitored_barrier(timeout=...)" in f["fix"] and "rank_failure" not in found


_SAVE_STACK = (
    "Current thread 0x00007fe1ed408b80 (most recent call first):\n"
    '  File "/job/train.py", line 31 in save_checkpoint\n'
    '  File "/job/train.py", line 53 in main\n'
    '  File "/job/train.py", line 60 in <module>\n'
)


@pytest.mark.parametrize("waited_in", ["gradient all-reduce", "barrier"])
def test_a_wait_that_raised_is_charged_to_the_awaited_work(tmp_path: Path, waited_in: str) -> None:
    # What a rank that times out leaves now: the span it raised in is a ``raised`` record (not
    # a completed collective), in a Python collective or in the backward of a DDP step whose
    # gradient all-reduce never completed. Rank 0 was in save_checkpoint() when the launcher
    # stopped it: the root is that work, whichever sync point the waiting rank timed out in.
    message = "Timed out waiting 5000ms for recv operation to complete"
    if waited_in == "barrier":
        fields = ["barrier", 0, "WORLD", 2, 9, 0, 1, 0]
        extra = [
            ["site", 5, 0, 2, {"id": 1, "file": "/job/train.py", "line": 50, "func": "main"}],
            ["raised", 5000, 0, 2, {"kind": "collective", "fields": fields, "dur_us": 5_000_000}],
        ]
        frames = [["/job/train.py", 50, "main"]]
    else:
        extra = [
            ["forward", 4000, 100, 3, 1, 1, 9, 0],
            ["raised", 4200, 0, 3, {"kind": "backward", "fields": [1], "dur_us": 5_000_000}],
        ]
        frames = [
            ["/job/train.py", 47, "main"],
            ["/venv/lib/python3.11/site-packages/torch/_tensor.py", 623, "backward"],
        ]
    error = {"type": "RuntimeError", "message": message, "thread": "MainThread", "frames": frames}
    _write(tmp_path, 1, [*_steps(3, loader=False), *extra], error=error)
    _write(tmp_path, 0, _steps(3, loader=False), end=False)
    end = {"how": "signal", "signal": "SIGTERM", "stack": _SAVE_STACK, "at_wall": 9.0, "consequence": True}
    (tmp_path / "ends.json").write_text(json.dumps({"ranks": {"0": end}}))
    found = _kinds(tmp_path)
    f = found["awaited_work"]
    assert f["details"]["root_rank"] == 0 and f["details"]["place"] == "train.py:31"
    assert f"rank 1 waited 5.0 s in {waited_in}" in f["summary"], f["summary"]
    assert "init_process_group(timeout=...)" in f["fix"] and "rank_failure" not in found


def test_models_that_differ_by_rank_are_set_side_by_side(tmp_path: Path) -> None:
    message = "[1]: params[2] in this process with sizes [8, 32] appears not to match sizes"
    for rank, classes in ((0, 4), (1, 8)):
        shapes = [["0.weight", [32, 16], "Linear"], ["2.weight", [classes, 32], "Linear"]]
        info = {"error": "ddp_init", "message": message, "module": "Sequential", "shapes": shapes}
        frames = [["/job/train.py", 19, "main"], ["/usr/lib/python3/site-packages/torch/nn/x.py", 5, "f"]]
        error = {"type": "RuntimeError", "message": message, "thread": "MainThread", "frames": frames}
        _write(tmp_path, rank, [["ddp_error", 10, 0, -1, info]], error=error)
    found = _kinds(tmp_path)
    f = found["model_differs"]
    assert "module '2' (Linear) differs: 2.weight: rank 0 [4, 32], rank 1 [8, 32]" in f["summary"]
    assert f["details"]["place"] == "train.py:19" and "rank_failure" not in found


def test_the_forward_where_the_ranks_parted_is_matched_by_count_across_cut_tails() -> None:
    """Rank 0's 11th forward ran at a probe's line while rank 1's 11th was its training forward:
    the place the wrapper's collectives went out of step, found with the ledgers' tails cut at
    different counts (each keeps its last forwards only)."""
    from ddpdoctor.analysis.failed.forwards import parted_forward
    from ddpdoctor.analysis.failed.points import Ledger

    train, probe = "train.py:72", "train.py:54"
    zero = [(s, True, True, train) for s in range(10)] + [(10, True, True, probe), (11, True, True, train)]
    one = [(s, True, True, train) for s in range(12)]
    a, b = Ledger(0, forwards=zero[4:], forwards_from=4), Ledger(1, forwards=one[7:], forwards_from=7)
    assert parted_forward({0: a, 1: b}, 0, [1]) == (probe, train, 10)
    same = Ledger(0, forwards=one[3:], forwards_from=3)
    assert parted_forward({0: same, 1: b}, 0, [1]) is None


_TENSOR = "/venv/lib/python3.11/site-packages/torch/_tensor.py"
_ENGINE = "/venv/lib/python3.11/site-packages/torch/autograd/graph.py"
_SIGNALS = "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/signal_handling.py"


def test_a_backward_that_raised_after_its_all_reduce_completed_was_in_no_collective(tmp_path: Path) -> None:
    """Rank 1's DataLoader worker was OOM-killed; the loader's SIGCHLD handler raised in rank 1
    as its step-0 backward returned, after its one bucket's all-reduce (#3) had completed. Rank
    0 went on and its step-1 forward lost its peer. Rank 1 was in no collective: it is the root
    (its own error), not rank 0 "left early" for lacking an all-reduce #4 rank 1 never issued."""
    layout = ["bucket", 90, 0, 0, {"index": 0, "bytes": 2704, "params": ["w", "b"]}]
    init = ["ddp_init", 10, 50, -1, {"module": "Net", "params": 676, "buckets": [2704], "seq": 0}]
    cut = ["raised", 1120, 0, 1, {"kind": "forward", "fields": [1], "dur_us": 1_400}]
    _write(
        tmp_path,
        0,
        [*_steps(1), init, layout, cut],
        error={**PEER_ERROR, "frames": [["/job/train.py", 21, "main"]]},
    )
    killed = {
        "type": "RuntimeError",
        "message": "DataLoader worker (pid 15575) is killed by signal: Killed.",
        "thread": "MainThread",
        "frames": [
            ["/job/train.py", 21, "main"],
            [_TENSOR, 623, "backward"],
            [_ENGINE, 979, "_engine_run_backward"],
            [_SIGNALS, 73, "handler"],
        ],
    }
    steps = [r for r in _steps(1) if r[0] not in ("backward", "optimizer")]
    raised = ["raised", 150, 0, 0, {"kind": "backward", "fields": [], "dur_us": 500}]
    _write(tmp_path, 1, [*steps, init, layout, raised], error=killed)
    ledgers = build(load_run([tmp_path]))
    assert ledgers[1].buckets == 1
    assert all(p.seq == 3 and not p.in_flight for p in ledgers[1].points), ledgers[1].points
    found = _kinds(tmp_path)
    assert "rank_left_early" not in found and "uneven_inputs" not in found
    assert found["rank_failure"]["ranks"] == [1] and found["rank_failure"]["severity"] == "error"
