"""Is the job hung, slow, or fine? A pure judgement over one look at every rank.

Three states matter to a user, and each is decided from facts the ranks publish
(``status-rank{R}.json``: phase, op, bytes, group, sequence number) plus what the supervisor
measured about each process (alive, seconds since its CPU time or stack last moved):

* **proven**: every live rank is blocked in a sync point and they cannot all complete: ranks of
  one group disagree on any part of a collective's signature at one sequence number (op, dtype,
  size, root, members: ``signature.py``), wait at different sequence
  numbers, or a member of the group has left. No timeout needs to pass: the job cannot go on.
* **stalled**: a rank outside every sync point makes no progress while others wait. It may
  still be a slow syscall, so this becomes a hang only once the threshold passes.
* **busy**: the rank the others wait for is progressing (evaluation, a checkpoint, logging).
  Not a hang; the watcher keeps a note of who waits on whom.

Transient disagreements are real: a rank that finished collective #n may already wait in #n+1
while its peer has not yet returned from #n. So a rank counts as blocked only after
``CONFIRM_S`` in its sync point on a fresh status, long past any such overlap.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpdoctor.analysis.failed.signature import disagreement
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase

CONFIRM_S = 1.5  # in one sync point this long on a fresh status: blocked, not passing through
STALE_S = 2.0  # a status older than this says nothing about now
BUSY_S = 3.0  # CPU time or stack moved within this many seconds: the rank is progressing
# One collective call: the rank waits in exactly this op at exactly this sequence number.
ATOMIC = frozenset(p.value for p in LivePhase if p.waits == "atomic")
# DDP's own forward/backward and its constructor (the shape check's all_gather, the state
# broadcast, the reducer's set-up): entered at sequence number n, they may issue #n, #n+1, ...;
# they wait only when their CPU is idle, and compute otherwise.
COMPOUND = frozenset(p.value for p in LivePhase if p.waits == "compound")
SYNC = SYNC_LIVE_PHASES
# Ops whose per-rank arguments legitimately differ in size (objects, splits, roots) or that are
# not group collectives at all (point to point): never used to prove a size or order mismatch.
_NO_PROOF_OPS = frozenset(
    {
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "monitored_barrier",
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
    }
)


@dataclass(frozen=True)
class Activity:
    """What the supervisor measured about one rank's process (not what the rank said)."""

    alive: bool = True
    idle_s: float | None = None  # seconds since its CPU time or stack last moved; None: unknown
    cpu_rate: float | None = None  # CPU seconds per second over the recent window
    frame: str | None = None  # its innermost user frame, "evaluate() train.py:27"
    # Measurement has begun and its first window is not over: idle_s is unknown for a second,
    # not unknowable, so the clock must not decide in its place.
    pending: bool = False
    # Its stack: inside a DDP pass, in the user's own code there (stacktext.runs_own_code).
    own_code: bool = False


class VerdictState(enum.StrEnum):
    """The state of the job at one look (its value is what watch.json and the store carry)."""

    RUNNING = "running"  # nothing waits, or nothing can be said yet
    PROVEN = "proven"  # the ranks can never all return: a hang now, no threshold needed
    STALLED = "stalled"  # ranks wait for one that makes no progress outside any sync point
    BUSY = "busy"  # ranks wait for one that progresses: a wait, not a hang
    BLOCKED = "blocked"  # every live rank waits at one consistent point: the threshold decides
    QUIET = "quiet"  # no rank waits and none makes progress
    UNMEASURED = "unmeasured"  # the ranks the others wait for were not measured: the clock decides


