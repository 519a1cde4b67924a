"""The Flight Recorder's view of a hang: per rank, the last collective that completed and the
first that did not, with op, sizes and sequence number.

Python stacks say where each CPU thread waits; the Flight Recorder says which collectives the
process group itself finished. Entries carry a ``state`` ("scheduled", "started",
"completed"; NCCL moves it as the device runs the collective when its timing is on) and
``retired`` once the work object finished. Gloo entries stay "scheduled" in torch 2.13, so
for them ``retired`` is what says completed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddpdoctor.probes import flight_recorder as _fr
from ddpdoctor.rundir import RunDir

MAX_TEXT_RANKS = 16  # the printed report names this many ranks; the details keep all


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "?")
    return name.split(":", 1)[1] if ":" in name else name


def _describe(entry: dict[str, Any]) -> dict[str, Any]:
    pg = entry.get("process_group") or ["?", "?"]
    fr_seq = entry.get("collective_seq_id")
    return {
        # ddpdoctor's number: the group's count before the collective began (the status files'
        # and the ledger's), one less than the Flight Recorder's own id, which counts from 1
        "seq": fr_seq - 1 if isinstance(fr_seq, int) else None,
        "fr_seq": fr_seq,
        "op": _op(entry),
        "sizes": entry.get("input_sizes"),
        "dtypes": entry.get("input_dtypes"),
        "group": pg[1] if isinstance(pg, list) and len(pg) > 1 else str(pg),
        "state": entry.get("state"),
        "p2p": bool(entry.get("is_p2p")),
    }


def completed(entry: dict[str, Any]) -> bool:
    return entry.get("state") == "completed" or bool(entry.get("retired"))


def summarise(dump: dict[str, Any]) -> dict[str, Any]:
    """{"last_completed", "first_pending"} (each None or a described entry), and "entries"."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict) and not e.get("is_p2p")]
    entries.sort(key=lambda e: int(e.get("record_id") or 0))
    done = [e for e in entries if completed(e)]
    pending = [e for e in entries if not completed(e)]
    return {
        "last_completed": _describe(done[-1]) if done else None,
        "first_pending": _describe(pending[0]) if pending else None,
        "entries": len(entries),
    }


def read_dumps(hang_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Each rank's summary from ``hang_dir/fr-rank{R}.json`` (a missing or bad file: left out)."""
    out: dict[int, dict[str, Any]] = {}
    hang_dir = Path(hang_dir)
    if not hang_dir.is_dir():
        return out
    for rank, path in RunDir.flight_dumps(hang_dir).items():
        try:
            dump = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(dump, dict):
            out[rank] = summarise(dump)
    return out


def _entry_text(e: dict[str, Any] | None) -> str:
    if e is None:
        return "none"
    sizes = e.get("sizes")
    shown = f" {sizes}" if sizes else ""
    return f"{e['op']} #{e['seq']}{shown}"


def lines(summaries: dict[int, dict[str, Any]]) -> list[str]:
    """One line per rank for the printed report."""
    out = []
    for rank in sorted(summaries)[:MAX_TEXT_RANKS]:
        s = summaries[rank]
        out.append(
            f"rank {rank}: last completed {_entry_text(s['last_completed'])}, "
            f"first not completed {_entry_text(s['first_pending'])}"
        )
    if len(summaries) > MAX_TEXT_RANKS:
        out.append(f"... and {len(summaries) - MAX_TEXT_RANKS} more ranks (hang summary)")
    return out


def on_hang(
    run_dir: Path, hang_dir: Path, statuses: dict[int, dict[str, Any]], timeout_s: float = 2.0
) -> str:
    """Supervisor: ask the ranks for their Flight Recorder entries, and return the lines to
    add to the printed hang report ("" when the Flight Recorder is off or nobody answered)."""
    try:
        env = _fr.environment(dict(os.environ))  # what job_environment gave the ranks
        if int(env.get(_fr.BUFFER_ENV) or 0) <= 0:
            return ""
        _fr.request_dumps(run_dir, hang_dir, sorted(statuses), timeout_s)
        found = lines(read_dumps(hang_dir))
    except Exception:
        return ""  # the hang report goes out with the stacks alone
    if not found:
        return ""
    return "\n  Flight Recorder (collectives the process group finished):\n" + "\n".join(
        f"    {line}" for line in found
    )


def parting(summaries: dict[int, dict[str, Any]]) -> str | None:
    """Where the process group's own records show the ranks parted (None where they do not):
    first unfinished collectives that differ in op or sizes at one sequence number, that sit at
    different sequence numbers, or a rank with nothing unfinished while others wait on it."""
    pending = {r: s.get("first_pending") for r, s in sorted(summaries.items())}
    waiting = {r: e for r, e in pending.items() if e is not None}
    if not waiting:
        return None
    idle = sorted(r for r, e in pending.items() if e is None)
    if idle:
        r = idle[0]
        return (
            f"rank(s) {', '.join(map(str, idle))} have no unfinished collective (rank {r}'s last: "
            f"{_entry_text(summaries[r].get('last_completed'))}) while rank(s) "
            f"{', '.join(map(str, waiting))} wait in {_entry_text(next(iter(waiting.values())))}"
        )
    seqs = {e.get("seq") for e in waiting.values()}
    kinds = {(e.get("op"), json.dumps(e.get("sizes"))) for e in waiting.values()}
    if len(seqs) > 1 or len(kinds) > 1:
        return "first unfinished collectives: " + "; ".join(
            f"rank {r} {_entry_text(e)}" for r, e in waiting.items()
        )
    return None


def merge(finding: Any, hang_dir: str | Path) -> Any:
    """Add the Flight Recorder's per-rank state to a hang finding (its details and message), and
    say whether the process group's own records confirm a hang the status files proved."""
    summaries = read_dumps(hang_dir) if hang_dir else {}
    if not summaries:
        return finding
    ranks = finding.details.setdefault("ranks", {})
    for rank, s in summaries.items():
        ranks.setdefault(str(rank), {})["flight_recorder"] = s
    finding.details["flight_recorder"] = {str(r): s for r, s in sorted(summaries.items())}
    finding.summary = finding.summary.rstrip() + " Flight Recorder: " + "; ".join(lines(summaries)) + "."
    proof = str(finding.details.get("proof") or "")
    if proof and not proof.startswith("busy: "):  # a proven hang, not a busy rank past the timeout
        parted = parting(summaries)
        finding.details["flight_recorder_confirms"] = parted is not None
        finding.summary += (
            f" The Flight Recorder confirms the proof ({parted})."
            if parted
            else " The Flight Recorder does not show the ranks parting: its entries may predate the "
            "stall or the proof may rest on a transient state; read the stacks."
        )
    return finding
