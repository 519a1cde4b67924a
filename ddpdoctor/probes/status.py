"""A live rank's status: the format of ``status-rank{R}.json``, declared once.

The rank's trace writer thread writes it (probes/liveness.py, probes/recent.py); the watcher,
the job board, `top` and `attach` read it (supervisor/statuses.py), and a hang report keeps the
ranks' statuses at the verdict (``hang-N/summary.json``), which the analysis reads back. All of
them go through ``RankStatus``: its fields and their defaults, and the values derived from
them (seconds in the current phase, steps started, the wait in a sync point), are defined here
and nowhere else. The JSON keys are the field names, so run directories written before this
class read the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor.trace.livephase import SYNC_LIVE_PHASES, LivePhase

STATUS_SCHEMA = "ddpdoctor.status/1"


@dataclass
class RankStatus:
    """One rank as it last described itself (times are wall clock seconds)."""

    rank: int
    world_size: int | None = None
    local_rank: int | None = None
    node: int | None = None  # torchrun's node rank (GROUP_RANK)
    host: str | None = None
    pid: int | None = None
    heartbeat_wall: float | None = None  # when the writer thread wrote this
    progress_wall: float | None = None  # when the rank's event count last moved
    exited: bool = False  # the final status of a clean exit
    step: int = -1  # the index of the last training step begun
    events: int = 0
    seq: int = -1  # the default group's collective sequence number
    # {name: a LivePhase value, op, seq, since_s, group, group_size, bytes, group_ranks, dtype,
    # numel, root, ranks}: the sync point it is in, as the probes entered it; None outside all.
    phase: dict[str, Any] | None = None
    max_step_s: float = 0.0  # its slowest step so far
    faulthandler: str | None = None  # where SIGUSR1 dumps its stacks, when it may be sent
    ptracer: bool = False
    error: dict[str, Any] | None = None  # {type, message, wall_ns} of an exception that killed it
    cpu_s: float | None = None
    steps_per_s: float | None = None  # over its last training steps (probes/recent.py)
    last_step_wall: float | None = None
    sync_wait_us: list[list[int]] | None = None  # [[step, µs in the last bucket's all-reduce]]
    last_collective: dict[str, Any] | None = None  # {op, seq, ago_s}
    fingerprints: list[dict[str, Any]] | None = None  # the last model fingerprint checks
    lost: str | None = None  # set by the job board: the node this rank was lost with
    schema: str = STATUS_SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)  # keys a newer ddpdoctor wrote

    def __post_init__(self) -> None:
        self.step, self.seq, self.events = int(self.step), int(self.seq), int(self.events)
        self.max_step_s = float(self.max_step_s)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankStatus:
        known = {k: v for k, v in d.items() if k in _FIELDS and v is not None}
        extra = {k: v for k, v in d.items() if k not in _FIELDS}
        try:
            return cls(**{**known, "rank": int(d.get("rank", -1))}, extra=extra)
        except (TypeError, ValueError):
            rank = d.get("rank")
            return cls(rank if isinstance(rank, int) else -1, extra=extra)  # a corrupt one: its rank

    @classmethod
    def of(cls, status: RankStatus | Mapping[str, Any]) -> RankStatus:
        """A status as read, or as a hang summary (or a test) holds its JSON."""
        return status if isinstance(status, RankStatus) else cls.from_json(status)

    def to_json(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in _FIELDS if f != "lost" or self.lost is not None}
        return {**out, **self.extra}

    @classmethod
    def read(cls, path: Path | str) -> RankStatus | None:
        """The status in ``path``; None while it is missing. A status caught mid-rewrite (its
        check fails: ``StatusFile``) is read again: a rewrite takes microseconds, and a rank
        missing from one look is one the watcher cannot place."""
        for _ in range(3):
            try:
                with open(path, "rb") as fh:
                    status = cls.read_bytes(fh.read())
            except OSError:
                return None
            if status is not None:
                return status
        return None

    @classmethod
    def read_bytes(cls, data: bytes) -> RankStatus | None:
        """A status file's content as ``read`` reads it."""
        text = data.rstrip()
        cut = text.rfind(_CHECK)
        if cut > 0 and text.endswith(b"}"):
            try:
                if zlib.crc32(text[:cut]) != int(text[cut + len(_CHECK) : -1]):
                    return None
            except ValueError:
                return None
            text = text[:cut] + b"}"
        try:
            d = json.loads(text)
        except ValueError:
            return None
        return cls.from_json(d) if isinstance(d, dict) else None

    def replace(self, **changes: Any) -> RankStatus:
        return dataclasses.replace(self, **changes)

    @property
    def steps(self) -> int:
        """Training steps begun (``step`` is the index of the last; -1 before any)."""
        return self.step + 1

    @property
    def live_phase(self) -> LivePhase | None:
        return LivePhase.of((self.phase or {}).get("name"))

    @property
    def in_sync(self) -> bool:
        """In a sync point: a phase in which another rank can block it."""
        return (self.phase or {}).get("name") in SYNC_LIVE_PHASES

    def age_s(self, now: float) -> float:
        """How old this status is at ``now``."""
        return max(0.0, now - float(self.heartbeat_wall or now))

    def in_phase_s(self, now: float | None = None) -> float:
        """Seconds in the current phase as of ``now`` (the status was written a little earlier)."""
        since = float((self.phase or {}).get("since_s") or 0.0)
        return since + (self.age_s(now) if now is not None else 0.0)

    def sync_wait_s(self, now: float) -> float:
        """How long the rank has been inside its current sync point (0 if it is in none)."""
        return self.in_phase_s(now) if self.in_sync else 0.0

    def waits_now(self, now: float, at_least_s: float = 1.0) -> bool:
        """In a sync point for ``at_least_s`` or more: someone the job is waiting with."""
        return self.in_sync and self.sync_wait_s(now) >= at_least_s


_FIELDS = tuple(f.name for f in dataclasses.fields(RankStatus) if f.name != "extra")
_CHECK = b',"crc32":'  # the last key: the CRC-32 of the text before it


class StatusFile:
    """A rank's status file, rewritten in place: one ``pwrite`` of the JSON, padded with spaces
    to the longest written so far, ending in the CRC-32 of the text before it. A reader that
    catches a rewrite half done finds the check wrong and reads the file again.

    Not a temporary file renamed over the status: on ext4 a rename over a file starts the
    writeback of the new one, 400 µs of the writer thread's CPU four times a second, the larger
    part of what recording costs a big step besides the events (docs/overhead.md). The first
    write is a rename, so that the file never exists empty."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.size = 0

    def write(self, status: RankStatus) -> None:
        body = json.dumps(status.to_json(), separators=(",", ":")).encode()[:-1]
        data = body + _CHECK + str(zlib.crc32(body)).encode() + b"}"
        if self.fd is None:
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
            self.fd, self.size = os.open(self.path, os.O_WRONLY), len(data)
            return
        self.size = max(self.size, len(data))
        os.pwrite(self.fd, data.ljust(self.size), 0)
