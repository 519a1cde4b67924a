"""Stacks as text, parsed: py-spy's JSON dump and faulthandler's dump, into threads of frames.

Pure text parsers, below the supervisor that takes the dumps and the analysis that reads the
ones a run directory keeps (a dead rank's fatal stack in ends.json).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import ddpdoctor

# ddpdoctor's own files, wherever it is installed (its probes sit in every rank's stack).
DOCTOR_DIR = os.path.dirname(os.path.abspath(ddpdoctor.__file__)) + os.sep
_LIBRARY_MARKERS = ("site-packages", "dist-packages", "<frozen", os.sep + "lib" + os.sep + "python3")
# ddpdoctor's in-rank code wherever the run was recorded: a run recorded by one checkout and
# read by another (a cluster's install, a laptop's) names the recorder's files.
_DOCTOR_MARKERS = tuple(
    os.sep + os.path.join("ddpdoctor", part, "") for part in ("probes", "bootstrap", "trace")
)


def is_doctor_frame(filename: str) -> bool:
    """ddpdoctor's own code: this install's, or the in-rank code of the install that recorded
    the run (its probes sit in every rank's stack). The one rule for "ddpdoctor's frame"."""
    return filename.startswith(DOCTOR_DIR) or any(marker in filename for marker in _DOCTOR_MARKERS)


def is_user_frame(filename: str) -> bool:
    """Code the user wrote: not the standard library, an installed package or ddpdoctor. The one
    rule for "the user's frame" everywhere a stack is read."""
    if not filename or filename.startswith("<") or is_doctor_frame(filename):
        return False
    if filename.endswith(_COMPILED):  # a compiled extension's source, named relative to its package
        return False
    return not any(marker in filename for marker in _LIBRARY_MARKERS)


_COMPILED = (".pyx", ".pxd", ".pxi")  # Cython: numpy.random's `_bounded_integers.pyx`, not the script


# Calls that may wait for peers when a rank's own code makes them: a collective (its probe or
# torch.distributed itself), a future of one, or a device synchronisation (the stream may hold
# an NCCL kernel waiting for a peer): never counted as the rank's own code.
_PEER_WAIT_MARKERS = tuple(
    os.sep + os.path.join("torch", part, "") for part in ("distributed", "futures", "cuda")
)


def runs_own_code(frames: list[dict[str, Any]]) -> bool:
    """Inside a DDP pass its probe wrapped (a forward, a backward), is the rank running the
    user's own code (a custom autograd Function, a hook, a module's forward) rather than
    waiting for its peers? ``frames`` innermost first: the innermost user frame lies inside
    a ddpdoctor frame (the pass) and no call inside it waits for peers. A rank whose CPU is idle
    there is blocked in its own code (a lock, a sleep, a read), not in the gradient all-reduce."""
    for i, frame in enumerate(frames):
        name = str(frame.get("file") or "")
        if is_user_frame(name):
            inner = (str(f.get("file") or "") for f in frames[:i])
            if any(is_doctor_frame(f) or any(m in f for m in _PEER_WAIT_MARKERS) for f in inner):
                return False
            return any(is_doctor_frame(str(f.get("file") or "")) for f in frames[i + 1 :])
    return False


def parse_pyspy_json(text: str) -> dict[str, Any]:
    """``py-spy dump --json`` output as a dump: threads with their frames (innermost first)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return {"method": None, "threads": [], "error": "py-spy printed no JSON"}
    threads = [
        {
            "name": t.get("thread_name") or str(t.get("thread_id")),
            "active": bool(t.get("active")),
            "frames": [
                {"file": f.get("filename"), "line": f.get("line"), "function": f.get("name")}
                for f in t.get("frames") or []
            ],
        }
        for t in raw
        if isinstance(t, dict)
    ]
    return {"method": "py-spy", "threads": threads, "error": ""}


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[dict[str, Any]]:
    """Parse one faulthandler dump into threads (frames innermost first, as it prints them)."""
    blocks: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            blocks.append({"name": m.group(2), "frames": []})
            continue
        f = _FRAME.match(line)
        if f and blocks:
            blocks[-1]["frames"].append({"file": f.group(1), "line": int(f.group(2)), "function": f.group(3)})
    # faulthandler names no thread; the one whose outermost frame is <module> runs the script.
    for b in blocks:
        if b["frames"] and b["frames"][-1]["function"] == "<module>":
            b["name"] = "MainThread"
    return blocks
