"""What a ledger holds: the sync points a rank issued (``Point``), and the rank's ledger
(``Ledger``): its points in order, its steps, data passes and ending. ``ledger.build`` fills
them from each rank's records; ``parting`` compares them across ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ddpdoctor.analysis.failed.endings import Ending
from ddpdoctor.analysis.failed.passes import Pass
from ddpdoctor.analysis.failed.stacks import Frame
from ddpdoctor.trace.livephase import LivePhase

# DDP's own sync points, as ledger ops: the live phases' names in the user's words.
GRAD_ALLREDUCE = LivePhase.BACKWARD.label
BUFFERS = LivePhase.SYNC_BUFFERS.label
FORWARD = LivePhase.FORWARD.label


def is_ddp(point: Point | None) -> bool:
    """One of DDP's own sync points (its gradient all-reduce, buffer broadcast, forward), not a
    collective the job's code issued."""
    return point is not None and point.op.startswith((GRAD_ALLREDUCE, BUFFERS, FORWARD))


@dataclass(slots=True)
class Point:
    """One sync point a rank issued (or was inside when the job was stopped)."""

    seq: int  # the process group's collective sequence number at entry (-1: unknown)
    op: str  # a dist op name, or GRAD_ALLREDUCE / BUFFERS / FORWARD
    nbytes: int
    group: str
    step: int
    site: str  # the user's file:line, "" when unknown
    ts: int = 0
    in_flight: bool = False
    died_in: bool = False  # the rank died inside it (its death stack), seq: the next after its last
    # It raised (a ``raised`` record): not completed, but its op and size are the recorded ones,
    # so it still counts where ranks are compared (a size mismatch that made gloo raise).
    raised: bool = False
    dtype: str = ""  # the rest of a Python collective's signature ("", 0, -1, None: not recorded)
    numel: int = 0
    root: int = -1
    ranks: str | None = None  # the group's global ranks ("0 1"), "" for WORLD
    func: str = ""  # the function its site is in, where on record

    def signature(self) -> dict[str, Any]:
        """The fields ``signature.disagreement`` compares (bytes of a call in flight are unknown)."""
        return {
            "op": self.op,
            "bytes": 0 if self.in_flight else self.nbytes,
            "dtype": self.dtype,
            "numel": self.numel,
            "root": self.root,
            "ranks": self.ranks,
        }

    def signature_key(self) -> tuple[Any, ...]:
        """``signature()``'s values as a tuple: what ``first_divergence`` compares at every
        sequence number of every rank (230,000 points at 1,024 ranks), without a dict each."""
        return (self.op, 0 if self.in_flight else self.nbytes, self.dtype, self.numel, self.root, self.ranks)

    def describe(self) -> str:
        named = self.site and self.func and not self.func.startswith("<")  # not <module>
        where = f" at {self.site}" + (f" in {self.func}()" if named else "") if self.site else ""
        size = f", {self.nbytes} bytes" if self.nbytes else ""
        seq = f" #{self.seq}" if self.seq >= 0 else ""
        died = ", raised" if self.raised else ", where it ended" if self.died_in else ""
        return f"{self.op}{seq} (step {self.step}{size}{died}){where}"


@dataclass
class Ledger:
    rank: int
    points: list[Point] = field(default_factory=list)
    forwards: list[tuple[int, bool, bool, str]] = field(default_factory=list)  # step, grad, training, site
    forwards_from: int = 0  # the rank's count of forwards before the first one kept (the tail)
    steps: int = 0  # training steps whose backward finished
    last_step: int = -1  # the last training step entered
    passes: list[Pass] = field(default_factory=list)
    ending: Ending = field(default_factory=lambda: Ending("running"))
    place: str = ""  # where in the user's code it was last seen (a hang's stack, else its last site)
    words: list[str] = field(default_factory=list)  # its last stderr lines (ends.json)
    # metrics a framework all-reduces for it (Lightning's sync_dist): (the user's line, name)
    sync_logs: set[tuple[str, str]] = field(default_factory=set)
    files: dict[str, str] = field(default_factory=dict)  # a site's file name -> its path
    funcs: dict[str, str] = field(default_factory=dict)  # a site (file:line) -> its function
    # the user's frames where it was last seen (a hang's stack, its death's, its exception's):
    # (path, line, function), outermost first
    stack: list[Frame] = field(default_factory=list)
    # The signature the probe wrote for a call after the rank's last recorded collective and
    # used by no record: the call it died in (a signal kills it before the record is written).
    unfinished: dict[str, Any] | None = None
    # (ts, step) of a backward that raised (its ``raised`` record), the last one the rank had
    backward_raised: tuple[int, int] | None = None
    # the gradient all-reduces one step issues (its one DDP model's bucket layout; 0 unknown)
    buckets: int = 0

    @cached_property
    def grad_forwards(self) -> Counter[int]:
        """Grad-mode forwards per step in the ledger's window (read once per step compared)."""
        return Counter(s for s, grad, _, _ in self.forwards if grad)

    @cached_property
    def first_grad_step(self) -> int:
        return min(self.grad_forwards, default=-1)

    def path_of(self, site: str) -> tuple[str, int]:
        """(the file's path, the line) of a ``file:line`` site, ("", 0) when not on record."""
        name, _, line = site.rpartition(":")
        return (self.files.get(name, ""), int(line)) if line.isdigit() else ("", 0)
