"""The job board: every node's supervisor shares its ranks' liveness, so one verdict covers the job.

A multi-node job already runs a key-value store that every node reaches: the rendezvous's
c10d TCPStore (``--master_addr:--master_port``, or ``--rdzv-endpoint``). Each node's watcher
writes one key under our prefix with what it knows of its own ranks (their status files and what
it measured about their processes) and one node, the leader (the node of rank 0, or the lowest
node still reporting when that one falls silent), reads every node's key, judges the whole job
with the same ``proof.judge`` as a single node, and writes the job's state back: the verdict,
whether ranks wait (so every node measures its ranks' CPU and stacks), and the hangs declared.
On a hang each node dumps its own ranks' stacks and shares them, so every terminal prints the
same report. No new port and no server to deploy; if the store cannot be reached, one line says
so and the node judges its own ranks (``Board.local``).

Times cross nodes as ages: a node's snapshot carries its wall clock, and the reader shifts it
by the moment it first saw that snapshot on its own clock, so skewed clocks do not matter and
a node that stops writing ages like a rank that stops heartbeating.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ddpdoctor.supervisor.jobview import JobView, NodeView
from ddpdoctor.supervisor.layout import Layout

PREFIX = "ddpdoctor/v1/"
JOB_KEY = PREFIX + "job"
NODE_STALE_S = 5.0  # a node whose snapshot has not changed for this long is lost
LEASE_S = 5.0  # a job state unchanged for this long: its leader is gone, the next one judges
STORE_TIMEOUT_S = 2.0  # one store operation; a dead store costs the watcher at most this
CONNECT_TIMEOUT_S = 10.0  # opening the client: a loaded host's agent answers its handshake late
CONNECT_PATIENCE_S = 20.0  # after this long without the store, say so once and judge alone
STACKS_WAIT_S = 6.0  # how long a node waits for the other nodes' stacks on a hang


def node_key(node: int) -> str:
    return f"{PREFIX}node/{node}"


def stacks_key(hang: int, node: int) -> str:
    return f"{PREFIX}stacks/{hang}/{node}"


def hang_key(hang: int) -> str:
    return f"{PREFIX}hang/{hang}"


class Board:
    """The watcher's window on the job. ``Board.local()``: one node, no store (the job is this
    node's ranks). ``Board(layout, report)``: shares through the rendezvous store, connecting in
    the background; every method is called from the watcher's thread and never raises."""

    def __init__(self, layout: Layout | None = None, report: Callable[[str], None] | None = None) -> None:
        self.layout = layout or Layout()
        self.report = report or (lambda text: None)
        self._store: Any = None
        self._gone = False  # the store was reached once and then lost, or never: judge alone
        self._started: float | None = None  # when this node's ranks were first seen running
        self._why = "no answer"
        self._seen: dict[int, tuple[float, float]] = {}  # node -> (its wall, our time first seen)
        self._views: dict[int, NodeView] = {}
        self._known: set[int] = set()  # nodes whose key exists
        self._job_seen: tuple[bytes, float] = (b"", time.time())
        self.leading = False
        self.last_ok: float | None = None  # the last look that read every node (our clock)
        self.node: int | None = self.layout.node_rank
        if self.layout.multi_node:
            threading.Thread(target=self._connect, name="ddpdoctor-board", daemon=True).start()

    @classmethod
    def local(cls) -> Board:
        return cls(Layout())

    @property
    def shared(self) -> bool:
        return self._store is not None and not self._gone

    def _connect(self) -> None:
        """Wait for the rendezvous store to listen (a plain socket first: torch logs every
        failed connection attempt of its own), then open a client of it."""
        assert self.layout.endpoint is not None
        host, port = self.layout.endpoint
        deadline = time.monotonic() + 3600.0
        try:  # now, while torchrun starts: on a loaded host this import alone can take 20 s
            dist = _quiet_torch_distributed()
        except Exception as exc:
            self._why = f"torch.distributed: {exc!r}"[:160]
            return
        while time.monotonic() < deadline and not self._gone:
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    pass
                store = dist.TCPStore(
                    host,
                    port,
                    is_master=False,
                    timeout=timedelta(seconds=CONNECT_TIMEOUT_S),  # the handshake, on a busy agent
                    wait_for_workers=False,
                )
                store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
                self._store = store
                return
            except Exception as exc:
                self._why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                time.sleep(0.5)

    def _lose(self, why: str, ranks_running: bool) -> None:
        if not self._gone and ranks_running:
            self.report(f"ddpdoctor: {why}: judging this node's ranks alone")
        self._gone = True

    def exchange(self, mine: NodeView, now: float, ranks_running: bool) -> JobView:
        """Publish this node's look and return the job as far as this node needs it: every node
        when it leads (or when the leader fell silent), else this node alone."""
        if self.node is None or mine.statuses:
            self.node = mine.node
        if not self.layout.multi_node or self._gone:
            self.leading = True
            return JobView({mine.node: mine})
        if self._store is None:
            if ranks_running and self._started is None:
                self._started = time.monotonic()
            if ranks_running and time.monotonic() - (self._started or 0.0) > CONNECT_PATIENCE_S:
                host, port = self.layout.endpoint or ("?", 0)
                self._lose(f"the job's store at {host}:{port} cannot be reached ({self._why})", True)
            self.leading = True
            return JobView({mine.node: mine})
        try:
            self._store.set(node_key(mine.node), mine.to_json())
            self._known.add(mine.node)
            self.leading = self._should_lead(mine.node, now)
            if not self.leading:
                return JobView({mine.node: mine})
            view = self._read_nodes(mine, now)
            self.last_ok = now
            return view
        except Exception as exc:
            self._lose(f"lost the job's store ({type(exc).__name__})", ranks_running)
            self.leading = True
            return JobView({mine.node: mine})

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the store (a reader that looks once, `top --once`)."""
        deadline = time.monotonic() + timeout_s
        while self._store is None and not self._gone and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.shared

    def read(self, now: float) -> JobView | None:
        """Every node's latest look, for a reader that is no node (`ddpdoctor top`)."""
        if not self.shared:
            return None
        try:
            return self._read_nodes(None, now)
        except Exception:
            return None

    def _should_lead(self, node: int, now: float) -> bool:
        """The node of rank 0 leads; another node takes over once the job state stops moving."""
        if node == 0:
            return True
        raw = self._get(JOB_KEY) or b""
        if raw != self._job_seen[0]:
            self._job_seen = (raw, now)
            return self.leading and _leader_of(raw) in (None, node)
        if now - self._job_seen[1] < LEASE_S:
            return self.leading
        view = self._read_nodes(None, now)
        fresh = [n for n in view.nodes if n not in view.lost]
        return bool(fresh) and min(fresh) == node

    def _read_nodes(self, mine: NodeView | None, now: float) -> JobView:
        assert self._store is not None
        top = max(self.layout.nnodes, max(self._known, default=0) + 1)
        missing = [n for n in range(top) if n not in self._known and (mine is None or n != mine.node)]
        for n in missing:
            if self._store.check([node_key(n)]):
                self._known.add(n)
        keys = sorted(self._known)
        raws = self._store.multi_get([node_key(n) for n in keys]) if keys else []
        lost: dict[int, float] = {}
        for n, raw in zip(keys, raws):
            try:
                view = NodeView.from_json(raw)
            except (ValueError, KeyError, TypeError):
                continue
            seen = self._seen.get(n)
            if seen is None or seen[0] != view.wall:
                seen = self._seen[n] = (view.wall, now)
            self._views[n] = view.shifted(seen[1] - view.wall)
            silent = now - seen[1]
            if silent >= NODE_STALE_S and not all(s.exited for s in view.statuses.values()):
                lost[n] = silent
        if mine is not None:
            self._views[mine.node] = mine
            lost.pop(mine.node, None)
        return JobView(dict(self._views), lost)

    def last_seen(self, node: int) -> float | None:
        """When (on this node's clock) ``node``'s report last changed."""
        seen = self._seen.get(node)
        return seen[1] if seen else None

    def _get(self, key: str) -> bytes | None:
        assert self._store is not None
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def job_state(self) -> dict[str, Any] | None:
        """The leader's latest state of the job (None on the leader itself, or without a store)."""
        if not self.shared or (self.leading and self.node is not None):
            return None
        try:
            raw = self._get(JOB_KEY)
        except Exception:
            return None
        with contextlib.suppress(ValueError, TypeError):
            state = json.loads(raw) if raw else None
            return state if isinstance(state, dict) else None
        return None

    def post_state(self, state: dict[str, Any]) -> None:
        if not self.shared or not self.leading:
            return
        with contextlib.suppress(Exception):
            self._store.set(JOB_KEY, json.dumps({**state, "leader": self.node}, default=str))

    def post_layout(self, layout: dict[str, Any]) -> None:
        """The node map, rewritten by the leader when a node joins or is lost."""
        if self.shared and self.leading:
            with contextlib.suppress(Exception):
                self._store.set(PREFIX + "layout", json.dumps(layout))

    def layout_map(self) -> dict[str, Any] | None:
        if not self.shared:
            return None
        try:
            raw = self._get(PREFIX + "layout")
            return json.loads(raw) if raw else None
        except Exception:
            return None

    def post_hang(self, hang: dict[str, Any]) -> None:
        """The leader's hang: the job's statuses at the verdict, read once by every node."""
        if not self.shared:
            return
        with contextlib.suppress(Exception):
            self._store.set(hang_key(int(hang["n"])), json.dumps(hang, default=str))

    def hang(self, n: int) -> dict[str, Any] | None:
        if not self.shared:
            return None
        try:
            raw = self._get(hang_key(n))
            return json.loads(raw) if raw else None
        except Exception:
            return None

    def share_stacks(self, hang: int, stacks: dict[int, dict[str, Any]]) -> None:
        if not self.shared or self.node is None:
            return
        with contextlib.suppress(Exception):
            self._store.set(stacks_key(hang, self.node), json.dumps({str(r): s for r, s in stacks.items()}))

    def gather_stacks(self, hang: int, nodes: list[int]) -> dict[int, dict[str, Any]]:
        """Every other node's stacks for hang ``hang``, waiting a little for each."""
        out: dict[int, dict[str, Any]] = {}
        if not self.shared:
            return out
        waiting = [n for n in nodes if n != self.node]
        deadline = time.monotonic() + STACKS_WAIT_S
        while waiting and time.monotonic() < deadline:
            for n in list(waiting):
                try:
                    raw = self._get(stacks_key(hang, n))
                except Exception:
                    return out
                if raw is not None:
                    waiting.remove(n)
                    with contextlib.suppress(ValueError, TypeError):
                        out.update({int(r): s for r, s in json.loads(raw).items()})
            if waiting:
                time.sleep(0.1)
        return out


def _quiet_torch_distributed() -> Any:
    """torch.distributed, imported with c10's own logging at FATAL: a store that goes away at
    the job's end must not print C++ stack traces on the user's terminal. The variable is read
    once, when libc10 loads, and put back at once: the job started before and never sees it."""
    import os
    import sys

    if "torch" not in sys.modules:
        old = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        try:
            import torch.distributed as dist
        finally:
            if old is None:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = old
        return dist
    import torch.distributed as dist

    return dist


def _leader_of(raw: bytes) -> int | None:
    try:
        leader = json.loads(raw).get("leader") if raw else None
    except (ValueError, AttributeError):
        return None
    return int(leader) if isinstance(leader, int) else None
