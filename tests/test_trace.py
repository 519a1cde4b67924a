"""The trace writer and reader: bounded, flushed, tolerant of truncation and corruption."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ddpdoctor.trace import schema
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
    w = write_events(tmp_path / "trace-rank0.jsonl", 3)
    w.close()
    t = read_trace(tmp_path / "trace-rank0.jsonl")
    fwd = t.kind(schema.FORWARD)
    assert fwd.ts.tolist() == [0, 1000, 2000]
    assert fwd.dur.tolist() == [500, 500, 500]
    assert fwd.step.tolist() == [0, 1, 2]
    assert t.steps == 3 and t.ended_cleanly and t.skipped_lines == 0
    assert t.wall_offset_us() == 1_700_000_000_000_000


def test_writer_flushes_without_close(tmp_path: Path) -> None:
    """A rank that hangs or is SIGKILLed leaves what was flushed; no close needed."""
    path = tmp_path / "trace-rank0.jsonl"
    write_events(path, 10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and read_trace(path).steps < 10:
        time.sleep(0.02)
    t = read_trace(path)
    assert t.steps == 10 and not t.ended_cleanly


def test_bounded_buffer_drops_and_counts(tmp_path: Path) -> None:
    w = TraceWriter(str(tmp_path / "t.jsonl"), header(), capacity=5, flush_interval=60)
    for i in range(12):
        w.put((schema.FORWARD, 5_000_000_000, 5_000_000_001, i, 1, 1, 0))
    assert w.dropped == 7
    w.close()
    t = read_trace(tmp_path / "t.jsonl")
    assert len(t.kind(schema.FORWARD)) == 5
    assert t.meta[schema.DROPPED][0][2] == {"count": 7}


def test_reader_skips_truncated_and_corrupt_lines(tmp_path: Path) -> None:
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
    w = TraceWriter(str(tmp_path / "t.jsonl"), header(), on_error=errors.append, flush_interval=60)
    w._file.close()  # the disk "goes away"
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


def test_bulk_parser_agrees_with_json_line_by_line(tmp_path: Path) -> None:
    """The numpy fast path must give what json gives, and hand every unusual line to json."""
    records = [
        ["header", header()],
        ["forward", 0, 10, 0, 1, 1, 3],
        ["forward", 5, -7, -1, 0, 1, 123456789012345],
        ["allreduce", 20, 30, 0, 2, 4_000_000, 4],
        ["optimizer", 40, 2, 0, "AdamW"],
        ["optimizer", 41, 2, 1, "Opt, with comma"],
        ["optimizer", 42, 2, 2, 'quote " inside'],
        ["optimizer", 43, 2, 3, "Ünïcode"],
        ["collective", 50, 5, 0, "barrier", 0, "WORLD", 2, 7, 0],
        ["collective", 60, 5, 1, "all_gather", 1024, "tp,group", 2, 8, 1],
        ["data_wait", 70, 3, 0, 1],
        ["data_wait", 71, 3, 1, 1.5],
        ["data_wait", 72, 3, 2, None],
        ["forward", 80, 10, 1, 1, 1, 9, "future field"],
        ["backward", 90, 30, 1],
        ["backward", 10**19, 1, 2],
        ["loader", 1, 0, -1, {"id": 1}],
        ["graph_scan", 95, 1, 1],
    ]
    text = [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in records]
    text.insert(3, json.dumps(["forward", 6, 1, 0, 1, 1, 4]))  # default separators: spaces
    text.insert(5, '["forward",7,1,0,1,1,5')  # corrupt in the middle
    text.append('["backward",99,1,')  # truncated
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text("\n".join(text), encoding="utf-8")
    t = read_trace(path)
    expect = _reference(text)  # ts 10**19 is not an int64: that line is skipped
    assert t.skipped_lines == 3
    assert sorted(t.events) == sorted(expect)
    for kind, rows in expect.items():
        assert _rows(t.kind(kind)) == rows, kind
    assert t.meta["loader"] == [(1, -1, {"id": 1})]
    coll = t.kind(schema.COLLECTIVE)
    assert coll.equals(0, "barrier").tolist() == [True, False]
    assert t.kind(schema.DATA_WAIT).ints(0).tolist() == [1, -1, -1]
    fwd = t.kind(schema.FORWARD)
    assert fwd.select(fwd.ints(0) == 1).step.tolist() == [0, 0, 1]


def _rows(ev) -> list[tuple]:
    return [(a, b, c, *f) for a, b, c, f in zip(ev.ts.tolist(), ev.dur.tolist(), ev.step.tolist(), ev.fields)]


def _reference(text: list[str]) -> dict[str, list[tuple]]:
    """What json makes of every event line: the reader's contract."""
    expect: dict[str, list[tuple]] = {}
    for line in text:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(rec, list)
            and len(rec) >= 4
            and rec[0] not in ("header", "loader")
            and all(type(v) is int and -(2**63) <= v < 2**63 for v in rec[1:4])
        ):
            expect.setdefault(rec[0], []).append(tuple(rec[1:]))
    return expect


def test_bulk_parser_agrees_with_json_on_random_tokens(tmp_path: Path) -> None:
    """Integers of every width and sign, leading zeros, '-', floats, exponents and odd strings:
    whatever the fast path accepts must be exactly what json reads, and the rest goes to json."""
    import random

    rng = random.Random(7)
    ints = ["0", "-0", "7", "-1", "007", "-", "1.5", "1e3", "+5", " 5", "00", "9" * 16, "1" + "0" * 15]
    ints += ["9" * 17, "-" + "9" * 16, "12345678", "123456789", "-123456789012345"]
    strings = ['"AdamW"', '""', '"a,b"', '"a\\"b"', '"é"', '"x" ', '"a"b"', '"' + "s" * 70 + '"']
    shapes = {"forward": "iiiiii", "allreduce": "iiiiii", "backward": "iii", "optimizer": "iiis"}

    def token(t: str) -> str:
        if t == "s":
            return rng.choice(strings)
        return rng.choice(ints) if rng.random() < 0.3 else str(rng.randrange(-(10**12), 10**12))

    text = [json.dumps(["header", header()])]
    for _ in range(3000):
        kind = rng.choice(sorted(shapes))
        toks = [token(t) for t in shapes[kind]]
        text.append(f'["{kind}",' + ",".join(toks) + "]")
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text("\n".join(text) + "\n", encoding="utf-8")
    t = read_trace(path)
    expect = _reference(text)
    assert t.skipped_lines == len(text) - 1 - sum(len(v) for v in expect.values())
    for kind, rows in expect.items():
        assert _rows(t.kind(kind)) == rows, kind
