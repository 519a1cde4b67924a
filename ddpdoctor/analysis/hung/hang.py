"""Hangs: from what each rank was doing (status files) and its stack, to a diagnosis and a fix.

Pure: the inputs are the JSON the ranks and the supervisor wrote (``status-rank{R}.json`` and
the stack dumps kept in ``hang-N/summary.json``), so the same function serves the live report
of `ddpdoctor run` and `diagnose` afterwards, and unit tests feed it synthetic dicts.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ddpdoctor.analysis.failed.signature import NEW_GROUP, disagreement, fix_for
from ddpdoctor.analysis.findings import Finding, rank_list
from ddpdoctor.analysis.hung.proof import Verdict, op_label
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase
from ddpdoctor.trace.stacktext import is_user_frame

# A DDP forward, with or without its buffer broadcast: a pass every rank must run.
_DDP_FORWARD = frozenset({LivePhase.FORWARD.value, LivePhase.SYNC_BUFFERS.value})

Frame = dict[str, Any]  # {"file", "line", "function"}


def main_thread(threads: list[dict[str, Any]]) -> list[Frame]:
    """The frames (innermost first) of the thread that runs the script."""
    if not threads:
        return []
    for t in threads:
        if t.get("name") == "MainThread":
            return list(t.get("frames") or [])
    for t in threads:
        frames = t.get("frames") or []
        if frames and frames[-1].get("function") == "<module>":
            return list(frames)
    return list(threads[0].get("frames") or [])


def user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame of user code: where the script itself stands."""
    return next((f for f in frames if is_user_frame(str(f.get("file", "")))), None)


def describe_phase(phase: dict[str, Any] | None, frames: list[Frame]) -> str:
    """Where a rank waits, in the words a DDP user knows."""
    if not phase:
        inner = frames[0] if frames else None
        if inner is None:
            return "user code (no sync point)"
        return f"user code, not in a sync point ({inner.get('function')})"
    seq = phase.get("seq", -1)
    num = f"collective #{seq}" if isinstance(seq, int) and seq >= 0 else "collective"
    live = LivePhase.of(phase.get("name")) or LivePhase.COLLECTIVE
    return live.where.format(op=phase.get("op"), num=num)


def _op_name(phase: dict[str, Any] | None) -> str:
    """What ranks that disagree are told apart by: the op, with a DDP forward's mode."""
    if not phase:
        return "none"
    live = LivePhase.of(phase.get("name"))
    if live is LivePhase.FORWARD:
        return f"{live.label} ({phase.get('op')})"
    if live is LivePhase.BACKWARD:
        return live.label
    return op_label(phase)


@dataclass
class RankState:
    rank: int
    phase: dict[str, Any] | None
    since_s: float
    frames: list[Frame]
    where: str
    user: Frame | None
    stack_method: str | None

    @property
    def in_sync(self) -> bool:
        return bool(self.phase) and self.phase.get("name") in SYNC_LIVE_PHASES  # type: ignore[union-attr]

    @property
    def seq(self) -> int:
        return int((self.phase or {}).get("seq", -1))

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": (self.phase or {}).get("name"),
            "op": (self.phase or {}).get("op"),
            "seq": self.seq if self.phase else None,
            "in_sync_point_s": round(self.since_s, 3) if self.phase else None,
            "where": self.where,
            "user_frame": self.user,
            "stack_method": self.stack_method,
            "stack": self.frames,
        }


