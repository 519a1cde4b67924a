"""Causes, from the ledgers' first divergence: each with the root rank, where each side was in
the user's code, the evidence, and a fix of its own.

The other ranks' errors and the live hang verdict are symptoms of the cause found here;
``diagnosis.py`` folds them into it as consequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddpdoctor.analysis.failed.forwards import forward_cause, rank_only_forwards
from ddpdoctor.analysis.failed.leaving import FIX_LEFT, left_by, left_loop, ran_out, shares
from ddpdoctor.analysis.failed.ledger import build, forward_site
from ddpdoctor.analysis.failed.made import loop_data, sized_by_data, tensor_made
from ddpdoctor.analysis.failed.order import FIX_REPEATED, order_differs, repeated
from ddpdoctor.analysis.failed.parting import Divergence, first_divergence
from ddpdoctor.analysis.failed.points import BUFFERS, FORWARD, Ledger, Point, is_ddp
from ddpdoctor.analysis.failed.rankonly import (
    FIX_BRANCH,
    extra_call,
    others_text,
    rank_only_call,
    rank_only_logs,
)
from ddpdoctor.analysis.failed.signature import disagreement, fix_for
from ddpdoctor.analysis.failed.skipped import accumulation_differs, skipped_sync
from ddpdoctor.analysis.failed.stacks import death_stack, user_frame
from ddpdoctor.analysis.failed.wentpast import went_past, went_past_rounds, went_past_schedule
from ddpdoctor.analysis.findings import Finding, detector, rank_list
from ddpdoctor.trace.reader import Run

# Finding kinds this module decides; a run with one of them at error level has its other
# failure and hang findings folded into it as consequences.
CAUSE_KINDS = (
    "node_lost",
    "awaited_work",  # analysis/hung/awaited.py: the work a rank did while the others timed out
    "skipped_gradient_sync",  # analysis/failed/parting.py
    "model_differs",  # analysis/failed/failures.py
    "uneven_inputs",
    "rank_left_early",
    "rank_only_collective",
    "collective_mismatch",
    "rank_only_eval",
    "rank_only_forward",
    "rank_never_started",
)
_ENDED = ("clean_exit", "exit_code", "signal", "vanished")

FIX_UNEVEN = (
    "Give every rank the same number of batches: run the loop under `with model.join():` (DDP's "
    "Join context lets ranks that run out shadow the others' all-reduces), shard with a "
    "DistributedSampler (it pads every rank to the same length), or drop the remainder "
    "(drop_last=True)."
)
FIX_MISMATCH = (
    "Every rank must issue the same collectives in the same order with the same op and size: "
    "pad per-rank tensors to one size (all_gather the sizes first), iterate dicts in a sorted "
    "order, and keep collectives out of rank-dependent branches."
)


@detector
def ledger_causes(run: Run) -> Iterable[Finding]:
    ledgers = build(run)
    div = first_divergence(ledgers) or _left_first(ledgers)
    found = rank_only_logs(ledgers, div is not None, _evidence(ledgers, ledgers))
    if found is None and div is not None:
        found = _explain(div, ledgers)
    if found is None or (found.kind == "collective_mismatch" and found.details.get("root_rank") is None):
        # no root from the sequence numbers: each rank's own order of calls may say who departed
        found = went_past_rounds(ledgers, _evidence(ledgers, ledgers)) or found
    if found is not None:
        yield found
    yield from rank_only_forwards(ledgers, found)
    yield from _never_started(run, ledgers, found)


def _left_first(ledgers: dict[int, Ledger]) -> Divergence | None:
    """A rank whose record ended (exit, signal) while another went on to later steps."""
    gone = [lg for lg in ledgers.values() if lg.ending.how in _ENDED]
    if not gone:
        return None
    first = min(gone, key=lambda lg: (lg.last_step, lg.ending.wall_s or 0.0, lg.rank))
    ahead = [lg.rank for lg in ledgers.values() if lg.rank != first.rank and lg.last_step > first.last_step]
    if not ahead or all(ledgers[r].ending.how == "clean_exit" for r in ahead):
        return None  # the others finished too (a Join context, or no collective left): no harm
    return Divergence(
        "left", first.rank, ahead, {}, {"steps": {lg.rank: lg.last_step for lg in ledgers.values()}}
    )


def _evidence(ledgers: dict[int, Ledger], ranks: Iterable[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in sorted(ranks):
        lg = ledgers[r]
        out[str(r)] = {
            "steps_completed": lg.steps,
            "last_step": lg.last_step,
            "ended": lg.ending.how,
            "place": lg.place,
            "tail": [p.describe() for p in lg.points[-3:]],
            "batches_per_pass": [p.read for p in lg.passes][-4:],
        }
    return out


def _explain(div: Divergence, ledgers: dict[int, Ledger]) -> Finding | None:
    if div.what == "mismatch":
        return _mismatch(div, ledgers)
    if div.what == "steps":
        return skipped_sync(div, ledgers, _evidence(ledgers, ledgers))
    if div.what == "accumulation":
        return accumulation_differs(div, ledgers, _evidence(ledgers, ledgers))
    root = ledgers[div.root] if div.root is not None else None
    if root is None:
        return None
    others = [ledgers[r] for r in div.others]
    if others and all(o.ending.how == "clean_exit" for o in others) and root.ending.how == "clean_exit":
        return None  # every rank finished on its own (a Join context): unequal, but no harm
    ending = root.ending
    evidence = _evidence(ledgers, ledgers)
    details: dict[str, Any] = {"root_rank": root.rank, "ranks": evidence, "ending": ending.describe()}
    where_others = "; ".join(
        f"rank {o.rank} went on to step {o.last_step} ({o.place or '?'})" for o in others
    )
    at = f" at {root.place}" if root.place else ""
    if ending.how == "exception" and not ending.consequence:
        return None  # its own exception: rank_failure names it, with the traceback
    if ending.how in ("signal", "vanished", "never_started", "exit_code"):
        return None  # killed outright, or exited with an error code: rank_failure names it
    left = left_by(root, others)
    if left:
        return left_loop(
            root, left, f"{'exited' if ending.how == 'clean_exit' else 'moved on'}{at}", where_others, details
        )
    if ran_out(root, others):
        return Finding(
            "uneven_inputs",
            "error",
            [root.rank],
            f"uneven inputs: rank {root.rank} ran out of batches after step {root.last_step} and "
            f"{'exited' if ending.how == 'clean_exit' else 'moved on'}{at}, while {where_others}: "
            f"the extra steps' gradient all-reduce has no partner{shares(root, others)}{_data(others)}",
            fix=FIX_UNEVEN,
            details=details,
        )
    last = root.passes[-1] if root.passes else None
    read = f" after {last.read} of {last.expected} batches of its pass" if last else ""
    return Finding(
        "rank_left_early",
        "error",
        [root.rank],
        f"rank {root.rank} left the training loop early{read} (step {root.last_step}) and "
        f"{ending.describe()}; {where_others}: their errors are consequences",
        fix=FIX_LEFT,
        details=details,
    )


def _mismatch(div: Divergence, ledgers: dict[int, Ledger]) -> Finding:
    """The cause at a sequence number where the ranks disagree; ranks killed inside that
    collective (gloo aborts on a size it did not expect) are named as its consequences."""
    found = _mismatch_cause(div, ledgers)
    died = {
        r: ledgers[r].ending
        for r, p in div.points.items()
        if p is not None and p.died_in and ledgers[r].ending.how == "signal"
    }
    if died:
        deaths = "; ".join(f"rank {r} was killed by {e.signal} inside it" for r, e in sorted(died.items()))
        found.summary += f". A consequence: {deaths}"
        found.details["deaths"] = {str(r): e.describe() for r, e in died.items()}
    if div.evidence.get("backend"):
        found.details["backend_said"] = div.evidence["backend"]
    return found


def _data(others: list[Ledger]) -> str:
    """Where the data of the loop the ranks that did not run out are still in came from, when
    they are at one line: "; the loop at ... iterates what ... made" (``made.loop_data``)."""
    stacks = {tuple(o.stack) for o in others}
    made = loop_data(list(stacks.pop())) if len(stacks) == 1 else ""
    return f"; {made}" if made else ""


def _made(points: dict[int, Point], ledgers: dict[int, Ledger]) -> tuple[str, str]:
    """Where the tensor of a call every rank made from one line got its value, and what fixes
    its size where a call that sizes it by the data made it (``made.py``)."""
    sites = {p.site for p in points.values()}
    if len(sites) != 1 or not (site := sites.pop()):
        return "", ""
    path, line = next((w for r in points if (w := ledgers[r].path_of(site))[0]), ("", 0))
    op = next(iter(points.values())).op
    return (tensor_made(path, line, op), sized_by_data(path, line, op)) if path else ("", "")


def _mismatch_cause(div: Divergence, ledgers: dict[int, Ledger]) -> Finding:
    points = {r: p for r, p in div.points.items() if p is not None}
    seq = div.evidence.get("seq")
    said = "; ".join(f"rank {r}: {p.describe()}" for r, p in sorted(points.items()))
    details: dict[str, Any] = {"seq": seq, "points": {str(r): p.describe() for r, p in points.items()}}
    details["ranks"] = _evidence(ledgers, ledgers)
    python = {r: p for r, p in points.items() if not is_ddp(p)}
    ddp = {r: p for r, p in points.items() if is_ddp(p)}
    forward_side = {r: p for r, p in ddp.items() if p.op.startswith((BUFFERS, FORWARD))}
    if python and not ddp:
        alone = extra_call(points, ledgers, _evidence(ledgers, ledgers)) or rank_only_call(
            points, ledgers, _evidence(ledgers, ledgers)
        )
        if alone is not None:
            return alone
        backend = bool(div.evidence.get("backend"))
        ordered = order_differs(points, ledgers, seq, details, backend) if isinstance(seq, int) else None
        if ordered is not None:
            return ordered
        past = went_past(points, ledgers, details)
        if past is not None:
            return past
        differ = disagreement({r: p.signature() for r, p in points.items()}, lambda s: str(s["op"]))
        text = div.evidence.get("disagreement") or f"the ranks disagree at collective #{seq}"
        if div.evidence.get("changed"):
            text += f"; {div.evidence['changed']}"
        op = next(iter(points.values())).op
        made, sizing = _made(points, ledgers) if div.evidence.get("differs") == "size" else ("", "")
        text += f"; {made}" if made else ""
        fix = fix_for(differ, op) if differ is not None and differ.field != "op" else FIX_MISMATCH
        return Finding(
            "collective_mismatch",
            "error",
            sorted(points),
            f"{text} ({said})",
            fix=f"{sizing} {fix}" if sizing else fix,
            details={**details, "root_rank": div.root, "differs": div.evidence.get("differs")},
        )
    if forward_side and len(forward_side) < len(points):
        return forward_cause(forward_side, points, ledgers, details)
    if python and ddp:
        root = min(python)
        root_lg, others = ledgers[root], [ledgers[r] for r in ddp]
        ahead = all(o.last_step > root_lg.last_step for o in others)
        skipped = went_past_schedule(points, ledgers, sorted(python), details)
        if skipped is not None:
            return skipped
        left = left_by(root_lg, others) if ahead else ""
        if left:
            waits = f"waits in {python[root].describe()}"
            return left_loop(root_lg, left, waits, others_text(points, root), {**details, "root_rank": root})
        if ran_out(root_lg, others) and ahead:
            return Finding(
                "uneven_inputs",
                "error",
                [root],
                f"uneven inputs: rank {root} ran out of batches after step {root_lg.last_step} and "
                f"waits in {python[root].describe()}, while {others_text(points, root)}: that "
                f"step's gradient all-reduce has no partner{shares(root_lg, others)}{_data(others)}",
                fix=FIX_UNEVEN,
                details={**details, "root_rank": root},
            )
        past = went_past(points, ledgers, details)  # a skipped call: the ranks' own rounds say whose
        if past is not None:
            return past
        call = python[root]
        if call.site and any(call.site in {q.site for q in ledgers[r].points} for r in ddp):
            # the others executed that line too: not a branch they skipped; they parted in a
            # run of that call, or earlier than anything on record here
            runs = repeated(points, ledgers, call)
            return Finding(
                "collective_mismatch",
                "error",
                sorted(points),
                f"the ranks issue different collectives at #{seq}: rank(s) {rank_list(python)} in "
                f"{call.describe()} (a line the others execute too), while {others_text(points, root)}"
                + (
                    runs
                    or ": their sequences of collectives parted before this point (a step, a collective or "
                    "a batch one side had and the other did not)"
                ),
                fix=FIX_REPEATED if runs else FIX_MISMATCH,
                details={**details, "root_rank": None, "place": call.site},
            )
        return Finding(
            "rank_only_collective",
            "error",
            sorted(python),
            f"rank(s) {rank_list(python)} called {call.describe()} in a branch the others "
            f"did not take (they never executed {call.site or 'that line'}); {others_text(points, root)}",
            fix=FIX_BRANCH.format(op=python[root].op),
            details={**details, "root_rank": root, "place": python[root].site},
        )
    return Finding(
        "collective_mismatch",
        "error",
        sorted(points),
        f"the ranks disagree at collective #{seq}: {said}",
        fix=FIX_MISMATCH,
        details={**details, "root_rank": None},
    )


_INIT = (
    "init_process_group",
    "_store_based_barrier",
    "rendezvous",
    "_create_c10d_store",
    "_new_process_group_helper",
)


def _never_started(run: Run, ledgers: dict[int, Ledger], found: Finding | None) -> Iterable[Finding]:
    """Ranks that never got through init_process_group. The supervisor's records say how each
    process ended (probes/early.py, ends.json): the ranks that failed on their own are the
    cause; those it stopped while they waited inside init_process_group for them are not."""
    missing = [r for r, lg in ledgers.items() if lg.ending.how == "never_started"]
    if not missing or found is not None or not run.exit_code or not (run.ranks or run.ends):
        return
    waiting: dict[int, str] = {}  # rank -> where in the user's code it waited in init
    for r in missing:
        frames = death_stack(run, r)
        if any(str(f.get("function")) in _INIT for f in frames):
            waiting[r] = user_frame(frames) or "?"
    roots = [r for r in missing if r not in waiting and not ledgers[r].ending.consequence]
    roots = roots or [r for r in missing if r not in waiting] or missing
    parts, ranks_info = [], {}
    for r in roots:
        end = run.ends.get(r) or {}
        words = [str(w).strip() for w in end.get("words") or [] if str(w).strip()]
        if end.get("how") == "exception":
            how = f"raised {end.get('source')}"
        elif end.get("how") == "signal":
            how = f"was killed by {end.get('signal')}"
        elif end.get("how") == "exit":
            how = "exited"
        else:
            how = "left no record of its process (was it started?)"
        said = f" (its last stderr: {' | '.join(words[-3:])[:300]!r})" if words else ""
        parts.append(f"rank {r} {how} before calling init_process_group{said}")
        ranks_info[str(r)] = {"ended": end.get("how"), "source": end.get("source"), "words": words[-6:]}
    others = []
    for r, place in sorted(waiting.items()):
        end = run.ends.get(r) or {}
        stopped = f" until it was killed by {end.get('signal')}" if end.get("how") == "signal" else ""
        if stopped and end.get("source"):
            stopped += f" ({end['source']})"
        others.append(f"rank {r} waited inside init_process_group at {place}{stopped}")
        ranks_info[str(r)] = {"ended": end.get("how"), "waiting_in": "init_process_group", "place": place}
    started = [r for r in sorted(ledgers) if r not in missing]
    if started:
        others.append(f"rank(s) {rank_list(started)} got through init and waited for them")
    text = "; ".join(parts) + (f"; {'; '.join(others)}: a consequence" if others else "")
    yield Finding(
        "rank_never_started",
        "error",
        roots,
        f"{text} (the job exited with code {run.exit_code})",
        fix="Fix the error those ranks printed before init_process_group (configuration, "
        "imports, files, devices): every rank must reach init_process_group, or the others "
        "wait at the rendezvous until the launcher or the timeout stops them.",
        details={"root_rank": roots[0], "missing": missing, "waiting": sorted(waiting), "ranks": ranks_info},
    )


def annotate(run: Run, findings: list[Finding]) -> None:
    """Give other detectors' findings the user's line and root rank the ledger knows (in place):
    the forward whose backward left parameters without gradients, and the ranks they missed on."""
    for f in findings:
        if f.kind != "unused_parameters" or "place" in f.details:
            continue
        steps = f.details.get("steps") or []
        for rank in f.ranks or sorted(run.ranks):
            trace = run.ranks.get(rank)
            site = forward_site(trace, steps[0] if steps else None) if trace is not None else ""
            if site:
                f.details["place"] = site
                f.summary += f" (the forward at {site})"
                break
        unused_on: set[int] = set()
        for info in (f.details.get("per_parameter") or {}).values():
            unused_on |= set(info.get("ranks") or [])
        if unused_on and len(unused_on) < run.world_size:
            f.details["root_rank"] = min(unused_on)
