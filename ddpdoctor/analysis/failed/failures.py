"""Detectors for what `ddpdoctor run` saw go wrong live: hangs and failed ranks.

``rank_failure`` supersedes the old ``job_failed``: it names the rank that failed first, with
its exception and traceback (recorded in-rank by ``probes/liveness.py``, so torchrun's
``@record`` is not needed) or the signal that killed it, and what the other ranks were doing.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from typing import Any

from ddpdoctor.analysis.failed.endings import is_consequence, last_step_started
from ddpdoctor.analysis.failed.stacks import death_stack, frame_text, raised_where, recorded_place, user_code
from ddpdoctor.analysis.findings import Finding, clip, detector, rank_list
from ddpdoctor.analysis.hung.hang import hang_finding
from ddpdoctor.analysis.misuse import frameworks
from ddpdoctor.rundir import RunDir
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run
from ddpdoctor.trace.stacktext import is_doctor_frame


@detector
def hangs(run: Run) -> Iterable[Finding]:
    from ddpdoctor.analysis.hung.threads import dead_thread
    from ddpdoctor.analysis.hung.waits import went_on  # the job outlived it: rank_only_work says what

    for summary in run.hangs:
        if went_on(summary, run):
            continue
        finding = hang_finding(summary)
        if finding is not None:
            yield dead_thread(finding, run)


def _signal_name(sig: int | None) -> str:
    if not sig:
        return "a signal"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


_WORKER_KILLED_FIX = (
    "A worker killed by a signal is most often out of memory (the kernel's OOM killer sends "
    "SIGKILL; SIGBUS means /dev/shm is full): lower num_workers or prefetch_factor, make each "
    "sample smaller or load it lazily, avoid copying a large dataset object into every worker "
    "(keep it in a file or memory map; persistent_workers=True keeps them from being forked "
    "again each epoch), raise the container's memory or shared-memory limit (--shm-size); "
    "dmesg | grep -i 'killed process' confirms the OOM killer."
)
# Errors whose text says what happened better than "fix the exception": (pattern over the
# message and its chained causes, what it means, the fix). Each fix is the cause's own. A
# worker's death surfaces as the SIGCHLD handler's "killed by signal", or, when the worker
# died while the rank fetched the tensor it had shared (its file descriptor, through the
# worker's connection), as that connection's error inside torch's rebuild_storage_fd.
_KNOWN_ERRORS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: ([^.\n]+)"),
        "a DataLoader worker process{2} was killed by a signal ({0}){1}, not an error in the code",
        _WORKER_KILLED_FIX,
    ),
    (
        re.compile(
            r"dataloader\.py[^\n]*\n(?:.*\n)*?.*in rebuild_storage_\w+\n(?:.*\n)*?"
            r"(ConnectionResetError|ConnectionRefusedError|EOFError|FileNotFoundError)\b"
        ),
        "a DataLoader worker process{2} died while the rank took a batch from it (its connection "
        "ended: {0}), not an error in the code",
        _WORKER_KILLED_FIX,
    ),
    (
        re.compile(r"DataLoader worker \(pid\(s\) [^)]*\) (exited) unexpectedly"),
        "a DataLoader worker process{2} {0} without a Python error (a signal, most often the OOM "
        "killer's SIGKILL, or os._exit), not an error in the code",
        _WORKER_KILLED_FIX,
    ),
)
_SIGNAL_TEXT = {
    "Killed": "SIGKILL",
    "Bus error": "SIGBUS",
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
}
_FAULTS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL")  # faulthandler's: a Python stack if enabled


def known_error(error: dict[str, Any], loader: str = "") -> tuple[str, str] | None:
    """(what the error means, its fix) when its text is one of the known causes above;
    ``loader``: where the rank iterated the DataLoader it was reading ("train.py:35")."""
    text = f"{error.get('message', '')}\n{error.get('traceback', '')}"
    for pattern, meaning, fix in _KNOWN_ERRORS:
        m = pattern.search(text)
        if m:
            said = m.group(1).strip()
            name = _SIGNAL_TEXT.get(said, said)
            of = f" of the DataLoader iterated at {loader}" if loader else ""
            return meaning.format(name, f', "{said}"' if name != said else "", of), fix
    return None


def _loading(error: dict[str, Any]) -> bool:
    """Raised through the data probe's ``__next__`` and beyond it: in the dataset, the sampler or
    the collate_fn (a DataLoader worker's error is re-raised there too)."""
    frames = [list(f) for f in error.get("frames") or [] if isinstance(f, (list, tuple)) and len(f) >= 3]
    at = next((i for i, f in enumerate(frames) if f[2] == "__next__" and is_doctor_frame(str(f[0]))), None)
    return at is not None and at < len(frames) - 1


def loader_site(trace: RankTrace | None) -> str:
    """Where the rank iterated the DataLoader it was reading when it failed: the loader of the
    data wait that raised, else of its last pass begun. A worker's death surfaces wherever the
    main thread is when its SIGCHLD arrives (in the forward, in the backward); the loader is the
    place that matters."""
    if trace is None:
        return ""
    loaders = [info for _, _, info in trace.meta.get(schema.LOADER, [])]
    waits = [
        i.get("fields") or [None]
        for _, _, i in trace.meta.get(schema.RAISED, [])
        if i.get("kind") == schema.DATA_WAIT
    ]
    chosen = next((i for i in reversed(loaders) if waits and i.get("id") == waits[-1][0]), None)
    chosen = chosen or (loaders[-1] if loaders else {})
    return str(chosen.get("site") or "")


@detector
def rank_failure(run: Run) -> Iterable[Finding]:
    code = run.exit_code
    watch: dict[str, Any] = {}
    for w in run.watches:
        for key in ("rank_exits", "rank_errors"):
            watch.setdefault(key, {}).update(w.get(key) or {})
        watch["killed_on_hang"] = watch.get("killed_on_hang") or w.get("killed_on_hang")
    if watch.get("killed_on_hang"):
        return  # ddpdoctor stopped a hung job: the hang finding says why
    # (wall seconds, rank, error record or None, signal-or-None, consequence?)
    candidates: list[tuple[float, int, dict[str, Any] | None, int | None, bool]] = []
    errors: dict[int, dict[str, Any]] = {}
    for rank, trace in sorted(run.ranks.items()):
        records = trace.meta.get(schema.RANK_ERROR, [])
        recs = [info for _, _, info in records if info.get("thread") == "MainThread"]
        if recs:
            errors[rank] = recs[0]
            candidates.append((recs[0].get("wall_ns", 0) / 1e9, rank, recs[0], None, is_consequence(recs[0])))
    ends = _ends(run)
    for key, exit_info in (watch.get("rank_exits") or {}).items():
        rank = int(key)
        trace = run.ranks.get(rank)
        end = ends.get(key) or {}
        if rank in errors or (trace is not None and trace.ended_cleanly and not _coded(end)):
            continue  # raised (reported above) or closed its trace: it was not killed outright
        if end.get("how") == "exit" and end.get("initialised") is not False and not _coded(end):
            continue  # a clean exit whose trace could not be written or read (a full disk)
        # When it died, as its own last words say; its last heartbeat (4 a second) can precede
        # the death of a rank that died first. The launcher stopping it after another failed is
        # a consequence, as its own error would be.
        when = float(
            end.get("at_wall") or exit_info.get("last_heartbeat_wall") or exit_info.get("seen_wall") or 0.0
        )
        candidates.append((when, rank, None, exit_info.get("signal") or None, bool(end.get("consequence"))))
    known = {c[1] for c in candidates}
    for key, end in ends.items():
        rank = int(key)
        if (
            rank in known
            or rank in errors
            or (end.get("how") in ("exit", "exception") and not _coded(end))
            or end.get("consequence")
        ):
            continue  # a short job ends before the watcher's next look: the rank's own files say it
        candidates.append((float(end.get("at_wall") or 0.0), rank, None, _signal_number(end), False))
    if not candidates and not code:
        return
    unclean = [r for r, t in sorted(run.ranks.items()) if not t.ended_cleanly]
    if not candidates and not unclean and run.stopped_lingering:
        return  # every rank here exited cleanly; the user's Ctrl-C stopped the lingering launcher
    last_step = {str(r): last_step_started(t) for r, t in run.ranks.items()}
    details: dict[str, Any] = {"exit_code": code, "unclean_ranks": unclean, "last_step": last_step}
    if not candidates:
        summary = f"the job exited with code {code}"
        if code is not None and code > 128:
            summary += f" (killed by signal {code - 128})"
        if unclean:
            summary += f"; rank(s) {rank_list(unclean)} stopped recording without a clean exit"
        yield Finding(
            "rank_failure",
            "error",
            unclean or sorted(run.ranks),
            summary,
            fix="Read the first traceback in the job's output (the earliest failing rank is the cause; "
            "the others are usually torchrun stopping them).",
            details=details,
        )
        return
    candidates.sort(key=lambda c: (c[4], c[0]))  # own errors first, then the earliest
    when, rank, error, sig, _ = candidates[0]
    step = last_step.get(str(rank), -1)
    for seen in (
        (watch.get("rank_exits") or {}).get(str(rank)),
        (watch.get("rank_errors") or {}).get(str(rank)),
    ):
        if seen and isinstance(seen.get("step"), int):
            step = max(step, seen["step"])  # the trace may miss the last flush interval
    others = _others(watch, rank, errors)
    details.update(first_rank=rank, at_step=step, others=others, failed_wall=when)
    at = f"at step {step}" if step >= 0 else "before its first recorded step"
    if error is not None:
        frames, handler = error.get("frames") or [], error.get("signal_handler")
        summary = (
            f"rank {rank} failed first {at}: {error.get('type')}: "
            f"{clip(str(error.get('message', '')).splitlines()[0], 200) if error.get('message') else ''}"
            f"{raised_where(frames, handler)}"
        )
        raised_at = raised_where(frames).split(", inside ")[0].replace(" (", " at ", 1)
        who = f"rank {rank}"
        if isinstance(handler, int) and 0 < handler < len(frames):  # where the signal came in
            who = f"rank {rank}'s signal handler"
            details["place"] = recorded_place(frames[:handler])
            raised_at = f" at {frame_text(frames[handler])} while the rank ran {details['place'] or '?'}"
        code = user_code(frames) if who == f"rank {rank}" else ""
        fix = (
            f"Fix the {error.get('type') or 'exception'} that {who} raised"
            f"{raised_at.rstrip(')')}{f' (`{code}`)' if code else ''} (traceback in "
            "the job's output and in this finding); the other ranks' errors are consequences of it."
        )
        if _loading(error):
            fix += (
                " It was raised while loading a batch, most likely by a sample only in rank "
                f"{rank}'s shard: find it, then fix or filter it where the data is prepared, or let "
                "the dataset or collate_fn handle it (truncate, skip or drop the sample)."
            )
        loader = loader_site(run.ranks.get(rank))
        known = known_error(error, loader)
        if known is not None:
            summary, fix = f"{summary}: {known[0]}", known[1]
            details["place"] = loader or recorded_place(error.get("frames") or [])
        details["exception"] = {k: error.get(k) for k in ("type", "message", "traceback", "frames")}
    elif ends.get(str(rank), {}).get("how") == "os_exit":
        frames = ends[str(rank)].get("frames") or []
        where = raised_where(frames)
        summary = f"rank {rank} called os._exit({ends[str(rank)].get('code')}) {at}{where}"
        fix = (
            f"os._exit skips every cleanup, and the other ranks lose their peer: find why rank {rank} "
            f"exits there{where} (its last stderr lines below), and raise an exception instead, "
            "so that the launcher stops the job with a traceback."
        )
        if frames:
            details["place"] = recorded_place(frames)
    elif _coded(ends.get(str(rank), {})):
        code, source = ends[str(rank)]["code"], ends[str(rank)].get("source") or ""
        frames = ends[str(rank)].get("frames") or []
        where = raised_where(frames)
        summary = f"rank {rank} exited with code {code} {at}{where}" + (f": {source}" if source else "")
        summary += "; the others lost their peer"
        call = f"sys.exit({code}) (or raises SystemExit)" if "native" not in source else f"exit({code})"
        place = f"why rank {rank} exits there{where}" if frames else f"where rank {rank} calls {call}"
        if frames:
            details["place"] = recorded_place(frames)
        fix = (
            f"Find {place} after step {step} "
            "(its last stderr lines may say why). A rank that must stop should raise an exception, so "
            "that the launcher prints its traceback, or every rank should agree to stop together (an "
            "all_reduce of the flag), so that none waits for a peer that left."
        )
    else:
        end = ends.get(str(rank), {})
        sig = _signal_number(end) or sig  # the rank's own record beats the watcher's glimpse
        how = _signal_name(sig) if sig else "a signal (SIGKILL or the kernel's OOM killer)"
        if end.get("source"):
            how += f" ({end['source']})"
        frames = [(f.get("file"), f.get("line"), f.get("function")) for f in reversed(death_stack(run, rank))]
        where = raised_where(frames)  # a fatal signal raised inside the rank: where its Python was
        summary = (
            f"rank {rank} was killed by {how} {at}{where}: it raised no Python exception and did not "
            "exit cleanly"
        )
        fix = frameworks.advice(_signal_name(sig) if sig else "SIGKILL")
        if end.get("stack"):  # a fatal signal raised inside the rank, not a kill from outside
            fix += f" Start at the last Python line it ran{where}; " if where else " "
            fix += f"its whole stack at the crash is in fatal-rank{rank}.txt in the run directory."
            details["place"] = recorded_place(frames)
        elif _signal_name(sig) in _FAULTS:
            fix += " Run that rank with PYTHONFAULTHANDLER=1 to get its Python stack."
        details["signal"] = sig
        details["killed_by_signal"] = True
    end = ends.get(str(rank))
    if end:
        details["end"] = {k: v for k, v in end.items() if k != "words"}
        details["dying_words"] = end.get("words") or []
        if end.get("words"):
            words = " | ".join(w.strip() for w in end["words"][-3:])[-600:]
            summary += ". Its last stderr lines: " + words.rstrip(".")
    if others:
        doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(others.items(), key=lambda kv: int(kv[0])))
        summary += f". Others then: {doing}"
    yield Finding("rank_failure", "error", [rank], summary, fix=fix, details=details)