@dataclass
class Verdict:
    state: VerdictState
    proof: str = ""  # the sentence that proves or explains the state
    culprits: list[int] = field(default_factory=list)  # the ranks the others wait on
    waiting: list[int] = field(default_factory=list)  # ranks blocked in a sync point
    wait_s: float = 0.0  # the longest of their waits
    idle_s: float = 0.0  # stalled: how long the culprit has not moved
    where: dict[int, str] = field(default_factory=dict)  # rank -> "barrier #15", "evaluate() ..."
    phases: dict[int, dict[str, Any]] = field(default_factory=dict)  # the waiting ranks' phases
    rank_only: bool = False  # busy: a culprit works outside every sync point (not a slow step)

    def __post_init__(self) -> None:
        self.state = VerdictState(self.state)  # "busy" as given by a caller is VerdictState.BUSY

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "proof": self.proof,
            "culprits": self.culprits,
            "waiting": self.waiting,
            "wait_s": round(self.wait_s, 3),
            "idle_s": round(self.idle_s, 3),
            "where": {str(r): w for r, w in sorted(self.where.items())},
            "phases": {str(r): p for r, p in sorted(self.phases.items())},
            "rank_only": self.rank_only,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Verdict:
        """The verdict as another node's watcher wrote it (supervisor/board.py)."""
        return cls(
            _state(d.get("state")),
            str(d.get("proof") or ""),
            [int(r) for r in d.get("culprits") or []],
            [int(r) for r in d.get("waiting") or []],
            float(d.get("wait_s") or 0.0),
            float(d.get("idle_s") or 0.0),
            {int(r): str(w) for r, w in (d.get("where") or {}).items()},
            {int(r): p for r, p in (d.get("phases") or {}).items()},
            bool(d.get("rank_only")),
        )

    @property
    def proof_line(self) -> str:
        """The line a hang report prints for this verdict: the proof, or whom the ranks wait on."""
        if self.state is VerdictState.PROVEN:
            return self.proof
        if self.state is VerdictState.BUSY:
            return f"busy: {self.proof}"
        return ""


def _state(value: Any) -> VerdictState:
    try:
        return VerdictState(value or VerdictState.RUNNING)
    except ValueError:
        return VerdictState.RUNNING  # a state a newer ddpdoctor wrote: nothing proven here


def is_hang(
    verdict: Verdict,
    threshold: float,
    *,
    hang_timeout: float | None,
    longest: float,
    quiet: float,
    started: bool,
) -> bool:
    """The one live rule (the watcher, `top`, `attach`): proven now; stalled or blocked past the
    threshold; busy only past an explicit ``--hang-timeout``; unmeasured by the clock alone."""
    state = verdict.state
    if state is VerdictState.PROVEN:
        return True
    if state in (VerdictState.STALLED, VerdictState.QUIET):
        return verdict.idle_s >= threshold
    if state is VerdictState.BUSY:
        return hang_timeout is not None and verdict.wait_s >= hang_timeout
    if state is VerdictState.BLOCKED:
        return verdict.wait_s >= threshold
    if state is VerdictState.UNMEASURED:  # no /proc, no stack: the wait alone decides
        return longest > threshold or (started and quiet > threshold)
    return False


def op_label(phase: dict[str, Any]) -> str:
    """The op ranks in this phase meet in: "broadcast" (DDP's buffers), "allreduce" (its
    gradient buckets and the unused-parameter map), "DDP forward", or the collective's own."""
    live = LivePhase.of(phase.get("name"))
    if live is not None and live is not LivePhase.COLLECTIVE:
        return live.op or live.label
    return str(phase.get("op"))


def point(phase: dict[str, Any]) -> str:
    """'barrier #15', 'broadcast #67 (DDP buffers)', 'allreduce #40.. (DDP backward)'."""
    seq = phase.get("seq", -1)
    name = phase.get("name")
    if name == LivePhase.SYNC_BUFFERS:
        return f"{op_label(phase)} #{seq} (DDP buffers)"
    if name == LivePhase.DDP_INIT:
        return f"{op_label(phase)} #{seq}.."
    if name in COMPOUND:
        return f"{op_label(phase)} #{seq}.. (DDP {name})"
    return f"{phase.get('op')} #{seq}"


def _members(phase: dict[str, Any], world: set[int]) -> set[int]:
    ranks = phase.get("group_ranks")
    return set(int(r) for r in ranks) if isinstance(ranks, list) else set(world)


