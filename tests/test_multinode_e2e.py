"""One job, one verdict: two launchers standing for two nodes (``torchrun --nnodes 2
--node_rank K``), each under its own ``ddpdoctor run --out nK``, share their ranks' liveness
through the job's rendezvous store (supervisor/board.py). Every node must see the whole job."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOBS, diagnose_json, free_port, job_env

pytestmark = pytest.mark.e2e

SCRIPT = JOBS / "multinode_train.py"


class Nodes:
    """Two `ddpdoctor run -- torchrun --nnodes 2 --node_rank K` launchers on this machine."""

    def __init__(
        self, tmp: Path, nproc: int, options: list[str], *args: str, doctors: tuple[int, ...] = (0, 1)
    ) -> None:
        self.tmp, self.port = tmp, free_port()
        self.procs: list[subprocess.Popen] = []
        for node in (0, 1):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(self.port),
                str(SCRIPT), *args,
            ]  # fmt: skip
            doctor = [sys.executable, "-m", "ddpdoctor", "run", "--out", f"n{node}", *options, "--", *command]
            if node not in doctors:  # launched as is: no doctor on that node
                doctor = command
            with open(tmp / f"n{node}.err", "wb") as err, open(tmp / f"n{node}.out", "wb") as out:
                self.procs.append(subprocess.Popen(doctor, cwd=tmp, stdout=out, stderr=err, env=job_env()))

    def leader_knows(self, node: int) -> bool:
        """The leading doctor has put ``node`` in the job's node map (board.py's layout key): it
        has read that node's report, so it can tell when the node goes silent."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        try:
            store = TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=5))
            key = "ddpdoctor/v1/layout"
            return bool(store.check([key])) and str(node) in json.loads(store.get(key))
        except Exception:  # the store not up yet, or gone
            return False

    def wait(self, timeout: float = 240) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def err(self, node: int) -> str:
        return (self.tmp / f"n{node}.err").read_text(errors="replace")

    def dirs(self) -> list[Path]:
        return [self.tmp / "n0", self.tmp / "n1"]

    def kill_node(self, node: int) -> None:
        """Everything of one node at once, as if the machine died: its doctor, its launcher and
        the launcher's workers (each in a session of its own)."""
        tree, frontier = [], [self.procs[node].pid]
        while frontier:
            pid = frontier.pop()
            tree.append(pid)
            for child in Path("/proc").glob("[0-9]*"):
                try:
                    ppid = int((child / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == pid:
                    frontier.append(int(child.name))
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _hang_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("ddpdoctor: HANG"))


def test_eval_trap_one_rank_per_node_is_proven_on_every_node_and_diagnosed_alike(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path, 1, ["--on-hang", "kill"], "--mode", "eval0", "--steps", "20")
    assert nodes.wait() == [124, 124]
    for node in (0, 1):
        err = nodes.err(node)
        line = _hang_line(err)
        assert "ranks disagree on the op of collective" in line, err
        proven = float(re.search(r"proven after ([0-9.]+) s", line).group(1))
        assert proven <= 3.0, line  # as fast as on one node
        assert "<- main() multinode_train.py" in err  # rank 1's barrier, from node 1's stack
        assert re.search(r"node 0 \(.*\): rank 0 .*n0/hang-1/", err) and re.search(
            r"node 1 .*n1/hang-1/", err
        )
        assert "rank_never_started" not in err and "left no record" not in err
    assert (tmp_path / "n0" / "hang-1" / "stack-rank0.txt").exists()
    assert (tmp_path / "n1" / "hang-1" / "stack-rank1.txt").exists()
    # Each node's own diagnosis: the other node's rank is elsewhere, never "never started".
    alone = diagnose_json(tmp_path / "n1")
    kinds = {f["kind"] for f in alone["findings"]}
    assert "rank_never_started" not in kinds and "other_nodes" in kinds and "hang" in kinds
    # The merged diagnosis names the live verdict's root, line and every node's stacks.
    merged = diagnose_json(*nodes.dirs())
    errors = [f for f in merged["findings"] if f["severity"] == "error"]
    assert errors[0]["kind"] == "rank_only_eval" and errors[0]["details"]["root_rank"] == 0
    lines = SCRIPT.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "through the wrapper" in text)
    assert f"multinode_train.py:{line}" in errors[0]["summary"]
    assert [f["kind"] for f in errors].count("hang") == 1, "one job verdict, however many nodes wrote it"
    stacks = merged["failure"]["stacks"]
    assert {r for group in stacks for r in group["ranks"]} == {0, 1}