def _ends(run: Run) -> dict[str, Any]:
    """ends.json of every run dir (supervisor/ends.py): how each rank ended, its dying words."""
    out: dict[str, Any] = {}
    for d in run.dirs:
        try:
            with open(RunDir(d) / RunDir.ENDS, encoding="utf-8") as fh:
                out.update(json.load(fh).get("ranks") or {})
        except (OSError, ValueError, AttributeError):
            continue
    return out


def _coded(end: dict[str, Any]) -> bool:
    """Python's own exit with a non-zero status (sys.exit(3)): a failure with no traceback."""
    return end.get("how") == "exit" and bool(end.get("code"))


def _signal_number(end: dict[str, Any]) -> int | None:
    name = end.get("signal")
    try:
        return int(signal.Signals[name]) if name else None
    except KeyError:
        return None


def _others(watch: dict[str, Any], failed: int, errors: dict[int, dict[str, Any]]) -> dict[str, str]:
    """What the other ranks were doing when the failure was seen (the watcher's snapshot)."""
    seen = (watch.get("rank_errors") or {}).get(str(failed)) or (watch.get("rank_exits") or {}).get(
        str(failed)
    )
    out: dict[str, str] = {}
    for rank, snap in ((seen or {}).get("others") or {}).items():
        phase, op, seq = snap.get("phase"), snap.get("op"), snap.get("seq")
        if not phase:
            what = f"in user code at step {snap.get('step')}"
        elif phase == "collective":
            what = f"in dist.{op}() (collective #{seq})"
        else:
            what = f"in {phase} ({op}, collective #{seq})"
        err = errors.get(int(rank))
        if err is not None:
            what += f", then raised {err.get('type')}"
        out[rank] = what
    return out