def judge(
    statuses: Mapping[int, RankStatus | Mapping[str, Any]],
    activity: dict[int, Activity],
    now: float,
    world_size: int | None = None,
) -> Verdict:
    """One look at every rank -> the state of the job. Pure: no clock, no files, no processes.
    The statuses as read, or as JSON (a hang summary's, a test's)."""
    statuses = {r: RankStatus.of(s) for r, s in statuses.items()}
    world = set(range(world_size)) if world_size else set(statuses)
    acts = {r: activity.get(r, Activity()) for r in statuses}
    gone = {r for r, st in statuses.items() if not acts[r].alive or st.exited}
    live = {r: st for r, st in statuses.items() if r not in gone}
    never = sorted(world - set(statuses))  # no status, here or from any node's doctor
    waits: dict[int, dict[str, Any]] = {}
    where: dict[int, str] = {}
    for r, st in live.items():
        phase = st.phase or {}
        if phase.get("name") not in SYNC:
            continue
        fresh = now - (st.heartbeat_wall or 0.0) <= STALE_S
        settled = st.in_phase_s(now) >= CONFIRM_S
        idle = acts[r].idle_s
        idle_wait = idle is not None and idle >= CONFIRM_S and not acts[r].own_code
        if fresh and settled and (phase["name"] in ATOMIC or idle_wait):
            waits[r] = phase
            where[r] = point(phase)
    wait_s = max((live[r].in_phase_s(now) for r in waits), default=0.0)
    others = sorted(set(live) - set(waits))
    if never:
        # Nothing can be proven about a rank never heard from (its node lost before its doctor
        # first reported, or no doctor there). If every rank heard from waits, the silent ones
        # are what they wait for, and the clock decides, as for any rank not measured.
        if not waits or others:
            return Verdict(VerdictState.RUNNING)
        text = (
            f"rank(s) {rank_list(never)} never reported (no status from them nor from their node's "
            f"doctor) while rank(s) {rank_list(sorted(waits))} wait in {_same_point(waits)}"
        )
        where.update({r: "never reported" for r in never})
        return Verdict(VerdictState.UNMEASURED, text, never, sorted(waits), wait_s, 0.0, where, waits)
    if waits and not others:
        proven = _prove(waits, gone, statuses, world)
        if proven is not None:
            text, culprits = proven
            return Verdict(VerdictState.PROVEN, text, culprits, sorted(waits), wait_s, 0.0, where, waits)
        if _passed_by_the_gone(waits, gone, statuses):
            return Verdict(VerdictState.RUNNING, waiting=sorted(waits), wait_s=wait_s, where=where)
        return Verdict(
            VerdictState.BLOCKED,
            f"every live rank waits in {_same_point(waits)}: nothing on record says why",
            sorted(live),
            sorted(waits),
            wait_s,
            0.0,
            where,
            waits,
        )
    if not others:
        return Verdict(VerdictState.RUNNING)
    moving = [r for r in others if acts[r].idle_s is not None and acts[r].idle_s < BUSY_S]
    stalled = [r for r in others if acts[r].idle_s is not None and acts[r].idle_s >= BUSY_S]
    for r in others:
        where[r] = acts[r].frame or _outside(live[r])
    if waits and stalled:
        idle = min(float(acts[r].idle_s or 0.0) for r in stalled)
        culprit = stalled[0]
        place = "outside any sync point"
        if acts[culprit].own_code:
            place = f"in its own code inside its DDP {(live[culprit].phase or {}).get('name')}"
        text = (
            f"rank {culprit} makes no progress {place} ({where[culprit]}) while "
            f"rank(s) {rank_list(sorted(waits))} wait in {_same_point(waits)}"
        )
        return Verdict(VerdictState.STALLED, text, stalled, sorted(waits), wait_s, idle, where, waits)
    if waits and moving:
        busy = ", ".join(f"rank {r} in {where[r]}" for r in moving)
        text = f"rank(s) {rank_list(sorted(waits))} wait in {_same_point(waits)} for busy {busy}"
        alone = any(not live[r].in_sync for r in moving)
        return Verdict(VerdictState.BUSY, text, moving, sorted(waits), wait_s, 0.0, where, waits, alone)
    if not waits and stalled and len(stalled) == len(others):
        idle = min(float(acts[r].idle_s or 0.0) for r in stalled)
        text = f"no rank makes progress: rank(s) {rank_list(stalled)} idle outside any sync point"
        return Verdict(VerdictState.QUIET, text, stalled, [], 0.0, idle, where)
    unknown = [r for r in others if acts[r].idle_s is None]
    if unknown and not moving and not any(acts[r].pending for r in unknown):
        # Nothing measured about the ranks that do not wait: only the clock can decide.
        text = f"rank(s) {rank_list(unknown)} not measured"
        return Verdict(VerdictState.UNMEASURED, text, unknown, sorted(waits), wait_s, 0.0, where, waits)
    return Verdict(VerdictState.RUNNING, waiting=sorted(waits), wait_s=wait_s, where=where, phases=waits)


