"""The trace writer and reader: bounded, flushed, tolerant of truncation and corruption."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpdoctor.trace import binfmt, notes, schema
from ddpdoctor.trace.reader import TraceError, load_run, read_trace
from ddpdoctor.trace.writer import TraceWriter


def header(rank: int = 0, world: int = 2) -> dict:
    return {
        "schema": schema.SCHEMA,
        "rank": rank,
        "world_size": world,
        "host": "h",
        "pid": 1,
        "wall_ns": 1_700_000_000_000_000_000,
        "mono_ns": 5_000_000_000,
    }


def write_events(path: Path, n: int, **kwargs) -> TraceWriter:
    w = TraceWriter(str(path), header(), flush_interval=0.05, **kwargs)
    for i in range(n):
        t0 = 5_000_000_000 + i * 1_000_000
        w.put((schema.FORWARD, t0, t0 + 500_000, i, 1, 1, i))
    return w


def test_round_trip_in_microseconds_since_anchor(tmp_path: Path) -> None:
    w = write_events(tmp_path / "trace-rank0.bin", 3)
    w.close()
    t = read_trace(tmp_path / "trace-rank0.bin")
    fwd = t.kind(schema.FORWARD)
    assert fwd.ts.tolist() == [0, 1000, 2000]
    assert fwd.dur.tolist() == [500, 500, 500]
    assert fwd.step.tolist() == [0, 1, 2]
    assert t.steps == 3 and t.ended_cleanly and t.skipped_lines == 0
    assert t.wall_offset_us() == 1_700_000_000_000_000


def test_writer_flushes_without_close(tmp_path: Path) -> None:
    """A rank that hangs or is SIGKILLed leaves what was flushed; no close needed."""
    path = tmp_path / "trace-rank0.bin"
    write_events(path, 10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and read_trace(path).steps < 10:
        time.sleep(0.02)
    t = read_trace(path)
    assert t.steps == 10 and not t.ended_cleanly


def test_bounded_ring_keeps_the_newest_and_counts_the_rest(tmp_path: Path) -> None:
    """A writer a whole ring behind: the oldest events are lost, counted; the newest stay."""
    w = TraceWriter(str(tmp_path / "t.bin"), header(), capacity=4, flush_interval=60)
    for i in range(12):
        w.put((schema.FORWARD, 5_000_000_000, 5_000_000_001, i, 1, 1, 0))
    w.close()
    t = read_trace(tmp_path / "t.bin")
    assert t.kind(schema.FORWARD).step.tolist() == [8, 9, 10, 11]
    assert t.meta[schema.DROPPED][0][2] == {"count": 8}


def test_flushes_that_wrap_around_the_ring_keep_every_event_in_order(tmp_path: Path) -> None:
    """Each flush takes the slots written since the last one, across the ring's end too."""
    w = TraceWriter(str(tmp_path / "t.bin"), header(), capacity=8, flush_interval=60)
    for i in range(30):
        w.put((schema.FORWARD, 5_000_000_000 + i, 5_000_000_001 + i, i, 1, 1, 0))
        if i % 5 == 4:
            w.flush()
    w.close()
    t = read_trace(tmp_path / "t.bin")
    assert t.kind(schema.FORWARD).step.tolist() == list(range(30))
    assert schema.DROPPED not in t.meta


