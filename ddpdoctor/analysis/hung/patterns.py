"""The hang patterns as a table: what each needs to see in one look at the ranks, whom it
blames, what it says and the fix. The first row whose need is met names the hang, so a row that
refines another stands above it, and adding a pattern is adding a row.

A look (``Look``) computes once what the rows ask about: the ranks that never reported, those
outside every sync point and those waiting in one, the sequence numbers and ops they wait at.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ddpdoctor.analysis.failed.signature import NEW_GROUP, Disagreement, disagreement, fix_for
from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.hung.proof import op_label
from ddpdoctor.trace.livephase import LivePhase

if TYPE_CHECKING:
    from ddpdoctor.analysis.hung.hang import RankState

# A DDP forward, with or without its buffer broadcast: a pass every rank must run.
_DDP_FORWARD = frozenset({LivePhase.FORWARD.value, LivePhase.SYNC_BUFFERS.value})


def op_name(phase: dict[str, Any] | None) -> str:
    """What ranks that disagree are told apart by: the op, with a DDP forward's mode."""
    if not phase:
        return "none"
    live = LivePhase.of(phase.get("name"))
    if live is LivePhase.FORWARD:
        return f"{live.label} ({phase.get('op')})"
    if live is LivePhase.BACKWARD:
        return live.label
    return op_label(phase)


def ranks_label(ranks: list[int]) -> str:
    return "rank " + rank_list(ranks).replace(", ", ",")


def _loc(state: RankState) -> str:
    u = state.user
    return f" at {os.path.basename(str(u.get('file')))}:{u.get('line')} ({u.get('function')})" if u else ""


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


@dataclass
class Look:
    """The ranks at the verdict, and what the patterns ask about them."""

    states: dict[int, RankState]
    world_size: int | None
    busy: bool  # the rank the others wait on was working (its CPU time or stack moved)
    waiting: dict[int, RankState] = field(init=False)
    outside: dict[int, RankState] = field(init=False)
    by_seq: dict[int, list[int]] = field(init=False)  # sequence number -> the ranks waiting at it
    ops: dict[str, list[int]] = field(init=False)  # op -> the ranks waiting in it

    def __post_init__(self) -> None:
        self.waiting = {r: s for r, s in self.states.items() if s.in_sync}
        self.outside = {r: s for r, s in self.states.items() if not s.in_sync}
        self.by_seq, self.ops = {}, {}
        for r, s in self.waiting.items():
            self.by_seq.setdefault(s.seq, []).append(r)
            self.ops.setdefault(op_name(s.phase), []).append(r)

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(self.world_size or 0)) - set(self.states))

    @property
    def in_data(self) -> bool:
        """Every rank outside the sync points waits for a batch."""
        return all((s.phase or {}).get("name") == LivePhase.DATA for s in self.outside.values())

    @property
    def seq(self) -> int:
        return next(iter(self.by_seq), -1)

    @property
    def op(self) -> str:
        return next(iter(self.ops), "?")

    @property
    def one_seq_many_ops(self) -> bool:
        """Every rank waits at one sequence number, in different collectives."""
        return len(self.by_seq) == 1 and len(self.ops) > 1

    @property
    def forward_ranks(self) -> list[int]:
        return sorted(r for r, s in self.waiting.items() if (s.phase or {}).get("name") in _DDP_FORWARD)

    @property
    def names(self) -> str:
        """The ops, that of the lowest rank first: "broadcast vs barrier" when rank 0 is the odd one."""
        return " vs ".join(sorted(self.ops, key=lambda op: min(self.ops[op])))

    @cached_property
    def group_differ(self) -> Disagreement | None:
        return disagreement({r: s.phase or {} for r, s in self.waiting.items()}, op_name)

    @cached_property
    def signature_differ(self) -> Disagreement | None:
        """Same op at the same sequence number, another part of the signature."""
        phases = {r: s.phase or {} for r, s in self.waiting.items()}
        return disagreement(phases, op_name, f"collective #{self.seq}")


@dataclass(frozen=True)
class Pattern:
    name: str
    blames: Callable[[Look], list[int] | None]  # the culprits when the pattern applies, else None
    says: Callable[[Look, list[int]], str]
    fix: Callable[[Look, list[int]], str]


def _never_reached(k: Look, culprits: list[int]) -> str:
    first = k.outside[culprits[0]]
    seqs = sorted({s.seq for s in k.waiting.values()})
    target = f" collective #{seqs[0]}" if len(seqs) == 1 and seqs[0] >= 0 else " the next collective"
    what = "waits for a batch from its DataLoader" if k.in_data else "is stuck in user code"
    if k.busy:
        what = "is busy in user code"
    if first.own_code:  # a hook or an autograd Function of its own, inside DDP's pass
        name = (first.phase or {}).get("name")
        waits = f", while rank(s) {rank_list(k.waiting)} wait for it in{_points(k)}" if k.waiting else ""
        return (
            f"Rank(s) {rank_list(culprits)} never finished its DDP {name}: rank {first.rank} "
            f"{what.replace('user code', 'its own code')} inside it{_loc(first)}{waits}."
        )
    return f"Rank(s) {rank_list(culprits)} never reached{target}: rank {first.rank} {what}{_loc(first)}" + (
        f", while rank(s) {rank_list(k.waiting)} wait for it." if k.waiting else "."
    )


