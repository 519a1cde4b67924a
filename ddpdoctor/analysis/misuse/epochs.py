"""A missing ``set_epoch``, judged by effect (``usage.sampler_misuse`` finds the passes): a
shuffling sampler whose passes replay one order, and an epoch set that no new pass followed."""

from __future__ import annotations

import ast
import os
from typing import Any

from ddpdoctor.analysis.failed.source import holding, statement
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.trace import schema
from ddpdoctor.trace.rankfile import RankTrace


def epoch_loop(trace: RankTrace, stack: list[str]) -> tuple[str, str] | None:
    """("file:line", its first line) of the loop that holds the loader's pass: the innermost loop
    around the line that began the pass (``stack``: "file:line func" of that line and the user's
    lines that called it, innermost first), in the function of the first frame that has one;
    the pass's own ``for`` is not it. None without the file or such a loop."""
    sites = trace.meta.get(schema.SITE, [])
    paths = {os.path.basename(str(i.get("file"))): str(i.get("file")) for _, _, i in sites}
    for frame in stack:
        name, _, line = frame.split(" ")[0].rpartition(":")
        path = paths.get(name)
        if path is None or not line.isdigit():
            continue
        chain = holding(path, int(line))
        defs = [i for i, n in enumerate(chain) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inside = chain[defs[-1] + 1 :] if defs else chain
        loops = [n for n in inside if isinstance(n, (ast.For, ast.While)) and n.lineno < int(line)]
        if loops:
            return f"{name}:{loops[-1].lineno}", statement(loops[-1])
    return None


def no_epoch_finding(no_epoch: dict[int, dict[str, Any]]) -> Finding:
    """Passes of a shuffling DistributedSampler that replay one order: where it was made, and
    what set_epoch calls it had (none, one, the same epoch each time, or on another sampler)."""
    info = next(iter(no_epoch.values()))
    created = f" created at {info['sampler_site']}" if info.get("sampler_site") else ""
    elsewhere = info.get("set_epoch_elsewhere") or {}
    other = ""
    fix = "Call sampler.set_epoch(epoch) at the start of each epoch, before iterating the DataLoader."
    place = info.get("sampler_site") or info.get("site")
    calls, set_site = info.get("set_epoch_calls") or 0, info.get("set_epoch_site")
    loop = info.get("epoch_loop")
    if not calls and not elsewhere.get("site") and loop:  # never called: where the call goes
        other = f"; the loop at {loop[0]} (`{loop[1]}`) begins each pass and never calls set_epoch"
        fix = (
            f"Call sampler.set_epoch(epoch) first thing in the loop at {loop[0]} (`{loop[1]}`), "
            "before the DataLoader is iterated, with that loop's epoch number."
        )
        place = loop[0]
    if calls and set_site and info.get("one_epoch"):  # called, but not with each epoch
        place = set_site
        if calls == 1:
            other = f"; set_epoch ran once, at {set_site}, not once per epoch"
            fix = (
                f"Move the set_epoch call at {set_site} into the epoch loop: call "
                "sampler.set_epoch(epoch) at the start of each epoch, before iterating the "
                "DataLoader (once, before the loop, sets the first epoch only)."
            )
        else:
            other = f"; set_epoch ran {calls} times at {set_site}, each time with epoch {info.get('epoch')}"
            fix = (
                f"Pass the epoch loop's own counter to the set_epoch call at {set_site}: it "
                "passes the same value every time, so the shuffle never changes."
            )
    elif elsewhere.get("site"):
        mine = f" (the one{created})" if created else ""
        of = f" created at {elsewhere['sampler_site']}" if elsewhere.get("sampler_site") else ""
        other = f"; set_epoch was called at {elsewhere['site']}, but on another DistributedSampler{of}"
        fix = (
            f"Call set_epoch on the training loader's sampler{mine}: the call at "
            f"{elsewhere['site']} reaches another sampler{of} (a name reused, or the "
            "validation loader's). Keep a separate name for each sampler, or call "
            "train_loader.sampler.set_epoch(epoch)."
        )
    return Finding(
        "missing_set_epoch",
        "warning",
        sorted(no_epoch),
        f"the shuffling {info.get('sampler')}{created} "
        + (
            f"began {info['passes']} passes over the data with the same batches"
            if info["proven"]
            else f"stayed at epoch {info.get('epoch')} for all {info['passes']} passes over the data"
        )
        + f": every epoch replays the same order{other}",
        fix=fix,
        details={
            "epoch": info.get("epoch"),
            "passes": info["passes"],
            "ranks": sorted(no_epoch),
            "place": place,
            "loop": info.get("site"),
            "epoch_loop": loop[0] if loop else None,
            "same_batches": info["proven"],  # False: judged by the sampler's epoch alone
            "set_epoch_elsewhere": elsewhere or None,
        },
    )


def replayed(unread: dict[int, dict[str, Any]]) -> Finding:
    """set_epoch reached the sampler, but the loader was never iterated again: the epochs after
    are a replay of batches read before, whatever the sampler was told."""
    info = next(iter(unread.values()))
    epochs = ", ".join(str(e) for e in info["unread"])
    which = "its only pass" if info["passes"] == 1 else f"its last pass (of {info['passes']})"
    began = f" at {info['site']}" if info.get("site") else ""
    return Finding(
        "missing_set_epoch",
        "warning",
        sorted(unread),
        f"set_epoch({epochs}) reached the training DataLoader's {info.get('sampler')}"
        + (f" at {info['set_at']}" if info.get("set_at") else "")
        + f", but no pass of the loader began after it: {which} began{began}, and the rank "
        f"trained {info['trained']} steps after the first new epoch was set, "
        f"{info['trained'] / info['batches']:.1f}x the {info['batches']} batches of a pass. Those "
        "steps replayed batches already read, in the same order (itertools.cycle over the "
        "loader, or its batches kept in a list): every epoch after it repeats the first",
        fix="Start a new pass of the DataLoader for each epoch: iterate the loader again after "
        "sampler.set_epoch(epoch) (`for batch in loader:` inside the epoch loop; in a step-based "
        "loop, a generator that calls set_epoch and then iterates the loader anew each time it "
        "ends). itertools.cycle(loader) and list(loader) keep the first pass's batches and "
        "replay them, whatever the sampler's epoch.",
        details={
            "place": info.get("site"),
            "set_epoch_site": info.get("set_at"),
            "epochs_unread": info["unread"],
            "after_step": info["after_step"],
            "steps_after": info["trained"],
            "batches_per_pass": info["batches"],
            "ranks": sorted(unread),
        },
    )