@pytest.mark.parametrize("seqs", ["c", "python"])
def test_a_slot_claimed_and_never_written_costs_one_event_not_the_rest(
    tmp_path: Path, monkeypatch, seqs: str
) -> None:
    """A signal handler's exception raised between a Python writer's claim of a slot and its
    pack (the eval loop runs handlers after a call) leaves that slot unwritten for good. The
    writer waits for it as for a slot mid-write, then, once it was claimed ``ABANDONED_NS``
    ago, counts it lost and writes the events after it; the last flush waits for nothing. It
    waited for ever before: in CI a SIGALRM cut short the step in which the collective probe's
    Python path learnt a call site, and the trace kept 8 of some 200 optimizer steps."""
    from ddpdoctor.probes import fastpath
    from ddpdoctor.trace import ring as ring_mod

    kw = {"packer": fastpath.packer, "seqs": fastpath.seqs} if seqs == "c" else {}
    assert seqs == "python" or fastpath.module() is not None, "the probes' C module is not built"

    def put(w: TraceWriter, steps: range) -> None:
        for i in steps:
            w.put((schema.FORWARD, 5_000_000_000 + i, 5_000_000_001 + i, i, 1, 1, 0))

    def steps(path: Path) -> list[int]:
        return read_trace(path).kind(schema.FORWARD).step.tolist()

    monkeypatch.setattr(ring_mod, "ABANDONED_NS", 3_600 * 10**9)  # no take is late enough
    path = tmp_path / "t.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, **kw)
    put(w, range(3))
    w.ring.seqs.next()  # claimed; the exception came before the pack
    put(w, range(3, 6))
    w.flush()
    assert steps(path) == [0, 1, 2]  # the slot may be mid-write on another thread: waited for
    monkeypatch.setattr(ring_mod, "ABANDONED_NS", 0)  # every take is late enough from now on
    w.flush()  # this take's head marks the slots claimed by now
    put(w, range(6, 8))
    w.flush()
    assert steps(path) == list(range(8))
    w.close()
    t = read_trace(path)
    assert t.kind(schema.FORWARD).step.tolist() == list(range(8))
    assert t.meta[schema.DROPPED][0][2] == {"count": 1}

    monkeypatch.setattr(ring_mod, "ABANDONED_NS", 3_600 * 10**9)
    path = tmp_path / "u.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, **kw)
    put(w, range(2))
    w.ring.seqs.next()
    put(w, range(2, 4))
    w.close()  # the last take: nothing is mid-write that will ever be written
    t = read_trace(path)
    assert t.kind(schema.FORWARD).step.tolist() == list(range(4))
    assert t.meta[schema.DROPPED][0][2] == {"count": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_the_ring_is_mapped_writable_before_the_first_event(tmp_path: Path) -> None:
    """Writing an event takes no page fault: each took 4 µs here, once per page (32 events) of
    the ring's first lap, on the training thread."""
    import resource

    from ddpdoctor.trace.ring import Ring

    ring = Ring(str(tmp_path / "t.ring"), 0, 4096)
    offsets = range(0, len(ring.mm), 4096)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for off in offsets:
        ring.mm[off] = 0
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    ring.close(unlink=True)
    assert len(offsets) == 129 and faults < 8, faults


def test_json_lines_of_earlier_versions_skip_truncated_and_corrupt_lines(tmp_path: Path) -> None:
    path = tmp_path / "trace-rank1.jsonl"
    lines = [
        json.dumps(["header", header(rank=1)]),
        json.dumps(["forward", 0, 10, 0, 1, 1, 3]),
        "not json at all",
        json.dumps({"a": "dict, not a record"}),
        json.dumps(["forward", "x", 10, 0]),
        json.dumps(["backward", 20, 30, 0]),
        json.dumps(["some_future_kind", 40, 0, 0, {"ok": True}]),
        '["forward",50,10,1,1,1,',
    ]  # killed mid-write
    path.write_text("\n".join(lines))
    t = read_trace(path)
    assert t.rank == 1
    assert len(t.kind(schema.FORWARD)) == 1 and len(t.kind(schema.BACKWARD)) == 1
    assert t.skipped_lines == 4
    run = load_run([tmp_path])
    assert any("skipped 4" in note for note in run.notes)


def test_write_failure_switches_writer_off_once(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    w = TraceWriter(str(tmp_path / "t.bin"), header(), on_error=errors.append, flush_interval=60)
    os.close(w._fd)  # the disk "goes away"
    w.put((schema.FORWARD, 5_000_000_000, 5_000_000_001, 0, 1, 1, 0))
    w.flush()
    w.put((schema.FORWARD, 5_000_000_000, 5_000_000_001, 1, 1, 1, 0))
    w.flush()
    w.close()
    assert len(errors) == 1


def test_load_run_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a directory"):
        load_run([tmp_path / "missing"])
    with pytest.raises(TraceError, match="no rank traces"):
        load_run([tmp_path])
    (tmp_path / "trace-rank0.jsonl").write_text("garbage\n")
    with pytest.raises(TraceError, match="no trace header"):
        load_run([tmp_path])


def test_newest_attempt_wins_and_nodes_merge(tmp_path: Path) -> None:
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    node0.mkdir()
    node1.mkdir()
    for d, rank, name in [
        (node0, 0, "trace-rank0.jsonl"),
        (node0, 0, "trace-rank0-attempt1.jsonl"),
        (node1, 1, "trace-rank1.jsonl"),
    ]:
        h = header(rank=rank)
        h["restart"] = 1 if "attempt" in name else 0
        (d / name).write_text(json.dumps(["header", h]) + "\n")
    run = load_run([node0, node1])
    assert sorted(run.ranks) == [0, 1]
    assert run.ranks[0].path.name == "trace-rank0-attempt1.jsonl"
    assert run.world_size == 2


def _value(code: str, rng: random.Random):
    return {
        "i": rng.choice([0, -1, 2**62, -(2**62), rng.randrange(-(10**12), 10**12)]),
        "n": rng.choice([0, -1, 2**31 - 1, rng.randrange(-1000, 1000)]),
        "b": rng.choice([0, 1, -1, 127]),
        "f": rng.choice([0.0, 1.5, -2.25e9]),
        "s": rng.choice(["AdamW", "", "a,b", 'q"uote', "Ünïcode", "WORLD"]),
        "v": rng.choice([[0, 1, 2], {"k": [1.5, None]}, "text", None, []]),
    }[code]


@pytest.fixture(params=["c", "python"])
def packer(request: pytest.FixtureRequest) -> Any:
    """Each kind's events packed by the C packer (probes/_fast.c) or by ``struct`` in Python."""
    if request.param == "python":
        return None
    from ddpdoctor.probes import fastpath

    assert fastpath.module() is not None, "the C module is built by the install (pyproject)"
    return fastpath.packer


def test_every_declared_kind_round_trips_through_binary_and_the_jsonl_export(
    tmp_path: Path, packer: Any
) -> None:
    """Each kind's declared layout, with values at the edges of its types: the reader's columns
    and the JSON-lines export give back exactly what was recorded, in order per kind."""
    rng = random.Random(3)
    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(str(path), header(), flush_interval=0.01, packer=packer)
    sent: dict[str, list[tuple]] = {}
    for i in range(600):
        kind = rng.choice(sorted(schema.KINDS))
        fields = tuple(_value(c, rng) for c in schema.KINDS[kind].spec)
        t0 = 5_000_000_000 + i * 1000
        w.put((kind, t0, t0 + 2000 * i, i, *fields))
        sent.setdefault(kind, []).append((i, 2 * i, i, *fields))
        if i % 100 == 0:
            time.sleep(0.03)  # several flushes: several blocks
    w.meta(schema.LOADER, 3, {"id": 1})
    w.close()
    t = read_trace(path)
    assert sorted(t.events) == sorted(sent) and t.skipped_lines == 0 and t.ended_cleanly
    for kind, rows in sent.items():
        assert _rows(t.kind(kind)) == rows, kind
    exported: dict[str, list[tuple]] = {}
    for rec in binfmt.records(binfmt.decode(path.read_bytes()))[1:]:
        if rec[0] in schema.KINDS:
            exported.setdefault(rec[0], []).append(tuple(rec[1:]))
    assert exported == sent
    (tmp_path / "export").mkdir()
    text = "\n".join(json.dumps(r) for r in binfmt.records(binfmt.decode(path.read_bytes())))
    (tmp_path / "export" / "trace-rank0.jsonl").write_text(text)
    again = read_trace(tmp_path / "export" / "trace-rank0.jsonl")  # the export reads as a trace
    assert {k: _rows(ev) for k, ev in again.events.items()} == sent


def test_values_that_do_not_fit_their_type_never_break_recording(tmp_path: Path, packer: Any) -> None:
    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, packer=packer)
    w.put((schema.DATA_WAIT, 5_000_000_000, 5_000_000_010, 0, None))  # None: -1
    w.put((schema.FORWARD, 5_000_000_000, 5_000_000_010, 1, 1, 1))  # a field short: -1
    w.put((schema.DATA_WAIT, 5_000_000_000, 5_000_000_010, 2, 2**70))  # too wide: lost, counted
    w.put(("no_such_kind", 5_000_000_000, 5_000_000_010, 3))  # undeclared: ignored
    w.close()
    t = read_trace(path)
    assert _rows(t.kind(schema.DATA_WAIT)) == [(0, 0, 0, -1)]
    assert _rows(t.kind(schema.FORWARD)) == [(0, 0, 1, 1, 1, -1, -1)]
    assert t.meta[schema.DROPPED][0][2] == {"count": 1}


class _Refuses:
    def __int__(self) -> int:
        raise RuntimeError("no int for you")


def test_odd_values_are_coerced_or_lost_alike_by_the_c_and_python_packers(
    tmp_path: Path, packer: Any
) -> None:
    """What a probe hands the writer is not always a plain int: the C packer coerces it as the
    Python path's ``pack_odd`` does (int(), -1 where int() refuses) and loses, counted, what
    no field of its type can hold."""
    import numpy as np

    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, packer=packer)
    fwd, allreduce, wait = w.kind(schema.FORWARD), w.kind(schema.ALLREDUCE), w.kind(schema.DATA_WAIT)
    t = 5_000_000_000
    w.pack(fwd, t, t + 1000, 1, (True, 1.9, np.int64(7), "12"))  # bool, float, numpy int, digits
    w.pack(fwd, t, t + 1000, 2, (None, 300, 5, 1))  # 300 fits no int8: lost
    w.pack(allreduce, t, t + 1000, 3, (float("inf"), np.uint32(4096), float("nan")))
    w.pack(wait, t, t + 1000, None, (2,))  # a step of None: -1
    w.pack(wait, t, t + 1000, 4, (2**70,))  # wider than 64 bits: lost
    w.pack(wait, t, t + 1000, 5, (_Refuses(),))  # int() raises what _coerce does not catch: lost
    w.close()
    got = read_trace(path)
    assert _rows(got.kind(schema.FORWARD)) == [(0, 1, 1, 1, 1, 7, 12)]
    assert _rows(got.kind(schema.ALLREDUCE)) == [(0, 1, 3, -1, 4096, -1)]
    assert _rows(got.kind(schema.DATA_WAIT)) == [(0, 1, -1, 2)]
    assert got.meta[schema.DROPPED][0][2] == {"count": 3}