def _points(k: Look) -> str:
    """Where the waiting ranks wait: ' the gradient all-reduce (from collective #14 on)'."""
    seqs = sorted({s.seq for s in k.waiting.values()})
    passes = {LivePhase.of((s.phase or {}).get("name")) for s in k.waiting.values()}
    live = passes.pop() if len(passes) == 1 else None
    if live is None or len(seqs) != 1 or seqs[0] < 0:
        return " their sync points"
    if live.waits == "compound":  # a DDP pass issues several collectives from its first
        return f" the {live.label} (from collective #{seqs[0]} on)"
    return f" collective #{seqs[0]}"


def _own_code_fix(k: Look, culprits: list[int]) -> str:
    """What to do about a rank whose own code, run inside its DDP pass, does not return."""
    state = k.outside[culprits[0]]
    u = state.user or {}
    where = f"{os.path.basename(str(u.get('file')))}:{u.get('line')}"
    func = f"{u.get('function')}() at {where}" if u else "its code"
    return (
        f"Find what {func} waits for on rank {state.rank} (a lock, a queue, a file, a remote "
        f"call, a value only some ranks produce): it runs inside the DDP {(state.phase or {}).get('name')} "
        f"(a hook, an autograd Function, a module's forward), so the other ranks wait in"
        f"{_points(k)} until it returns. Make what it waits for come on every rank, or fetch it "
        "before the step."
    )


_BUSY_FIX = (
    "If that work is expected (evaluation, a checkpoint), spread it over every rank or raise "
    "--hang-timeout; if not, its stack shows the loop that never ends."
)
_ORDER_FIX = (
    "Issue collectives in the same order on every rank: the call only some ranks make (under "
    "`if rank == ...`, in a rank-dependent loop, or a dict or set iterated in a per-process "
    "order) must run on every rank or on none."
)


def _rank_only_forward(k: Look, culprits: list[int]) -> str:
    mode = "training " if _training(k, culprits) else ""
    return (
        f"Ranks disagree on collective #{k.seq} ({k.names}): {ranks_label(culprits)} runs a DDP "
        f"{mode}forward the others never run{_loc(k.waiting[culprits[0]])}."
    )


def _training(k: Look, culprits: list[int]) -> bool:
    return any((k.waiting[r].phase or {}).get("op") == "train" for r in culprits)


def _order(k: Look, culprits: list[int]) -> str:
    # Which side is the extra call is not in one look (a rank that skipped a barrier and a rank
    # that logs alone look the same here): the ledger decides it after the run.
    places = "; ".join(
        f"rank(s) {rank_list(rs)} in {op}{_loc(k.waiting[rs[0]])}"
        for op, rs in sorted(k.ops.items(), key=lambda kv: min(kv[1]))
    )
    return (
        f"Ranks disagree on collective #{k.seq} ({k.names}): {places}; the ranks issue "
        "different collectives here."
    )


def _behind(k: Look) -> list[int]:
    return sorted(k.by_seq[min(k.by_seq)])


def _seq_mismatch(k: Look, behind: list[int]) -> str:
    low = min(k.by_seq)
    ahead = sorted(r for q, rs in k.by_seq.items() if q != low for r in rs)
    return (
        f"Ranks are at different collectives: rank(s) {rank_list(behind)} wait in #{low} "
        f"({op_name(k.waiting[behind[0]].phase)}) while rank(s) {rank_list(ahead)} already issued it "
        f"and wait in #{k.waiting[ahead[0]].seq} ({op_name(k.waiting[ahead[0]].phase)}): one side ran a "
        "collective the other skipped."
    )


def _group_of(state: RankState) -> str:
    return str((state.phase or {}).get("group") or "WORLD")


def _groups_apart(k: Look) -> list[int] | None:
    """Ranks waiting in collectives of different process groups: each group numbers its own
    calls, so their sequence numbers say nothing of each other."""
    return sorted(k.waiting) if len({_group_of(s) for s in k.waiting.values()}) > 1 else None


def _groups_text(k: Look, culprits: list[int]) -> str:
    sides: dict[str, list[int]] = {}
    for r, s in sorted(k.waiting.items()):
        sides.setdefault(_group_of(s), []).append(r)
    parts, absent = [], []
    for group, ranks in sides.items():
        state = k.waiting[ranks[0]]
        name = "the default group" if group == "WORLD" else f"process group {group}"
        parts.append(f"rank(s) {rank_list(ranks)} in {op_name(state.phase)} #{state.seq} of {name}")
        members = (state.phase or {}).get("group_ranks")
        if group != "WORLD" and isinstance(members, list):
            away = [r for r in members if r in k.waiting and r not in ranks]
            if away:
                absent.append(f"rank(s) {rank_list(away)}, member(s) of group {group}, are not in its call")
    either = ": they skipped it, or the others made a call they do not make"
    tail = f" ({'; '.join(absent)}{either})" if absent else ""
    return (
        f"Ranks wait in collectives of different process groups: {'; '.join(parts)}{tail}. Each group "
        "numbers its own calls, and a group's call waits for every member."
    )


