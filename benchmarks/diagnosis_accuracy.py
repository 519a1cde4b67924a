"""Is the diagnosis right on the pathology zoo? Every case is a small real job (tests/zoo/*.py,
or another folder of such scripts with ``--zoo``, e.g. new held-out cases) run under the
real CLI, 2 ranks with gloo, then judged against the expectation declared in the script itself
(its module-level ``EXPECT``):

    EXPECT = {"kind": ..., "rank": R or None, "fix": "keyword", "options": [ddpdoctor run options]}
    EXPECT = None   # a healthy twin: no warning and no error may be reported

A case is right when the most severe level of findings reported holds one of the expected kind
that names the expected root rank (``details.root_rank``, or the finding's only rank), says where
in the script it happened (``script.py:LINE`` for a line marked ``# zoo: place``, when the script
marks any) and whose fix mentions the keyword. The table is what docs/diagnosis.md keeps.

Where the finding's kind is the tool's own business but the facts are not (the held-out cases),
an ``EXPECT`` may say more (case-insensitive; every key optional):

    "kind": None or ["a", "b"]      # any kind, or any of these
    "fix": ["k1", "k2"]             # the fix mentions one of these keywords
    "names": ["fn", ["A", "B"]]     # the finding's text holds each item (a list: one of them)
    "never": ["skipped the barrier"]  # no warning or error says this (a template given
                                    # where its facts do not hold)

    python benchmarks/diagnosis_accuracy.py [--jobs 2] [--only uneven,lightning] [--json out.json]
    python benchmarks/diagnosis_accuracy.py --zoo DIR   # score another folder of cases
    python benchmarks/diagnosis_accuracy.py --keep runs/      # keep every case's run directory
    python benchmarks/diagnosis_accuracy.py --rejudge runs/   # diagnose kept runs again, no jobs
    python benchmarks/diagnosis_accuracy.py --nodes 2   # each rank on its own node (see below)

``--nodes 2`` runs every plain-DDP case as a two-node job on this machine: two launchers,
``torchrun --nnodes 2 --node_rank K --nproc_per_node 1 --master_addr 127.0.0.1``, each under
its own ``ddpdoctor run --out nK``, then ``diagnose n0 n1``: the verdict has to come from
what both nodes recorded (the framework cases pick their own topology and are left out).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ZOO = REPO / "tests" / "zoo"
PLACE_MARK = "# zoo: place"
JOB_TIMEOUT_S = 240
LINGER_S = 20.0  # --nodes: a node still running this long after another ended is interrupted


@dataclass
class Case:
    name: str
    script: Path
    expect: dict[str, Any] | None
    places: list[str] = field(default_factory=list)  # "script.py:LINE" for each marked line

    @property
    def framework(self) -> str:
        for prefix in ("lightning", "accelerate"):
            if self.name.startswith(prefix):
                return prefix
        return "ddp"


@dataclass
class Result:
    case: Case
    right: bool
    why: str
    got: str
    exit_code: int | None
    seconds: float


def load_cases(only: list[str] | None = None, zoo: Path = ZOO) -> list[Case]:
    """Every zoo script with its EXPECT (read with ast: the scripts are not imported here)."""
    cases = []
    for script in sorted(zoo.glob("*.py")):
        if script.name.startswith("_"):
            continue
        if only and not any(word in script.stem for word in only):
            continue
        source = script.read_text(encoding="utf-8")
        expect: Any = "missing"
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EXPECT" for t in node.targets
            ):
                expect = ast.literal_eval(node.value)
        if expect == "missing":
            raise ValueError(f"{script} declares no EXPECT")
        places = [f"{script.name}:{n}" for n, line in enumerate(source.splitlines(), 1) if PLACE_MARK in line]
        cases.append(Case(script.stem, script, expect, places))
    return cases


CODE = [REPO]  # the ddpdoctor checkout that runs and diagnoses (--code: a baseline's)
NODES = [1]  # --nodes: one launcher per node, one rank per node when more than one


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CODE[0]), env.get("PYTHONPATH")]))
    env.pop("DDPDOCTOR_RUN_DIR", None)
    return env


def run_case(case: Case, workdir: Path) -> tuple[dict[str, Any] | None, int | None, str]:
    """Run the case under `ddpdoctor run`, then `diagnose --json`: (diagnosis, exit code, error)."""
    if NODES[0] > 1:
        return _run_nodes(case, workdir, NODES[0])
    run_dir = workdir / "run"
    options = list((case.expect or {}).get("options") or [])
    command = [
        sys.executable, "-m", "ddpdoctor", "run", "--out", str(run_dir), *options, "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(case.script),
    ]  # fmt: skip
    env = job_env()
    try:
        job = subprocess.run(
            command, cwd=workdir, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        return None, None, f"the job ran past {JOB_TIMEOUT_S} s"
    (workdir / "job.out").write_text(job.stdout + "\n----\n" + job.stderr, encoding="utf-8")
    diag, error = diagnose_json(run_dir, env)
    return diag, job.returncode, error


def _run_nodes(case: Case, workdir: Path, nodes: int) -> tuple[dict[str, Any] | None, int | None, str]:
    """One launcher per node, each under its own `ddpdoctor run --out nK`, as on a cluster;
    the job's exit code is the first node's that is not 0 (0 when every node's is). A node
    that outlives another by LINGER_S is interrupted (SIGINT, which the doctor forwards)."""
    options = list((case.expect or {}).get("options") or [])
    with socket.socket() as probe:  # a free port for the rendezvous (released before use)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = job_env()
    procs = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "ddpdoctor", "run", "--out", str(workdir / f"n{node}"), *options, "--",
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", str(case.script),
        ]  # fmt: skip
        out = open(workdir / f"job-n{node}.out", "w", encoding="utf-8")  # noqa: SIM115
        procs.append((subprocess.Popen(command, cwd=workdir, stdout=out, stderr=out, env=env), out))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    first_end: float | None = None
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
        if first_end is None and any(p.poll() is not None for p, _ in procs):
            first_end = time.monotonic()
        if first_end is not None and time.monotonic() - first_end > LINGER_S:
            # torchrun's exit barrier keeps a node whose ranks succeeded for 300 s when another
            # node failed: interrupt it, as its user would (Ctrl-C), once the doctor said so.
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            first_end = float("inf")
    codes: list[int | None] = []
    for proc, out in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        out.close()
    if time.monotonic() > deadline:
        return None, None, f"the job ran past {JOB_TIMEOUT_S} s"
    diag, error = diagnose_json([workdir / f"n{node}" for node in range(nodes)], env)
    return diag, next((c for c in codes if c), 0), error


def run_dirs(kept: Path) -> list[Path]:
    """A kept case's run directories: ``run``, or one ``nK`` per node."""
    nodes = sorted(kept.glob("n[0-9]*"), key=lambda p: int(p.name[1:]))
    return [p for p in nodes if p.is_dir()] or [kept / "run"]


def diagnose_json(run_dir: Path | list[Path], env: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """`ddpdoctor diagnose --json RUN_DIR...`: (the object, or None and why)."""
    dirs = [str(d) for d in (run_dir if isinstance(run_dir, list) else [run_dir])]
    diag = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "diagnose", "--json", *dirs],
        cwd=CODE[0],  # `python -m` looks in the working directory first
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    try:
        return json.loads(diag.stdout), ""
    except json.JSONDecodeError:
        tail = (diag.stderr or diag.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return None, f"diagnose --json printed no JSON (exit {diag.returncode}): {tail[0]}"


def _root(finding: dict[str, Any]) -> int | None:
    root = (finding.get("details") or {}).get("root_rank")
    if isinstance(root, int):
        return root
    ranks = finding.get("ranks") or []
    return ranks[0] if len(ranks) == 1 else None


def judge(case: Case, diag: dict[str, Any]) -> tuple[bool, str, str]:
    """(right?, why not, what was found in short)."""
    loud = [f for f in diag.get("findings", []) if f.get("severity") in ("error", "warning")]
    got = ", ".join(f"{f['kind']}{f.get('ranks')}" for f in loud) or "nothing"
    if case.expect is None:
        return (not loud), ("healthy twin got " + got if loud else ""), got
    top = [f for f in loud if f["severity"] == loud[0]["severity"]] if loud else []
    want = case.expect
    kinds = _alternatives(want["kind"])
    same_kind = [f for f in top if not kinds or f["kind"] in kinds]
    if not same_kind:
        return False, f"expected {expected_text(case)}, most severe: {got}", got
    said = [w for w in want.get("never") or [] if any(w.lower() in json.dumps(f).lower() for f in loud)]
    misses = []
    for f in same_kind:
        miss = []
        if want.get("rank") is not None and _root(f) != want["rank"]:
            miss.append(f"root rank {_root(f)} != {want['rank']}")
        text = json.dumps(f)
        if case.places and not any(p in text for p in case.places):
            miss.append(f"no place ({' or '.join(case.places)})")
        fixes = _alternatives(want.get("fix"))
        if fixes and not _mentions(str(f.get("fix", "")), fixes):
            miss.append(f"fix lacks {' or '.join(map(repr, fixes))}")
        for name in want.get("names") or []:
            if not _mentions(text, _alternatives(name)):
                miss.append(f"does not name {' or '.join(map(repr, _alternatives(name)))}")
        miss += [f"says {w!r}" for w in said]
        if not miss:
            return True, "", got
        misses.append("; ".join(miss))
    return False, misses[0], got


def _alternatives(value: str | list[str] | None) -> list[str]:
    """An EXPECT entry that is one string, a list of acceptable ones, or None (anything)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _mentions(text: str, words: list[str]) -> bool:
    return any(w.lower() in text.lower() for w in words)


def rejudge(case: Case, kept: Path) -> Result:
    """Judge a kept run again with today's analysis (no job is run)."""
    t0 = time.monotonic()
    diag, error = diagnose_json(run_dirs(kept / case.name), job_env())
    if diag is None:
        return Result(case, False, error, "-", None, time.monotonic() - t0)
    right, why, got = judge(case, diag)
    return Result(case, right, why, got, diag.get("run", {}).get("exit_code"), time.monotonic() - t0)


def evaluate(case: Case, keep: Path | None = None) -> Result:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{case.name}-") as tmp:
        workdir = Path(tmp)
        diag, code, error = run_case(case, workdir)
        if keep is not None:
            target = keep / case.name
            subprocess.run(["rm", "-rf", str(target)], check=False)
            subprocess.run(["cp", "-r", tmp, str(target)], check=False)
    seconds = time.monotonic() - t0
    if diag is None:
        return Result(case, False, error, "-", code, seconds)
    right, why, got = judge(case, diag)
    return Result(case, right, why, got, code, seconds)


def expected_text(case: Case) -> str:
    if case.expect is None:
        return "healthy"
    rank = case.expect.get("rank")
    kind = " or ".join(_alternatives(case.expect["kind"])) or "any kind"
    return kind + (f" (rank {rank})" if rank is not None else "")


def table(results: list[Result]) -> str:
    lines = [
        "| case | framework | expected | right | why not |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r.case.framework, r.case.name)):
        why = r.why.replace("|", "/")[:140]
        lines.append(
            f"| {r.case.name} | {r.case.framework} | {expected_text(r.case)} | "
            f"{'yes' if r.right else 'NO'} | {why} |"
        )
    right = sum(r.right for r in results)
    sick = [r for r in results if r.case.expect is not None]
    healthy = [r for r in results if r.case.expect is None]
    lines.append("")
    lines.append(
        f"accuracy: {right}/{len(results)} ({100 * right / max(len(results), 1):.0f} %); "
        f"pathologies {sum(r.right for r in sick)}/{len(sick)}, "
        f"healthy twins clean {sum(r.right for r in healthy)}/{len(healthy)}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--keep", default="", help="copy each case's run directory and output here")
    parser.add_argument("--rejudge", default="", help="diagnose the runs kept here again instead")
    parser.add_argument("--code", default="", help="diagnose with the ddpdoctor checkout here instead")
    parser.add_argument("--zoo", default=str(ZOO), help="the folder of cases (default tests/zoo)")
    parser.add_argument("--nodes", type=int, default=1, help="launchers (nodes), one rank on each")
    args = parser.parse_args()
    if args.code:
        CODE[0] = Path(args.code).resolve()
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    NODES[0] = args.nodes
    cases = load_cases([w for w in args.only.split(",") if w] or None, Path(args.zoo).resolve())
    if args.nodes > 1:  # the framework cases choose their own devices and nodes
        cases = [c for c in cases if c.framework == "ddp"]
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        if args.rejudge:
            kept = Path(args.rejudge)
            results = list(
                pool.map(lambda c: rejudge(c, kept), [c for c in cases if (kept / c.name).is_dir()])
            )
        else:
            results = list(pool.map(lambda c: evaluate(c, keep), cases))
    for r in results:
        print(
            f"{r.case.name}: {'right' if r.right else 'WRONG'} in {r.seconds:.0f} s, exit "
            f"{r.exit_code}; found {r.got}" + (f"; {r.why}" if r.why else ""),
            file=sys.stderr,
        )
    print(table(results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {"case": r.case.name, "right": r.right, "why": r.why, "got": r.got,
                     "exit_code": r.exit_code, "seconds": round(r.seconds, 1)}
                    for r in results
                ],
                indent=2,
            ),
            encoding="utf-8",
        )  # fmt: skip
    sys.exit(0 if all(r.right for r in results) else 1)


if __name__ == "__main__":
    main()
