"""A DDP sync point the backend matched across ranks in different steps, or that averaged a
different number of micro-batches on each rank (``parting.first_divergence`` finds them): the
rank that ran a step without its gradient all-reduce, or on another accumulation schedule, is
the root, at that first step, not where the job stopped later."""

from __future__ import annotations

import linecache
from typing import Any

from ddpdoctor.analysis.failed.parting import Divergence
from ddpdoctor.analysis.failed.points import GRAD_ALLREDUCE, Ledger
from ddpdoctor.analysis.failed.source import exits_after, no_sync_schedule
from ddpdoctor.analysis.findings import Finding

FIX_SKIPPED = (
    "Decide to skip a step on every rank together: all_reduce a flag (is the loss finite?) and "
    "skip on every rank, or keep the backward and zero the loss (loss * 0) so its gradient "
    "all-reduce still runs; gradient accumulation (no_sync) must follow the same schedule on "
    "every rank."
)


def skipped_sync(div: Divergence, ledgers: dict[int, Ledger], evidence: dict[str, Any]) -> Finding | None:
    """A DDP sync point matched across steps: the rank ahead ran a step without its gradient
    all-reduce (a skipped backward, a no_sync step the others did not take)."""
    assert div.root is not None
    steps = div.evidence["steps"]
    root, seq = div.root, div.evidence["seq"]
    mine = steps[root]
    behind = {r: s for r, s in steps.items() if s != mine}
    first = min(behind.values())
    lg = ledgers[root]
    synced = {p.step for p in lg.points if p.op == GRAD_ALLREDUCE}
    ran = [(s, site) for s, grad, _, site in lg.forwards if grad and first <= s < mine and s not in synced]
    if not ran:
        return None  # the fact the finding states (a step run without its all-reduce) is not on record
    step, site = ran[0]
    path, line = lg.path_of(site)
    branch = exits_after(path, line) if path else []
    name = site.rpartition(":")[0]
    left = ""
    if branch:
        word = "except" if linecache.getline(path, branch[0]).lstrip().startswith("except") else "if"
        left = (
            f"; after that forward the loop can leave the iteration before its backward: the `{word}` "
            f"at {name}:{branch[0]} and {name}:{branch[1]}"
        )
    others = "; ".join(f"rank {r} all-reduced step {s}'s gradients there" for r, s in sorted(behind.items()))
    gone = [r for r, g in ledgers.items() if g.ending.how not in ("clean_exit", "running")]
    after = (
        "; everything after (the hang or errors where the job stopped) is a consequence"
        if gone
        else "; the job went on, averaging gradients of different steps"
    )
    at = f" at {site}" if site else ""
    return Finding(
        "skipped_gradient_sync",
        "error" if gone else "warning",
        [root],
        f"rank {root} ran step {step}'s forward{at} but no gradient all-reduce for it (its backward "
        f"was skipped, or ran under no_sync() there alone{left}), so the backend matched the ranks' "
        f"gradient all-reduce #{seq} across steps: rank {root} all-reduced step {mine}'s gradients; "
        f"{others}. From step {step} on, the ranks' all-reduces pair with the wrong partners{after}",
        fix=FIX_SKIPPED,
        details={"root_rank": root, "place": f"{name}:{branch[0]}" if branch else site, "seq": seq,
                 "step": step, "forward": site, "steps_at_seq": {str(r): s for r, s in steps.items()},
                 "ranks": evidence},
    )  # fmt: skip


def accumulation_differs(div: Divergence, ledgers: dict[int, Ledger], evidence: dict[str, Any]) -> Finding:
    """Gradient all-reduces matched in the same step over different numbers of micro-batches:
    each rank accumulates on its own schedule, so every all-reduce averages gradients of
    different data, and the ranks' counts of all-reduces part at the end of the loop."""
    assert div.root is not None
    root, seq, step = div.root, div.evidence["seq"], div.evidence["step"]
    counts: dict[int, int] = div.evidence["micro_batches"]
    site = next((f for s, grad, _, f in ledgers[root].forwards if grad and s == step and f), "")
    path, line = ledgers[root].path_of(site)
    schedule = no_sync_schedule(path, line) if path else []
    name = site.rpartition(":")[0]
    decided = (
        "; whether a forward runs under no_sync() is decided at "
        + " <- ".join(f"{name}:{n}" for n in schedule)
        if schedule
        else ""
    )
    each = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
    gone = [r for r, g in ledgers.items() if g.ending.how not in ("clean_exit", "running")]
    after = (
        "; where the ranks' counts of all-reduces then part, the job stopped (the hang or errors "
        "there are consequences)"
        if gone
        else "; the job went on, averaging gradients of different micro-batches"
    )
    return Finding(
        "skipped_gradient_sync",
        "error" if gone else "warning",
        [root],
        f"the ranks accumulate gradients on different schedules: gradient all-reduce #{seq} (step "
        f"{step}, forward at {site or '?'}) averaged a different number of micro-batches on each rank "
        f"({each}); rank {root} ran "
        f"forwards under no_sync() where the others all-reduced{decided}{after}",
        fix="Use one gradient accumulation schedule on every rank: the same number of micro-batches "
        "per optimizer step (accum_steps) and the same no_sync() boundaries, derived from values "
        "every rank shares (the global batch, not a per-rank micro-batch size), and the same number "
        "of micro-steps per epoch.",
        details={"root_rank": root, "place": f"{name}:{schedule[1]}" if len(schedule) > 1 else site,
                 "seq": seq, "step": step, "micro_batches": {str(r): n for r, n in counts.items()},
                 "schedule": [f"{name}:{n}" for n in schedule], "ranks": evidence},
    )  # fmt: skip