def _outside(status: RankStatus) -> str:
    phase = status.phase or {}
    if phase.get("name") == LivePhase.DATA:
        return "DataLoader.__next__"
    if phase.get("name") in COMPOUND:
        return point(phase)
    if status.step < 0:
        return "user code before step 0"
    return f"user code after step {status.step}"


def _same_point(waits: dict[int, dict[str, Any]]) -> str:
    points = sorted({point(p) for p in waits.values()})
    return points[0] if len(points) == 1 else ", ".join(points)


def _passed_by_the_gone(
    waits: dict[int, dict[str, Any]], gone: set[int], statuses: dict[int, RankStatus]
) -> bool:
    """A rank that exited after issuing the world collective the live ones still show: their
    statuses (written four times a second) are older than their wait's end, as at the close of
    a job whose last rank finished first; not a hang of every live rank."""
    return any(statuses[d].exited and _issued(statuses[d], phase) for phase in waits.values() for d in gone)


def _issued(final: RankStatus, phase: dict[str, Any]) -> bool:
    """Did a rank that left issue the world collective ``phase`` waits in before it left? Then
    that wait may still end: nothing is proven by its leaving."""
    return str(phase.get("group") or "WORLD") == "WORLD" and final.seq > int(phase.get("seq", -1)) >= 0


def _prove(
    waits: dict[int, dict[str, Any]],
    gone: set[int],
    statuses: dict[int, RankStatus],
    world: set[int],
) -> tuple[str, list[int]] | None:
    """The sentence that proves every blocked rank can never return, and whom it blames."""
    provable = {r: p for r, p in waits.items() if p.get("op") not in _NO_PROOF_OPS}
    if gone:
        members_of: dict[str, set[int]] = {}
        for _r, phase in sorted(waits.items()):
            key = str(phase.get("group") or "WORLD")
            members = members_of.setdefault(key, _members(phase, world))
            for d in sorted(members & gone):
                final = statuses[d]
                if _issued(final, phase):
                    continue
                how = "exited" if final.exited else "died"
                if final.lost:  # its node stopped reporting (supervisor/board.py)
                    how = f"was lost with {final.lost}"
                who = sorted(w for w, q in waits.items() if str(q.get("group") or "WORLD") == key)
                return (
                    f"rank {d} {how} (after step {final.step}) while rank(s) {rank_list(who)} "
                    f"wait in {point(phase)}, a collective of its group it can no longer join",
                    [d],
                )
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for r, phase in provable.items():
        groups.setdefault(str(phase.get("group") or "WORLD"), {})[r] = phase
    for gname, members in sorted(groups.items()):
        label = "" if gname == "WORLD" else f" of group {gname}"
        top = max(int(q.get("seq", -1)) for q in members.values())
        atomic = {r: int(p.get("seq", -1)) for r, p in members.items() if p.get("name") in ATOMIC}
        behind = [q for q in atomic.values() if 0 <= q < top]
        if behind:
            low = min(behind)
            lows = sorted(r for r, q in atomic.items() if q == low)
            ahead = sorted(r for r, q in members.items() if int(q.get("seq", -1)) > low)
            return (
                f"ranks{label} wait at different collectives: rank(s) {rank_list(lows)} in "
                f"{point(members[lows[0]])}, rank(s) {rank_list(ahead)} already past it in "
                f"{point(members[ahead[0]])}",
                lows,
            )
        by_seq: dict[int, dict[int, dict[str, Any]]] = {}
        for r, p in members.items():
            if p.get("name") != "forward":  # DDP forward: which collective it waits in is unknown
                by_seq.setdefault(int(p.get("seq", -1)), {})[r] = p
        for seq, at in sorted(by_seq.items()):
            if seq < 0 or len(at) < 2:
                continue
            differ = disagreement(at, op_label, f"collective #{seq}{label}")
            if differ is not None:
                return differ.text, differ.minority
    return None
