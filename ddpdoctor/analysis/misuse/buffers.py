"""Buffers that DDP does not sync: with ``broadcast_buffers=False`` each rank keeps its own.

BatchNorm's running statistics differ by design then (a note: evaluating or saving on one rank
uses that rank's own); any other buffer that differs is a warning, with the knob to turn or the
broadcast to add.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.misuse.fingerprints import Divergence, Series, sized, when_checked

_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


def buffers_differ(
    series: Series,
    found: list[Divergence],
    label: str,
    info: dict[str, Any],
    site: str,
    written: tuple[str, str] | None = None,
) -> Finding:
    """Buffers DDP does not sync, in the user's torch's words: ``forward_sync_buffers`` where
    the wrapper has it (``broadcast_buffers`` is its deprecated alias), at the line that built it,
    and the script's lines that write them in place (``written``: a module's own running
    statistics, updated from each rank's batch)."""
    names = [d.name for d in found]
    stats = all(n.rsplit(".", 1)[-1] in _BN_STATS for n in names)
    ranks = sorted({r for d in found for g in d.groups for r in g})
    what = "BatchNorm running statistics" if stats else "buffers"
    knob = (
        "forward_sync_buffers" if "forward_sync_buffers" in info.get("options", {}) else "broadcast_buffers"
    )
    built = f" (wrapped at {site})" if site else ""
    wrote = f"; the script writes them at {written[1]}" if written and not stats else ""
    return Finding(
        "buffers_differ",
        "info" if stats else "warning",
        ranks,
        f"{label}{built}: {len(names)} {what} differ across ranks since {when_checked(found[0].first)} "
        f"({sized(names, series.numels)}): {knob}=False keeps each rank's own"
        + (": expected, evaluation on each rank uses its own statistics" if stats else wrote),
        fix=f"Expected with {knob}=False. For the same statistics everywhere use "
        f"SyncBatchNorm (nn.SyncBatchNorm.convert_sync_batchnorm) or {knob}=True; evaluate "
        "or save on one rank knowing its statistics are its own."
        if stats
        else (
            f"Start at {written[0]}: update them from values every rank shares (all_reduce the batch's "
            "statistics first), or "
            if wrote and written
            else ""
        )
        + f"pass {knob}=True, or broadcast these buffers from rank 0 after changing them.",
        details={
            "model": series.model,
            "buffers": names,
            "since_step": found[0].first[0],
            "place": (written[0] if wrote and written else site) or None,
        },
    )