def test_an_event_packed_into_a_ring_unmapped_by_close_is_lost_quietly(tmp_path: Path) -> None:
    """The collective probe packs straight into the ring it read before ``close`` unmapped it
    (a daemon thread's collective at exit): that event is lost and counted, never raised."""
    w = TraceWriter(str(tmp_path / "trace-rank0.bin"), header(), flush_interval=60)
    ring, kind = w.ring, w.kind(schema.DATA_WAIT)
    w.close()
    assert w.ring is None
    w.pack_odd(kind, ring, 64, (0, 5_000_000_000, 5_000_000_010), (1,), 1)
    assert ring.lost == 1


def test_the_c_modules_seqs_let_go_of_the_mapping_when_the_ring_closes(tmp_path: Path) -> None:
    """The C module holds the ring's mapping (``_fast.RingSeqs``) to write records without a
    Python object. ``close`` must still unmap it (mmap refuses while a buffer is held), and a
    record the C packer is given afterwards is counted lost, not written to unmapped memory."""
    from ddpdoctor.probes import fastpath

    assert fastpath.module() is not None, "the probes' C module is not built"
    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(
        str(path), header(), flush_interval=60, ring=True, packer=fastpath.packer, seqs=fastpath.seqs
    )
    ring, kind = w.ring, w.kind(schema.DATA_WAIT)
    assert type(ring.seqs).__name__ == "RingSeqs"
    assert kind.fast(ring, 3, 5_000_000_000, 5_000_010_000, (4,)) is None  # packed in C
    assert ring.seqs.head == 1 and ring.seqs.next() == 2  # one counter, C's and Python's
    w.close()
    assert ring.mm.closed and not os.path.exists(ring.path)
    assert kind.fast(ring, 3, 5_000_020_000, 5_000_030_000, (5,)) is None
    assert ring.lost == 1
    assert _rows(read_trace(path).kind(schema.DATA_WAIT)) == [(0, 10, 3, 4)]


