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

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.hung import patterns
from ddpdoctor.analysis.hung.patterns import ranks_label
from ddpdoctor.analysis.hung.proof import Verdict
from ddpdoctor.probes.status import RankStatus
from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase
from ddpdoctor.trace.stacktext import is_user_frame, runs_own_code

Frame = dict[str, Any]  # {"file", "line", "function"}


def main_thread(threads: list[dict[str, Any]]) -> list[Frame]:
    """The frames (innermost first) of the thread that runs the script."""
    return list(main_thread_of(threads).get("frames") or [])


def main_thread_of(threads: list[dict[str, Any]]) -> dict[str, Any]:
    """The thread that runs the script, as a dump has it ({} without threads)."""
    if not threads:
        return {}
    for t in threads:
        if t.get("name") == "MainThread":
            return t
    for t in threads:
        frames = t.get("frames") or []
        if frames and frames[-1].get("function") == "<module>":
            return t
    return threads[0]


def user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame of user code: where the script itself stands."""
    return next((f for f in frames if is_user_frame(str(f.get("file", "")))), None)


def in_own_code(phase: dict[str, Any] | None, frames: list[Frame]) -> bool:
    """Inside a DDP pass (its forward, its backward), running the user's own code there (a
    custom autograd Function, a hook): the pass waits on it, not on the peers."""
    live = LivePhase.of((phase or {}).get("name"))
    return live is not None and live.waits == "compound" and runs_own_code(frames)


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
    if in_own_code(phase, frames):
        return f"its DDP {live.value}, running its own code there (entered at {num})"
    return live.where.format(op=phase.get("op"), num=num)


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
    def own_code(self) -> bool:
        return in_own_code(self.phase, self.frames)

    @property
    def in_sync(self) -> bool:
        in_phase = bool(self.phase) and self.phase.get("name") in SYNC_LIVE_PHASES  # type: ignore[union-attr]
        return in_phase and not self.own_code

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
        width = max((len(ranks_label(r)) for r, _ in self.groups), default=6)
        for ranks, where in self.groups:
            lines.append(f"  {ranks_label(ranks):<{width}}  in {where}")
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
    pattern, culprits, explanation, fix = patterns.judge(states, world_size, busy=proof.startswith("busy: "))
    # A sequence number nobody could read (stacks taken by `attach`, no probes) is -1: no number.
    explanation = explanation.replace(" #-1", "")
    return HangDiagnosis(pattern, culprits, explanation, fix, states, groups, quiet_s, threshold_s, proof)


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