def test_a_stall_on_one_node_is_a_hang_of_the_job_on_both(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path, 2, ["--on-hang", "kill", "--hang-timeout", "5"], "--mode", "stall", "--at", "8")
    assert nodes.wait() == [124, 124]
    for node in (0, 1):
        err = nodes.err(node)
        _hang_line(err)
        assert "rank 3" in err and "next_batch" in err, err
        assert re.search(r"Rank\(s\) 3 never reached the next collective", err), err
    waiting = json.loads((tmp_path / "n0" / "hang-1" / "summary.json").read_text())
    assert waiting["verdict"]["state"] == "stalled" and waiting["verdict"]["culprits"] == [3]
    merged = diagnose_json(*nodes.dirs())
    loud = [f for f in merged["findings"] if f["severity"] != "info"]
    assert [(f["kind"], f["ranks"]) for f in loud] == [("hang", [3])], loud  # its start is no "work"


def test_a_long_evaluation_on_one_node_is_busy_not_hung(tmp_path: Path) -> None:
    args = ["--mode", "longeval", "--at", "4", "--eval-s", "12", "--steps", "8"]
    nodes = Nodes(tmp_path, 1, ["--hang-timeout", "auto"], *args)
    # `top` on node 1 sees node 0's rank too, and the leading watcher's verdict: busy, not hung.
    frames: list[dict] = []

    def waiting_seen() -> bool:
        # with the busy rank's place: the first looks may come before the leader's first stack
        # sample of it ("in user code after step 4"), a true but vaguer place
        found = frames[-1]["findings"] if frames else []
        return any(f["kind"] == "waiting" and "evaluate" in f["text"] for f in found)

    # Look once rank 0 has reached its evaluation: a look before node 1's run dir exists, or
    # before the evaluation began, uses up the window on a loaded machine (top starts in seconds).
    status = tmp_path / "n0" / "status-rank0.json"
    deadline = time.time() + 120
    while nodes.procs[1].poll() is None and time.time() < deadline:
        try:
            if json.loads(status.read_text()).get("step", -1) >= 4:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    while nodes.procs[1].poll() is None and not waiting_seen():
        top = subprocess.run(
            [sys.executable, "-m", "ddpdoctor", "top", "--once", "--json", str(tmp_path / "n1")],
            capture_output=True, text=True, timeout=60, env=job_env(),
        )  # fmt: skip
        if top.returncode == 0 and top.stdout.strip():
            frames.append(json.loads(top.stdout))
    assert nodes.wait() == [0, 0]
    assert waiting_seen(), frames[-1:]
    seen = frames[-1]
    assert [r["rank"] for r in seen["ranks"]] == [0, 1], seen
    [wait] = [f for f in seen["findings"] if f["kind"] == "waiting"]
    assert wait["ranks"] == [0] and "evaluate" in wait["text"] and "HANG" not in json.dumps(seen)
    for node in (0, 1):
        assert "HANG" not in nodes.err(node)
        watch = json.loads((tmp_path / f"n{node}" / "watch.json").read_text())
        assert watch["waits"] and watch["waits"][0]["busy"] == [0] and watch["waits"][0]["waiting"] == [1]
    merged = diagnose_json(*nodes.dirs())
    work = [f for f in merged["findings"] if f["kind"] == "rank_only_work"]
    assert len(work) == 1 and work[0]["ranks"] == [0]
    assert not [f for f in merged["findings"] if f["severity"] == "error"]