def test_a_torn_last_block_is_skipped_and_a_later_version_says_what_it_needs(tmp_path: Path) -> None:
    path = tmp_path / "trace-rank0.bin"
    write_events(path, 5).close()
    data = path.read_bytes()
    path.write_bytes(data + binfmt.block(binfmt.META, b'["x",1,0,0,{}]')[:-3])  # killed mid-write
    t = read_trace(path)
    assert t.steps == 5 and t.skipped_lines == 1
    future = dict(header(), schema="ddpdoctor.trace/9")
    path.write_bytes(binfmt.json_block(binfmt.HEAD, future))
    with pytest.raises(TraceError, match="ddpdoctor.trace/9.*upgrade"):
        read_trace(path)


def _rows(ev) -> list[tuple]:
    return [(a, b, c, *f) for a, b, c, f in zip(ev.ts.tolist(), ev.dur.tolist(), ev.step.tolist(), ev.fields)]


def test_export_writes_each_rank_as_json_lines_that_read_back(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    w = write_events(run / "trace-rank0.bin", 4)
    w.put((schema.COLLECTIVE, 5_000_000_000, 5_000_009_000, 3, "barrier", 0, "WORLD", 2, 9, 0, -1))
    w.close()
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "export", str(run), "-f", "jsonl", "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "trace-rank0.jsonl").read_text().splitlines()
    barrier = '["collective",0,9,3,"barrier",0,"WORLD",2,9,0,-1,-1]'
    assert [ln for ln in lines if '"barrier"' in ln] == [barrier]
    assert read_trace(tmp_path / "out" / "trace-rank0.jsonl").steps == 4
    (tmp_path / "none").mkdir()
    empty = subprocess.run([sys.executable, "-m", "ddpdoctor", "export", str(tmp_path / "none"), "-fjsonl"])
    assert empty.returncode == 2


@pytest.mark.parametrize("keep", [3, 20, 60])
def test_a_cut_header_block_keeps_the_events_and_metadata_on_one_clock(tmp_path: Path, keep: int) -> None:
    """A disk that filled during the header's write (its first bytes only, the later blocks
    appended after them): the rank's events and records still read, on its monotonic clock."""
    path = tmp_path / "trace-rank1.bin"
    w = write_events(path, 4)
    w.put((schema.RAISED, 5_002_000_000, 5_003_000_000, 2, {"kind": schema.COLLECTIVE, "fields": []}))
    w.close()
    data = path.read_bytes()
    end = next(binfmt.blocks(data))[2]
    path.write_bytes(data[:keep] + data[end:])  # the header block's first bytes only
    with pytest.raises(TraceError, match="no trace header"):
        read_trace(path)  # no rank to stand in for it
    t = read_trace(path, 1)
    assert t.header == {"rank": 1, "header_cut": True} and t.skipped_lines == 1
    assert t.steps == 4 and t.kind(schema.FORWARD).ts.tolist()[:2] == [5_000_000, 5_001_000]
    assert [(ts, step) for ts, step, _ in t.meta[schema.RAISED]] == [(5_002_000, 2)]


def _columns_of(run) -> dict:
    """Every rank's columns, fields and views as plain values, to compare two readings."""
    from ddpdoctor.analysis.slow.phases import rank_phases, step_time_stats

    out = {}
    for rank, t in run.ranks.items():
        kinds = {
            k: (ev.ts.tolist(), ev.dur.tolist(), ev.step.tolist(), [tuple(f) for f in ev.fields])
            for k, ev in t.events.items()
        }
        out[rank] = (t.header, t.meta, kinds, t.view(rank_phases), t.view(step_time_stats))
    return out


@pytest.mark.parametrize("forked", [True, False])
def test_read_workers_hand_over_the_same_traces(tmp_path: Path, monkeypatch, forked: bool) -> None:
    """A run of many rank files is read in worker processes: forked ones hand each trace over
    in shared memory (``handoff``), a forkserver's through the pipe, and a trace too large for
    a slot through the pipe too. The same columns, fields and rank views as read in this
    process, as arrays of its own (writable, as unpickled ones were)."""
    import threading

    from ddpdoctor.trace import handoff, reader
    from ddpdoctor.trace.synthetic import SyntheticJob, write_run

    dirs = write_run(SyntheticJob(ranks=40, steps=30, straggler=3), tmp_path / "runs")
    monkeypatch.setenv("DDPDOCTOR_READ_WORKERS", "1")
    alone = _columns_of(load_run(dirs))
    monkeypatch.setenv("DDPDOCTOR_READ_WORKERS", "2")
    assert reader.read_workers(40) == 2
    # fork while single-threaded (earlier tests may leave a writer's flush thread behind)
    monkeypatch.setattr(threading, "active_count", lambda: 1 if forked else 2)
    unpacked: list[int] = []
    unpack = handoff.Slots.unpack
    monkeypatch.setattr(handoff.Slots, "unpack", lambda self, p: unpacked.append(p.slot) or unpack(self, p))
    for slot_bytes in (handoff.SLOT_BYTES, 2048):  # 2 KB: the ranks go through the pipe
        monkeypatch.setattr(handoff, "SLOT_BYTES", slot_bytes)
        unpacked.clear()
        run = load_run(dirs)
        assert _columns_of(run) == alone
        assert len(unpacked) == (40 if forked and slot_bytes > 2048 else 0)
        arrays = [ev._dur.data for t in run.ranks.values() for ev in t.events.values()]  # noqa: SLF001
        assert all(a.flags.writeable and a.flags.aligned for a in arrays if a is not None)


def test_the_cpp_timers_notes_packed_at_once_read_back_as_packed_one_by_one(
    tmp_path: Path, packer: Any
) -> None:
    """The C++ timer's notes (int64 rows, ``notes.NOTE``) go into the ring in one call of
    the C packer, or one by one in Python; a row with a value that does not fit its field (a
    bucket index wider than 32 bits) is lost and counted, as by the writer's pack, and the rows
    after it are kept."""
    from types import SimpleNamespace

    from ddpdoctor.probes import commhook

    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, packer=packer)
    c = SimpleNamespace(bucket_kind=w.kind(schema.ALLREDUCE), writer=w, pack=w.pack)
    rows = [
        (0, 5_000_000_000, 5_000_001_000, 0, 4096, 7),
        (0, 5_000_002_000, 5_000_003_000, 2**40, 64, 8),
        (1, 5_000_004_000, 5_000_005_000, 1, 2**40, 9),
    ]
    commhook._pack_notes(c, b"".join(notes.NOTE.pack(*r) for r in rows))
    w.close()
    t = read_trace(path)
    got = _rows(t.kind(schema.ALLREDUCE))  # (ts µs, dur µs, step, index, bytes, seq)
    assert got == [(0, 1, 0, 0, 4096, 7), (4, 1, 1, 1, 2**40, 9)]
    assert t.meta[schema.DROPPED][0][2] == {"count": 1}