@dataclass
class HangDiagnosis:
    pattern: str
    culprits: list[int]
    explanation: str
    fix: str
    ranks: dict[int, RankState] = field(default_factory=dict)
    groups: list[tuple[list[int], str]] = field(default_factory=list)
    quiet_s: float = 0.0
    threshold_s: float = 0.0
    proof: str = ""  # the statuses prove the hang (no threshold had to pass); "busy: ..." when
    # the user's --hang-timeout ran out on a rank that still progresses

    def text(self, hang_dir: str = "") -> str:
        """The report printed on stderr when the hang is caught."""
        if self.proof.startswith("busy: "):  # past --hang-timeout, though the rank progresses
            lines = [
                f"ddpdoctor: HANG - waited {self.quiet_s:.0f} s (--hang-timeout {self.threshold_s:g} s) "
                f"for a rank that is busy, not stuck: {self.proof[6:]}"
            ]
        elif self.proof:
            lines = [f"ddpdoctor: HANG - proven after {self.quiet_s:.1f} s: {self.proof}"]
        else:
            lines = [
                f"ddpdoctor: HANG - no progress for {self.quiet_s:.0f} s (threshold {self.threshold_s:g} s)"
            ]
        width = max((len(_ranks_label(r)) for r, _ in self.groups), default=6)
        for ranks, where in self.groups:
            lines.append(f"  {_ranks_label(ranks):<{width}}  in {where}")
        lines.append(f"  {self.explanation}")
        lines.append(f"  Fix: {self.fix}")
        if hang_dir:
            lines.append(f"  Stacks: {hang_dir}{os.sep}")
        return "\n".join(lines)

    def finding(self, hang_dir: str = "") -> Finding:
        return Finding(
            "hang",
            "error",
            self.culprits or sorted(self.ranks),
            self.explanation,
            fix=self.fix,
            details={
                "pattern": self.pattern,
                "proof": self.proof,
                "threshold_s": self.threshold_s,
                "no_progress_s": round(self.quiet_s, 3),
                "hang_dir": hang_dir,
                "groups": [{"ranks": r, "where": w} for r, w in self.groups],
                "ranks": {str(r): s.to_json() for r, s in sorted(self.ranks.items())},
            },
        )


def _ranks_label(ranks: list[int]) -> str:
    return "rank " + rank_list(ranks).replace(", ", ",")


def _where(state_phase: dict[str, Any] | None, frames: list[Frame]) -> tuple[str, Frame | None]:
    user = user_frame(frames)
    where = describe_phase(state_phase, frames)
    if user is not None:
        where += f"  <- {user.get('function')}() {os.path.basename(str(user.get('file')))}:{user.get('line')}"
    return where, user


K = TypeVar("K", bound=Hashable)


def group_ranks(keys: dict[int, K]) -> list[tuple[list[int], K]]:
    """Ranks that share a key (where they wait; their stack), by their lowest rank: how the
    terminal's hang report and the report's stacks list ranks that stand in the same place."""
    grouped: dict[K, list[int]] = {}
    for rank, key in sorted(keys.items()):
        grouped.setdefault(key, []).append(rank)
    return sorted(((sorted(r), k) for k, r in grouped.items()), key=lambda g: g[0][0])


def analyse(
    statuses: Mapping[int, RankStatus | Mapping[str, Any]],
    stacks: dict[int, dict[str, Any]],
    *,
    threshold_s: float,
    quiet_s: float | None = None,
    now: float | None = None,
    world_size: int | None = None,
    proof: str = "",
) -> HangDiagnosis:
    """Diagnose a hang from each rank's status (as read, or its JSON from a hang summary) and
    stack dump (``{"method", "threads"}``)."""
    states: dict[int, RankState] = {}
    for rank, raw in sorted(statuses.items()):
        status = RankStatus.of(raw)
        dump = stacks.get(rank) or {}
        frames = main_thread(dump.get("threads") or [])
        phase = status.phase or None
        where, user = _where(phase, frames)
        states[rank] = RankState(rank, phase, status.in_phase_s(now), frames, where, user, dump.get("method"))
    groups = group_ranks({rank: st.where for rank, st in states.items()})
    if quiet_s is None:
        quiet_s = max((s.since_s for s in states.values()), default=0.0)
    pattern, culprits, explanation, fix = _judge(states, world_size, busy=proof.startswith("busy: "))
    # A sequence number nobody could read (stacks taken by `attach`, no probes) is -1: no number.
    explanation = explanation.replace(" #-1", "")
    return HangDiagnosis(pattern, culprits, explanation, fix, states, groups, quiet_s, threshold_s, proof)