def test_a_lost_node_is_named_by_the_survivors(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path, 1, [], "--steps", "2000", "--step-s", "0.01")
    status = tmp_path / "n1" / "status-rank1.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            # Lost once the leader knew it: a node lost before its doctor ever reported (its board
            # connects in the background, seconds on a loaded machine) leaves nothing to name.
            if json.loads(status.read_text()).get("step", -1) >= 20 and nodes.leader_knows(1):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    else:
        pytest.fail("node 1 never reached step 20 with the leader knowing it")
    nodes.kill_node(1)
    code = nodes.procs[0].wait(timeout=240)
    assert code != 0
    err = nodes.err(0)
    assert "node_lost" in err, err
    said = " ".join(err.split())  # the terminal wraps findings
    assert re.search(r"node 1 \([^)]*rank 1\) last reported its ranks training", said), err
    assert "when rank 0 lost its peers (RuntimeError" in said  # what the survivors saw


def test_a_node_left_in_torchruns_exit_barrier_says_so_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """Node 1's rank fails after training, node 0's exits 0: torchrun keeps node 0's launcher in
    its exit barrier (300 s) for an agent that never comes, and ignores Ctrl-C until then. Node
    0's doctor says so within seconds, with what node 1's rank did, settles its run dir, and
    stops the launcher on Ctrl-C; its own summary blames no rank of its own, and both run dirs
    together name rank 1's error."""
    nodes = Nodes(tmp_path, 1, [], "--mode", "failend", "--steps", "5")
    assert nodes.procs[1].wait(timeout=180) != 0
    deadline = time.time() + 60
    while "every rank on this node has ended" not in nodes.err(0) and time.time() < deadline:
        time.sleep(0.2)
    said = " ".join(nodes.err(0).split())
    assert "every rank on this node has ended (rank 0 exited)" in said, said
    assert "rank 1 (node 1) raised OSError" in said and "exit barrier" in said
    assert (tmp_path / "n0" / "ends.json").is_file()  # settled while the launcher waits
    assert nodes.procs[0].poll() is None  # torchrun still waits: only the doctor spoke
    nodes.procs[0].send_signal(signal.SIGINT)
    code = nodes.procs[0].wait(timeout=30)
    assert code == 128 + signal.SIGKILL, code  # the launcher, stopped; its rank had exited 0
    own = nodes.err(0)
    assert "rank_failure" not in own and "stopped on Ctrl-C" in " ".join(own.split()), own
    diag = diagnose_json(*nodes.dirs())
    top = [f for f in diag["findings"] if f["severity"] == "error"]
    assert top and top[0]["kind"] == "rank_failure" and top[0]["ranks"] == [1], top
    assert "OSError" in top[0]["summary"]


def test_a_node_never_heard_from_is_named_once_every_other_rank_waits(tmp_path: Path) -> None:
    """Node 1 runs without a doctor (as a node lost before its doctor first reported): its
    rank never reports. When rank 0 has waited past the threshold for it, node 0 declares the
    hang and names rank 1 as never reported, instead of watching a silent job for ever."""
    nodes = Nodes(tmp_path, 1, ["--on-hang", "kill", "--hang-timeout", "5"], "--mode", "stall", "--at", "8",
                  doctors=(0,))  # fmt: skip
    try:
        code = nodes.procs[0].wait(timeout=180)
    finally:
        nodes.kill_node(1)
    err = nodes.err(0)
    assert code == 124, err
    _hang_line(err)
    assert re.search(r"Rank\(s\) 1 never reported", " ".join(err.split())), err
    verdict = json.loads((tmp_path / "n0" / "hang-1" / "summary.json").read_text())["verdict"]
    assert verdict["state"] == "unmeasured" and verdict["culprits"] == [1], verdict
    assert verdict["proof"].startswith("rank(s) 1 never reported") and "rank(s) 0 wait in" in verdict["proof"]
