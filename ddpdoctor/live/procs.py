"""The ranks of a job on this node, found from /proc, and whether we may read their stacks.

torchrun (and ``python -m torch.distributed.run``, the legacy launcher) gives every worker
RANK, LOCAL_RANK and WORLD_SIZE in its environment; a DataLoader worker or any other child
of a rank inherits them, so a rank is the topmost process carrying its RANK. ``mp.spawn``
sets no environment: its children run ``multiprocessing.spawn`` and are ranked in start
order (the order mp.spawn starts them), which the report says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

CAP_SYS_PTRACE = 19
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


@dataclass
class Proc:
    pid: int
    ppid: int
    uid: int
    cmdline: list[str]
    env: dict[str, str] = field(default_factory=dict)
    env_error: str = ""


@dataclass
class RankProc:
    rank: int
    pid: int
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    cmdline: list[str]
    ranked_by: str  # "environment" or "spawn order"


def read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except (OSError, ValueError, IndexError):
        return None
    proc = Proc(pid, ppid, uid, cmdline)
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            for item in fh.read().split(b"\0"):
                key, sep, value = item.partition(b"=")
                if sep:
                    proc.env[key.decode(errors="replace")] = value.decode(errors="replace")
    except OSError as exc:
        proc.env_error = exc.strerror or str(exc)
    return proc


def all_procs() -> dict[int, Proc]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                out[proc.pid] = proc
    return out


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None


def _descendants(root: int, procs: dict[int, Proc]) -> list[Proc]:
    children: dict[int, list[Proc]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], [root]
    while todo:
        for child in sorted(children.get(todo.pop(), []), key=lambda p: p.pid):
            out.append(child)
            todo.append(child.pid)
    return out


def _is_spawn_child(proc: Proc) -> bool:
    return any("multiprocessing.spawn" in a or "multiprocessing.forkserver" in a for a in proc.cmdline)


def find_ranks(pid: int, procs: dict[int, Proc] | None = None) -> tuple[int, list[RankProc]]:
    """(the launcher's pid, the ranks on this node) for a launcher's or any rank's ``pid``."""
    procs = all_procs() if procs is None else procs
    if pid not in procs:
        raise LookupError(f"no process {pid}")
    root = procs[pid]
    if "RANK" not in root.env and _is_spawn_child(root) and root.ppid in procs:
        root = procs[root.ppid]  # one of mp.spawn's children: its parent holds them all
    while "RANK" in root.env and root.ppid in procs and root.ppid > 1:
        parent = procs[root.ppid]
        if "RANK" in parent.env and parent.env.get("RANK") != root.env.get("RANK"):
            break  # a launcher started from inside another rank: stop at this job
        root = parent
    if "RANK" in root.env:  # nothing above it: a lone rank (e.g. started by hand)
        return root.pid, [_rank(root, "environment")]
    below = _descendants(root.pid, procs)
    by_pid = {p.pid: p for p in below}
    ranks = [
        _rank(p, "environment")
        for p in below
        if "RANK" in p.env and by_pid.get(p.ppid, root).env.get("RANK") != p.env["RANK"]
    ]
    if not ranks:  # mp.spawn: the parent's direct spawn children, in start order
        spawned = [p for p in below if p.ppid == root.pid and _is_spawn_child(p)]
        ranks = [_rank(p, "spawn order", index) for index, p in enumerate(spawned)]
    return root.pid, sorted(ranks, key=lambda r: r.rank)


def _rank(proc: Proc, how: str, index: int | None = None) -> RankProc:
    env = proc.env
    rank = _int(env.get("RANK")) if index is None else index
    return RankProc(
        rank=rank if rank is not None else -1,
        pid=proc.pid,
        local_rank=_int(env.get("LOCAL_RANK")) if index is None else index,
        world_size=_int(env.get("WORLD_SIZE")),
        local_world_size=_int(env.get("LOCAL_WORLD_SIZE")),
        cmdline=proc.cmdline,
        ranked_by=how,
    )


def _capabilities() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def ptrace_scope() -> int | None:
    try:
        with open(YAMA, encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: the classic rule (same user, or CAP_SYS_PTRACE)


def ptrace_problem(
    target_uid: int,
    *,
    scope: int | None = -1,
    caps: int | None = None,
    uid: int | None = None,
    is_child: bool = False,
) -> str:
    """Why we cannot ptrace a process of ``target_uid`` (what is missing), or "" if we can."""
    scope = ptrace_scope() if scope == -1 else scope
    caps = _capabilities() if caps is None else caps
    uid = os.geteuid() if uid is None else uid
    has_cap = bool(caps & (1 << CAP_SYS_PTRACE))
    if has_cap and scope != 3:
        return ""
    fix = "run it with sudo (sudo -E env PATH=$PATH ddpdoctor attach ...), or give py-spy CAP_SYS_PTRACE"
    if scope == 3:
        return "kernel.yama.ptrace_scope is 3: no process may ptrace another until reboot"
    if target_uid != uid:
        return f"the job runs as uid {target_uid} and you are uid {uid} without CAP_SYS_PTRACE: {fix}"
    if scope == 2:
        return f"kernel.yama.ptrace_scope is 2: only CAP_SYS_PTRACE may ptrace: {fix}"
    if scope == 1 and not is_child:
        return (
            "kernel.yama.ptrace_scope is 1: only a parent may ptrace its children without "
            f"CAP_SYS_PTRACE: {fix}, or sudo sysctl kernel.yama.ptrace_scope=0"
        )
    return ""