def _loc(state: RankState) -> str:
    u = state.user
    return f" at {os.path.basename(str(u.get('file')))}:{u.get('line')} ({u.get('function')})" if u else ""


def _judge(
    states: dict[int, RankState], world_size: int | None, busy: bool = False
) -> tuple[str, list[int], str, str]:
    missing = sorted(set(range(world_size or 0)) - set(states))
    if missing:
        return (
            "rank_missing",
            missing,
            f"Rank(s) {rank_list(missing)} never reported: they did not reach init_process_group "
            "or run on another node; the others wait for them.",
            "Check those ranks' own output (and other nodes' ddpdoctor runs).",
        )
    waiting = {r: s for r, s in states.items() if s.in_sync}
    outside = {r: s for r, s in states.items() if not s.in_sync}
    if outside:
        culprits = sorted(outside)
        first = outside[culprits[0]]
        in_data = all((s.phase or {}).get("name") == LivePhase.DATA for s in outside.values())
        seqs = sorted({s.seq for s in waiting.values()})
        target = f" collective #{seqs[0]}" if len(seqs) == 1 and seqs[0] >= 0 else " the next collective"
        what = "waits for a batch from its DataLoader" if in_data else "is stuck in user code"
        if busy:  # its CPU time or stack moved: working, for longer than the user allowed
            what = "is busy in user code"
        lead = (
            f"Rank(s) {rank_list(culprits)} never reached{target}: rank {first.rank} {what}{_loc(first)}"
            + (f", while rank(s) {rank_list(waiting)} wait for it." if waiting else ".")
        )
        fix = (
            "Find why the DataLoader blocks (a dead or slow worker, a remote file); "
            "num_workers=0 shows the dataset's own stack."
            if in_data
            else "Look at the stack of that rank: an infinite loop, a lock, a blocking read or a "
            "rank-dependent branch keeps it from the collective the others are in."
        )
        if busy:
            fix = (
                "If that work is expected (evaluation, a checkpoint), spread it over every rank or "
                "raise --hang-timeout; if not, its stack shows the loop that never ends."
            )
        return ("data_loader" if in_data else "user_code"), culprits, lead, fix
    by_seq: dict[int, list[int]] = {}
    for r, s in waiting.items():
        by_seq.setdefault(s.seq, []).append(r)
    ops: dict[str, list[int]] = {}
    for r, s in waiting.items():
        ops.setdefault(_op_name(s.phase), []).append(r)
    if len(by_seq) == 1 and len(ops) > 1:
        seq = next(iter(by_seq))
        forward_ranks = sorted(r for r, s in waiting.items() if (s.phase or {}).get("name") in _DDP_FORWARD)
        # Name the op of the lowest rank first: "broadcast vs barrier" when rank 0 is the odd one.
        names = " vs ".join(sorted(ops, key=lambda op: min(ops[op])))
        if forward_ranks and len(forward_ranks) < len(waiting):
            training = any((waiting[r].phase or {}).get("op") == "train" for r in forward_ranks)
            mode = "training " if training else ""
            who = _ranks_label(forward_ranks)
            explanation = (
                f"Ranks disagree on collective #{seq} ({names}): {who} runs a DDP {mode}forward "
                f"the others never run{_loc(waiting[forward_ranks[0]])}."
            )
            if mode:
                fix = (
                    "Every rank must run the same DDP forward/backward passes; for uneven inputs "
                    "wrap the loop in model.join()."
                )
            else:
                fix = (
                    f"evaluate model.module on rank {forward_ranks[0]} (no collectives), "
                    "or evaluate on every rank."
                )
            return "rank_only_forward", forward_ranks, explanation, fix
        # Which side is the extra call is not in one look (a rank that skipped a barrier and a
        # rank that logs alone look the same here): the ledger decides it after the run.
        places = "; ".join(
            f"rank(s) {rank_list(rs)} in {op}{_loc(waiting[rs[0]])}"
            for op, rs in sorted(ops.items(), key=lambda kv: min(kv[1]))
        )
        explanation = (
            f"Ranks disagree on collective #{seq} ({names}): {places}; the ranks issue "
            "different collectives here."
        )
        fix = (
            "Issue collectives in the same order on every rank: the call only some ranks make "
            "(under `if rank == ...`, in a rank-dependent loop, or a dict or set iterated in a "
            "per-process order) must run on every rank or on none."
        )
        if NEW_GROUP in ops:  # creating a group is the extra call: name it for what it is
            differ = disagreement({r: s.phase or {} for r, s in waiting.items()}, _op_name)
            if differ is not None:
                explanation = f"{explanation} {differ.text[0].upper()}{differ.text[1:]}."
                return "collective_order", sorted(ops[NEW_GROUP]), explanation, fix_for(differ, NEW_GROUP)
        return "collective_order", sorted(waiting), explanation, fix
    if len(by_seq) > 1:
        low = min(by_seq)
        behind = sorted(by_seq[low])
        ahead = sorted(r for q, rs in by_seq.items() if q != low for r in rs)
        explanation = (
            f"Ranks are at different collectives: rank(s) {rank_list(behind)} wait in #{low} "
            f"({_op_name(waiting[behind[0]].phase)}) while rank(s) {rank_list(ahead)} already "
            f"issued it and wait in #{waiting[ahead[0]].seq} ({_op_name(waiting[ahead[0]].phase)}): "
            "one side ran a collective the other skipped."
        )
        fix = (
            "Make every rank issue the same collectives (look for one under `if rank == ...` or a "
            "loop whose length differs between ranks)."
        )
        return "seq_mismatch", behind, explanation, fix
    seq = next(iter(by_seq), -1)
    op = next(iter(ops), "?")
    differ = disagreement({r: s.phase or {} for r, s in waiting.items()}, _op_name, f"collective #{seq}")
    if differ is not None:  # same op, same sequence number, another part of the signature
        return (
            "collective_mismatch",
            differ.minority,
            differ.text[0].upper() + differ.text[1:] + ": the collective can never complete.",
            fix_for(differ, op),
        )
    return (
        "backend_stuck",
        sorted(states),
        f"Every rank waits in the same collective #{seq} ({op}): the backend itself is stuck "
        "(a lost peer, a network problem, an NCCL error).",
        "Rerun with NCCL_DEBUG=INFO (and TORCH_NCCL_TRACE_BUFFER_SIZE for the flight recorder); "
        "check the network between the hosts.",
    )


def hang_finding(summary: dict[str, Any]) -> Finding | None:
    """The `hang` finding from a persisted ``hang-N/summary.json`` (see supervisor/watch.py)."""
    statuses = {int(r): s for r, s in (summary.get("statuses") or {}).items()}
    if not statuses:
        return None
    stacks = {int(r): s for r, s in (summary.get("stacks") or {}).items()}
    diag = analyse(
        statuses,
        stacks,
        threshold_s=float(summary.get("threshold_s", 0.0)),
        quiet_s=summary.get("quiet_s"),
        now=summary.get("detected_wall"),
        world_size=summary.get("world_size"),
        proof=Verdict.from_json(summary.get("verdict") or {}).proof_line,
    )
    finding = diag.finding(str(summary.get("hang_dir", "")))
    finding.details["action"] = summary.get("action")
    finding.details["recovered"] = bool(summary.get("recovered"))
    from ddpdoctor.analysis.hung import flight

    return flight.merge(finding, str(summary.get("hang_dir") or ""))