def _new_group(k: Look) -> list[int] | None:
    """Creating a group is the extra call: named for what it is."""
    if k.one_seq_many_ops and NEW_GROUP in k.ops and k.group_differ is not None:
        return sorted(k.ops[NEW_GROUP])
    return None


def _forward_only(k: Look) -> list[int] | None:
    ranks = k.forward_ranks if k.one_seq_many_ops else []
    return ranks if ranks and len(ranks) < len(k.waiting) else None


PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        "rank_missing",
        lambda k: k.missing or None,
        lambda k, c: (
            f"Rank(s) {rank_list(c)} never reported: they did not reach init_process_group "
            "or run on another node; the others wait for them."
        ),
        lambda k, c: "Check those ranks' own output (and other nodes' ddpdoctor runs).",
    ),
    Pattern(
        "data_loader",
        lambda k: sorted(k.outside) if k.outside and k.in_data else None,
        _never_reached,
        lambda k, c: (
            _BUSY_FIX
            if k.busy
            else "Find why the DataLoader blocks (a dead or slow worker, a remote file); num_workers=0 "
            "shows the dataset's own stack."
        ),
    ),
    Pattern(
        "user_code",
        lambda k: sorted(k.outside) or None,
        _never_reached,
        lambda k, c: (
            _BUSY_FIX
            if k.busy
            else _own_code_fix(k, c)
            if k.outside[c[0]].own_code
            else "Look at the stack of that rank: an infinite loop, a lock, a blocking read or a "
            "rank-dependent branch keeps it from the collective the others are in."
        ),
    ),
    Pattern(
        "rank_only_forward",
        _forward_only,
        _rank_only_forward,
        lambda k, c: (
            "Every rank must run the same DDP forward/backward passes; for uneven inputs "
            "wrap the loop in model.join()."
            if _training(k, c)
            else f"evaluate model.module on rank {c[0]} (no collectives), or evaluate on every rank."
        ),
    ),
    Pattern(
        "groups_apart",
        _groups_apart,
        _groups_text,
        lambda k, c: (
            "Make every member of a process group make each of its calls, in the same order as the "
            "others: look for a call on that group under a rank-dependent condition, or in a try "
            "block whose except skips it on some ranks."
        ),
    ),
    Pattern(
        "collective_order",
        _new_group,
        lambda k, c: f"{_order(k, c)} {_capital(k.group_differ.text)}.",  # type: ignore[union-attr]
        lambda k, c: fix_for(k.group_differ, NEW_GROUP),  # type: ignore[arg-type]
    ),
    Pattern(
        "collective_order",
        lambda k: sorted(k.waiting) if k.one_seq_many_ops else None,
        _order,
        lambda k, c: _ORDER_FIX,
    ),
    Pattern(
        "seq_mismatch",
        lambda k: _behind(k) if len(k.by_seq) > 1 else None,
        _seq_mismatch,
        lambda k, c: (
            "Make every rank issue the same collectives (look for one under `if rank == ...` "
            "or a loop whose length differs between ranks)."
        ),
    ),
    Pattern(
        "collective_mismatch",
        lambda k: k.signature_differ.minority if k.signature_differ is not None else None,
        lambda k, c: _capital(k.signature_differ.text) + ": the collective can never complete.",  # type: ignore[union-attr]
        lambda k, c: fix_for(k.signature_differ, k.op),  # type: ignore[arg-type]
    ),
    Pattern(
        "backend_stuck",
        lambda k: sorted(k.states),
        lambda k, c: (
            f"Every rank waits in the same collective #{k.seq} ({k.op}): the backend itself "
            "is stuck (a lost peer, a network problem, an NCCL error)."
        ),
        lambda k, c: (
            "Rerun with NCCL_DEBUG=INFO (and TORCH_NCCL_TRACE_BUFFER_SIZE for the flight "
            "recorder); check the network between the hosts."
        ),
    ),
)


def judge(
    states: dict[int, RankState], world_size: int | None, busy: bool = False
) -> tuple[str, list[int], str, str]:
    """(pattern, culprits, explanation, fix) of the first row whose need the look meets."""
    look = Look(states, world_size, busy)
    for pattern in PATTERNS:
        culprits = pattern.blames(look)
        if culprits is not None:
            return pattern.name, culprits, pattern.says(look, culprits), pattern.fix(look, culprits)
    raise AssertionError("backend_stuck applies to every look")
