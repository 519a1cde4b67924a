"""A straggler's line from its profile against a peer's: the parsing of py-spy's samples and
the comparison, on samples whose answer is known (the end-to-end run is in test_misuse_e2e)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ddpdoctor.analysis.slow.where import line_text, straggler_line
from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor.profile import StragglerProfile, collapsed_lines
from ddpdoctor.trace.reader import Run

LIB = "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py"
THREADING = "/usr/lib/python3.11/threading.py"
MAIN = "<module> (/home/u/train.py:70)"
RAW = "\n".join(
    [
        f"{MAIN};main (/home/u/train.py:52);_call_impl ({LIB}:1775);Net.forward (/home/u/train.py:23) 120",
        f"{MAIN};main (/home/u/train.py:55);backward ({LIB}:520) 60",
        f"Thread._bootstrap ({THREADING}:1002);Thread.run ({THREADING}:982);poll (/home/u/train.py:9) 300",
        f"{MAIN};_call_impl ({LIB}:1775) 5",
        " 2",
    ]
)


def test_samples_count_the_main_threads_innermost_user_line() -> None:
    total, lines = collapsed_lines(RAW)
    assert total == 185, "the background thread and the empty stack are not the main thread's"
    assert lines == [  # each with the user frames that called it, the script's top level left out
        ["Net.forward", "/home/u/train.py", 23, 120, [["main", "/home/u/train.py", 52]]],  # via torch
        ["main", "/home/u/train.py", 55, 60, []],  # inside torch's backward: the line that called it
        ["<module>", "/home/u/train.py", 70, 5, []],
    ]


def test_a_helpers_line_comes_with_where_it_was_called_from_most() -> None:
    data = "/usr/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
    fetch = f"{MAIN};main (/home/u/train.py:84);__next__ ({data}:733);Tiles.__getitem__ (/home/u/train.py:63)"
    raw = "\n".join([
        f"{fetch};despeckle (/home/u/train.py:43) 70",
        f"{MAIN};main (/home/u/train.py:99);despeckle (/home/u/train.py:43) 10",  # a rarer caller
        f"{MAIN};main (/home/u/train.py:99);a (/home/u/train.py:5);b (/home/u/train.py:6);"
        "c (/home/u/train.py:7) 3",
    ])  # fmt: skip
    _, lines = collapsed_lines(raw)
    assert lines[0] == [
        "despeckle",
        "/home/u/train.py",
        43,
        80,
        [["Tiles.__getitem__", "/home/u/train.py", 63], ["main", "/home/u/train.py", 84]],
    ]
    assert lines[1][4] == [  # three callers at most
        ["b", "/home/u/train.py", 6],
        ["a", "/home/u/train.py", 5],
        ["main", "/home/u/train.py", 99],
    ]
    run = _run((500, [[*lines[0][:3], 450, lines[0][4]]]), (500, [["main", "/home/u/train.py", 55, 480, []]]))
    found = straggler_line(run, 1)
    assert found is not None and found["callers"] == ["Tiles.__getitem__() train.py:63", "main() train.py:84"]
    assert line_text(found).endswith(
        "at despeckle() train.py:43 (rank 0: 0 %), called from Tiles.__getitem__() train.py:63, "
        "from main() train.py:84"
    )


def test_a_comprehension_is_not_a_caller_of_its_own() -> None:
    """Held-out set 30: rank 0's evaluation runs the model in a list comprehension; the callers
    kept are the evaluation and the training loop's line that calls it, not the comprehension."""
    raw = (
        f"{MAIN};main (/home/u/train.py:136);portfolio_eval (/home/u/train.py:99);"
        "<listcomp> (/home/u/train.py:99);PDModel.forward (/home/u/train.py:81) 60"
    )
    _, lines = collapsed_lines(raw)
    assert lines[0][4] == [["portfolio_eval", "/home/u/train.py", 99], ["main", "/home/u/train.py", 136]]


def _run(straggler: tuple[int, list], peer: tuple[int, list]) -> Run:
    run = Run([Path(".")], [], {})
    run.profiles = [
        {"straggler": 1, "peer": 0, "seconds": 5.0,
         "ranks": {"1": {"samples": straggler[0], "lines": straggler[1]},
                   "0": {"samples": peer[0], "lines": peer[1]}}}
    ]  # fmt: skip
    return run


def test_the_line_where_the_straggler_spends_more_of_its_time_than_its_peer() -> None:
    sleep = ["Net.forward", "/home/u/train.py", 23, 450]
    wait = ["main", "/home/u/train.py", 55]  # the peer waits in backward for it
    run = _run((500, [sleep, [*wait, 40]]), (500, [[*wait, 480], ["Net.forward", "/home/u/train.py", 24, 5]]))
    found = straggler_line(run, 1)
    assert found is not None and found["where"] == "Net.forward() train.py:23"
    assert (found["share"], found["peer_share"], found["peer"]) == (0.9, 0.0, 0)
    assert straggler_line(run, 0) is None, "the profile is the straggler's"