def test_a_deaths_uncommitted_timer_notes_are_recovered_once(tmp_path: Path) -> None:
    """After a death, ``complete_trace`` appends the C++ timer's notes that were never
    committed (``trace/notes.py``), leaves out the committed ones and one already packed into
    the ring (a death between the pack and the commit), and counts a note claimed but never
    written as lost."""
    import struct
    from types import SimpleNamespace

    from ddpdoctor.probes import commhook
    from ddpdoctor.trace.ring import complete_trace

    path = tmp_path / "trace-rank0.bin"
    w = TraceWriter(str(path), header(), flush_interval=60, ring=True)
    c = SimpleNamespace(bucket_kind=w.kind(schema.ALLREDUCE), writer=w, pack=w.pack)
    rows = [
        (3, 5_000_000_000, 5_000_001_000, 0, 4096, 7),  # committed: in the trace already
        (3, 5_000_002_000, 5_000_003_000, 1, 64, 8),  # packed into the ring, not committed
        (4, 5_000_004_000, 5_000_005_000, 0, 4096, 9),  # noted only
    ]
    commhook._pack_notes(c, notes.NOTE.pack(*rows[1]))
    w._stop.set()  # the rank dies: no more flushes, no close
    slots = [struct.pack("<6qQ8x", *row, i + 1) for i, row in enumerate(rows)]
    head = struct.pack("<8sIIQQI", notes.MAGIC, notes.SLOT, 16384, 4, 1, 1).ljust(notes.HEADER_BYTES, b"\0")
    Path(notes.notes_path(path)).write_bytes(head + b"".join(slots))
    assert complete_trace(path) == {"recovered": 2, "lost": 1}
    assert not os.path.exists(notes.notes_path(path))
    t = read_trace(path)
    got = sorted(_rows(t.kind(schema.ALLREDUCE)))  # (ts µs, dur µs, step, index, bytes, seq)
    assert got == [(2, 1, 3, 1, 64, 8), (4, 1, 4, 0, 4096, 9)]
    assert t.meta[schema.DROPPED][0][2] == {"count": 1}


