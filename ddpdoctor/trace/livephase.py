"""Where a live rank is: the phases its status names (``phase.name`` in status-rank{R}.json).

The probes enter them around each sync point (probes/collector.py ``enter``); the watcher's
proof, the hang diagnosis, `top`, `attach`, the ledger and the failure view read them. Each
phase is one declaration here, so a new one is one member: what it is called, the op its ranks
meet in, how it waits, where a rank in it stands in the user's code, and which spans it stands
for on the timeline (the span kinds themselves are trace/schema.py's).
"""

from __future__ import annotations

import enum
from typing import Any

from ddpdoctor.trace import schema
from ddpdoctor.trace.schema import Lane


class LivePhase(str, enum.Enum):
    """Where a live rank is, as its status file says (``phase.name``): set by the probes around
    each sync point, read by the supervisor's hang watch, `top`, `attach` and the failure
    view. One declaration per phase: its value, its name in the user's words, the op its ranks
    meet in (None: the status' own op), how it waits (see analysis/hung/proof.py), where a
    rank in it stands in the user's code, and the spans it stands for on the timeline."""

    def __new__(
        cls,
        value: str,
        label: str,
        op: str | None,
        waits: str | None,
        where: str,
        spans: tuple[tuple[str, Lane], ...],
    ) -> LivePhase:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label  # "gradient all-reduce"; "" for a collective: its op names it
        member.op = op  # the op every rank compares: "broadcast", "allreduce"
        # "atomic": one collective call, exactly this op at exactly this sequence number;
        # "compound": DDP's own pass, entered at #n, may issue #n, #n+1, ...; None: no peer.
        member.waits = waits
        member.where = where  # format with op (the status') and num ("collective #12")
        member.spans = spans  # (kind, lane), outermost first
        return member

    label: str
    op: str | None
    waits: str | None
    where: str
    spans: tuple[tuple[str, Lane], ...]

    FORWARD = (
        "forward",
        "DDP forward",
        None,
        "compound",
        "DistributedDataParallel.forward ({op} mode, {num})",
        ((schema.FORWARD, Lane.COMPUTE),),
    )
    SYNC_BUFFERS = (
        "sync_buffers",
        "buffer broadcast",
        "broadcast",
        "atomic",
        "DistributedDataParallel.forward -> _sync_buffers (broadcast, {num})",
        ((schema.FORWARD, Lane.COMPUTE), (schema.SYNC_BUFFERS, Lane.COMM)),
    )
    BACKWARD = (
        "backward",
        "gradient all-reduce",
        "allreduce",
        "compound",
        "backward -> DDP gradient all-reduce ({num})",
        ((schema.BACKWARD, Lane.COMPUTE), (schema.ALLREDUCE, Lane.COMM)),
    )
    COLLECTIVE = (
        "collective",
        "",
        None,
        "atomic",
        "dist.{op}() ({num})",
        ((schema.COLLECTIVE, Lane.COMPUTE),),
    )
    # DistributedDataParallel's constructor: collectives of its group (the parameter shapes'
    # all_gather, rank 0's state broadcast) from C++, so no collective probe sees them.
    DDP_INIT = (
        "ddp_init",
        "DDP constructor",
        None,
        "compound",
        "DistributedDataParallel.__init__ (shape check and state broadcast, from {num})",
        ((schema.DDP_INIT, Lane.COMPUTE),),
    )
    DATA = (
        "data",
        "DataLoader wait",
        "next",
        None,
        "DataLoader.__next__ (waiting for a batch)",
        ((schema.DATA_WAIT, Lane.COMPUTE),),
    )

    @classmethod
    def of(cls, name: Any) -> LivePhase | None:
        """The member a status' ``phase.name`` names; None for none (or one a newer ddpdoctor wrote)."""
        try:
            return cls(name)
        except ValueError:
            return None

    @property
    def waits_for_peers(self) -> bool:
        """A rank here can be blocked by another rank (a DataLoader wait cannot)."""
        return self.waits is not None

    def status(self) -> dict[str, Any]:
        """The ``phase`` of a status file for this phase, before its sequence number and time."""
        return {"name": self.value, "op": self.op}


SYNC_LIVE_PHASES = frozenset(p.value for p in LivePhase if p.waits_for_peers)