def test_equal_shares_or_too_few_samples_say_nothing() -> None:
    same = [["Net.forward", "/home/u/train.py", 23, 260], ["main", "/home/u/train.py", 55, 240]]
    close = [["Net.forward", "/home/u/train.py", 23, 245], ["main", "/home/u/train.py", 55, 255]]
    assert straggler_line(_run((500, same), (500, close)), 1) is None, "3 points: sampling noise"
    few = [["Net.forward", "/home/u/train.py", 23, 40]]
    assert straggler_line(_run((49, few), (49, [])), 1) is None, "under 50 samples a rank: no ground"
    assert straggler_line(_run((60, few), (60, [])), 1) is not None, "40 of 60 against none: plain"
    rare = [["Net.forward", "/home/u/train.py", 23, 9]]
    assert straggler_line(_run((60, rare), (6000, [])), 1) is None, "9 samples at a line: no ground"


CHILD = """
import time

def spin():
    end = time.monotonic() + 0.004
    while time.monotonic() < end:
        pass

def nap():
    time.sleep(0.001)

print("ready", flush=True)
while True:
    spin()
    nap()
"""


def test_a_real_profile_of_two_processes_names_their_lines(tmp_path: Path) -> None:
    """py-spy as installed, on two live processes (the same script, as a straggler and its peer
    are): profile.json holds each one's main-thread lines, the spinning one first."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    kids = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        for kid in kids:
            assert kid.stdout is not None and kid.stdout.readline() == "ready\n"
        profile = StragglerProfile(tmp_path, use_pyspy=True, seconds=2.0)
        profile._run(1, 0, {1: kids[0].pid, 0: kids[1].pid}, "a test")
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
    out = json.loads((tmp_path / RunDir.PROFILE).read_text())
    assert (out["straggler"], out["peer"], out["why"]) == (1, 0, "a test")
    for rank in ("0", "1"):
        entry = out["ranks"][rank]
        assert entry["samples"] >= 100, entry
        function, file, line, _, _ = entry["lines"][0]
        assert (function, file) == ("spin", str(script)), entry
        assert CHILD.splitlines()[line - 1].strip().startswith(("while", "pass", "end")), entry


def test_a_py_spy_that_cannot_attach_leaves_its_error_and_no_line(tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(
        "#!/bin/sh\necho 'py-spy> Sampling process' >&2\necho 'Error: Permission denied' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    profile = StragglerProfile(tmp_path, use_pyspy=True, seconds=1.0)
    profile._exe = str(fake)
    profile._run(1, 0, {1: os.getpid(), 0: os.getpid()}, "a test")
    out = json.loads((tmp_path / RunDir.PROFILE).read_text())
    assert out["ranks"]["1"] == {"samples": 0, "lines": [], "error": "Error: Permission denied"}
    run = Run([tmp_path], [], {})
    run.profiles = [out]
    assert straggler_line(run, 1) is None


def test_rank_only_work_every_n_steps_is_placed_at_the_loop_line_its_samples_hang_off() -> None:
    """A rank the others waited for every 9th step was sampled while they waited: the periodic
    finding names the training loop's line the work hangs off (its outermost sampled frame), and
    where its time goes."""
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.trace.simulate import Slowdown, simulate_run

    run = simulate_run(world=2, steps=40, slow=Slowdown(1, "backward", 40.0, {6, 15, 24, 33}))
    chain = [["validate", "/home/u/train.py", 90], ["main", "/home/u/train.py", 140]]
    run.profiles = [
        {"straggler": 1, "peer": 0, "seconds": 5.0,
         "ranks": {"1": {"samples": 500, "lines": [["Net.forward", "/home/u/train.py", 23, 300, chain]]},
                   "0": {"samples": 500, "lines": [["main", "/home/u/train.py", 120, 450, []]]}}}
    ]  # fmt: skip
    (f,) = [f for f in diagnose(run).findings if f.kind == "periodic_rank_work"]
    assert f.details["place"] == "train.py:140" and "(at main() train.py:140)" in f.summary, f.summary
    assert f.fix.startswith("Start at main() train.py:140: its time goes to Net.forward() train.py:23.")
    run.profiles = []
    (f,) = [f for f in diagnose(run).findings if f.kind == "periodic_rank_work"]
    assert f.details["place"] is None and "(logging, metrics" in f.summary