@detector
def model_differs(run: Run) -> Iterable[Finding]:
    """DDP's constructor refused models that differ by rank: the shapes side by side, the first
    parameter and the module that differ (each rank kept its shapes as the constructor raised)."""
    shapes: dict[int, list[list[Any]]] = {}
    places: dict[int, str] = {}
    for rank, trace in sorted(run.ranks.items()):
        for _, _, info in trace.meta.get(schema.DDP_ERROR, []):
            if info.get("error") == "ddp_init" and isinstance(info.get("shapes"), list):
                shapes[rank] = info["shapes"]
        for _, _, err in trace.meta.get(schema.RANK_ERROR, [])[:1]:
            places[rank] = recorded_place(err.get("frames") or [])
    if len(shapes) < 2:
        return
    ranks = sorted(shapes)
    table = {r: {str(p[0]): (list(p[1]), str(p[2])) for p in shapes[r]} for r in ranks}
    names = list(dict.fromkeys(n for r in ranks for n in table[r]))
    differ = [n for n in names if len({str(table[r].get(n, (None,))[0]) for r in ranks}) > 1]
    if not differ:
        return
    first = differ[0]
    owner = next((table[r][first][1] for r in ranks if first in table[r]), "?")
    module = first.rsplit(".", 1)[0] if "." in first else "(top level)"
    side = "; ".join(
        f"{n}: " + ", ".join(f"rank {r} {table[r][n][0] if n in table[r] else 'absent'}" for r in ranks)
        for n in differ[:4]
    )
    place = next((places[r] for r in ranks if places.get(r)), "")
    at = f" at {place}" if place else ""
    yield Finding(
        "model_differs",
        "error",
        ranks,
        f"the ranks built different models, and DDP's constructor{at} refused them: module "
        f"{module!r} ({owner}) differs: {side}"
        + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""),
        fix=f"Build the same model on every rank: {module!r} ({owner}) is built from a value that "
        "differs by rank (a config or file read per rank, a rank-dependent branch); read it on rank "
        "0 and share it (dist.broadcast_object_list) or derive it from the same inputs everywhere.",
        details={"root_rank": None, "place": place, "module": module, "parameters": differ,
                 "shapes": {str(r): {n: table[r].get(n, (None,))[0] for n in differ} for r in ranks}},
    )  # fmt: skip