def test_the_ring_names_the_collective_entered_last_and_old_rings_name_none(tmp_path: Path) -> None:
    """Before each collective the probe writes (seq, signature id, site id) into the ring's
    header; a ring from before that field (zeros there, no tag) names no call."""
    from ddpdoctor.probes.fastpath import module
    from ddpdoctor.trace.ring import CALL, CALL_AT, Ring, read_ring

    path = str(tmp_path / "trace-rank0.ring")
    ring = Ring(path, 0, slots=8)
    assert read_ring(path)[0]["entered"] is None  # none entered yet
    CALL.pack_into(ring.mm, CALL_AT, 41, 3, 7)  # as the Python probe writes it
    ring.mm.flush()
    assert read_ring(path)[0]["entered"] == {"seq": 41, "signature": 3, "site": 7}
    fast = module()
    if fast is not None:  # the C probe's store lands in the same bytes (_fast.c's enter_call)
        assert fast.RING_CALL_AT == CALL_AT
    ring.mm[CALL_AT - 4 : CALL_AT + CALL.size] = bytes(4 + CALL.size)  # an older ring's header
    ring.mm.flush()
    assert read_ring(path)[0]["entered"] is None
    ring.close(unlink=True)


def test_the_c_take_groups_the_ring_as_numpy_does(tmp_path: Path) -> None:
    """The writer thread takes and groups the ring's slots in one C call (``RingSeqs.take``)
    where the module is built, with numpy elsewhere: both must give the same parts, range and
    losses, through a wrap past the ring's end, a slot claimed and not yet written, a void slot,
    a lapped ring and the final take."""
    from ddpdoctor.probes import fastpath
    from ddpdoctor.trace.ring import HEADER_BYTES, SLOT, VOID, VOID_SLOT, Ring, sizes_of, slot_struct

    assert fastpath.module() is not None, "the probes' C module is not built"
    ring = Ring(None, 0, 8, fastpath.seqs)
    layout = binfmt.layout()
    sizes = sizes_of(layout)
    kinds = {name: (i + 1, slot_struct(spec), len(spec)) for i, (name, spec, _) in enumerate(layout)}

    class NoC:  # the same seqs, without the C take: the numpy path
        def __init__(self, seqs: object) -> None:
            self.seqs = seqs

        @property
        def head(self) -> int:
            return self.seqs.head

    def put(name: str, step: int, claim_only: bool = False) -> None:
        kid, st, n = kinds[name]
        seq = ring.seqs.next()
        off = HEADER_BYTES + (seq & ring.mask) * SLOT
        if not claim_only:
            if name == "void":
                VOID_SLOT.pack_into(ring.mm, off, VOID, seq)
            else:
                st.pack_into(ring.mm, off, kid, step, 10 * step, 10 * step + 5, *([1] * n), seq)
        ring.seqs.head = seq

    def both(final: bool = False) -> tuple:
        saved = (ring.taken, ring._stale, ring._mark)
        c_seqs = ring.seqs
        ring.seqs = NoC(c_seqs)
        try:
            by_numpy = ring.take(sizes, final)
        finally:
            ring.seqs = c_seqs
        ring.taken, ring._stale, ring._mark = saved
        by_c = ring.take(sizes, final)
        assert by_c == by_numpy
        return by_c

    kinds["void"] = (VOID, None, 0)
    for step, name in enumerate([schema.FORWARD, schema.DATA_WAIT, schema.FORWARD, "void", schema.DATA_WAIT]):
        put(name, step)
    parts, lo, hi, lost = both()
    assert (lo, hi, lost) == (1, 6, 0) and [(kid, n) for kid, _, n in parts] == sorted(
        [(kinds[schema.FORWARD][0], 2), (kinds[schema.DATA_WAIT][0], 2)]
    )
    for step in range(5):  # seqs 6..10: slots 6, 7, 0, 1, 2 (past the ring's end)
        put(schema.FORWARD, step)
    put(schema.DATA_WAIT, 9, claim_only=True)  # seq 11: claimed, not yet written
    put(schema.FORWARD, 10)  # seq 12, written
    parts, lo, hi, lost = both()
    assert (lo, hi, lost) == (6, 11, 0) and [n for _, _, n in parts] == [5], "waits at the unwritten slot"
    assert both() == ([], 11, 11, 0)
    parts, lo, hi, lost = both(final=True)
    assert (lo, hi, lost) == (11, 13, 1) and [n for _, _, n in parts] == [1], "the last take does not wait"
    for step in range(12):  # 12 events into 8 slots before a take: 4 overwritten
        put(schema.DATA_WAIT, step)
    parts, lo, hi, lost = both()
    assert (lo, hi, lost) == (13, 25, 4) and [n for _, _, n in parts] == [8]
