"""`top`'s frame as plain text: fixed-width columns, no colours or cursor moves, so it reads
the same on a terminal, over ssh and in a log."""

from __future__ import annotations

import time
from typing import Any

from ddpdoctor.analysis.findings import rank_list


def render(frame: dict[str, Any]) -> str:
    """One frame as plain text: no colours or cursor tricks, so it reads the same in a log."""
    lines = [f"ddpdoctor top  {time.strftime('%H:%M:%S', time.localtime(frame['time']))}"]
    for run in frame["runs"]:
        end = f", exit {run['exit_code']}" if run.get("exit_code") is not None else ""
        lines.append(f"  {run['dir']}: {run['status']}{end}")
    job = frame["job"]
    if not frame["ranks"]:
        lines.append("  no rank has written a status file yet")
        return "\n".join(lines)
    rate = f"{job['steps_per_s']:.2f} steps/s" if job["steps_per_s"] is not None else "steps/s unknown"
    quiet = (
        ""
        if job["finished"] or job["since_progress_s"] is None
        else f", last progress {job['since_progress_s']:.1f} s ago"
    )
    seen = f"{job['ranks_seen']}/{job['world_size']}" if job["world_size"] else str(job["ranks_seen"])
    slow = f", slowest rank {job['slowest_rank']}" if job["slowest_rank"] is not None else ""
    lo, hi = job["steps_min"], job["steps_max"]
    lines.append(f"job: {seen} ranks, {lo if lo == hi else f'{lo}-{hi}'} steps, {rate}{slow}{quiet}")
    head = (
        f"{'rank':>5} {'host':<12} {'pid':>7} {'state':<8} {'steps':>6} {'steps/s':>8}  {'in':<34} "
        f"{'for':>7}  {'last collective':<18} {'late/step':>9} {'gpu':>9}"
    )
    lines.append(head)
    for r in frame["ranks"]:
        lines.append(_row_text(r))
    if frame["findings"]:
        lines.append("findings:")
        for f in frame["findings"]:
            who = f" [{_ranks(f['ranks'])}]" if f.get("ranks") else ""
            text = f["text"].replace("\n", "\n    ")
            lines.append(f"  {f['kind']}{who}: {text}")
    return "\n".join(lines)


def _row_text(r: dict[str, Any]) -> str:
    where = f"{r['phase']} {r['op'] or ''}".strip() if r["phase"] else "-"
    since = f"{r['phase_s']:.1f}s" if r["phase_s"] is not None else ""
    last = f"{r['last_op']} #{r['last_seq']}" if r["last_op"] else "-"
    rate = f"{r['steps_per_s']:.2f}" if r["steps_per_s"] is not None else "-"
    late = f"{r['late_ms']:.1f}ms" if r["late_ms"] is not None else "-"
    gpu = r["gpu"]
    gtext = f"g{gpu['gpu']} {gpu['util']:.0f}%" if gpu else "-"
    host = str(r["host"] or "?")[:12]
    return (
        f"{r['rank']:>5} {host:<12} {r['pid'] or 0:>7} {r['state']:<8} {r['steps']:>6} {rate:>8}  "
        f"{where[:34]:<34} {since:>7}  {last[:18]:<18} {late:>9} {gtext:>9}"
    )


def _ranks(ranks: list[int]) -> str:
    return "rank " + rank_list(ranks)
