"""The status file's one format (probes/status.py RankStatus): written and read the same way,
old files read, unknown keys kept, the derived values defined once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpdoctor.probes.status import STATUS_SCHEMA, RankStatus, StatusFile
from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor.statuses import read_statuses, snapshot

BARRIER = {"name": "collective", "op": "barrier", "seq": 12, "since_s": 2.5, "group": "WORLD"}


def test_a_status_round_trips_through_its_file_and_keeps_what_it_does_not_know(tmp_path: Path) -> None:
    status = RankStatus(3, world_size=4, pid=77, heartbeat_wall=100.0, step=9, phase=BARRIER)
    status.extra["from_a_newer_version"] = [1, 2]
    path = RunDir(tmp_path).status(3)
    file = StatusFile(path)
    file.write(status.replace(error={"type": "E", "message": "a long message " * 20, "wall_ns": 1}))
    file.write(status)  # shorter: rewritten in place, padded
    assert json.loads(path.read_text())["schema"] == STATUS_SCHEMA, "plain JSON to anyone who reads it"
    assert os.listdir(tmp_path) == [path.name], "no temporary file left"
    back = read_statuses(tmp_path)[3]
    assert back == status and back.to_json() == status.to_json()
    assert back.extra == {"from_a_newer_version": [1, 2]} and "lost" not in back.to_json()


def test_a_status_caught_half_rewritten_is_read_next_time(tmp_path: Path) -> None:
    path = RunDir(tmp_path).status(0)
    file = StatusFile(path)
    file.write(RankStatus(0, step=100, events=123456, heartbeat_wall=1.0))
    old = path.read_bytes()
    file.write(RankStatus(0, step=101, events=123999, heartbeat_wall=2.0))
    new = path.read_bytes()
    assert RankStatus.read(path).step == 101
    torn = [new[:cut] + old[cut:] for cut in range(1, len(old)) if new[:cut] + old[cut:] not in (old, new)]
    assert torn and all(RankStatus.read_bytes(t) is None for t in torn)
    path.write_text('{"rank": 0, "step": 7}')  # a status with no check (a test, an older version)
    assert RankStatus.read(path).step == 7


def test_an_older_or_partial_status_reads_with_its_defaults(tmp_path: Path) -> None:
    # What `attach` and run dirs of earlier versions hold: a handful of keys, nulls for some.
    st = RankStatus.from_json({"rank": 1, "pid": 5, "phase": None, "heartbeat_wall": 50.0, "error": None})
    assert (st.step, st.steps, st.seq, st.exited, st.max_step_s, st.error) == (-1, 0, -1, False, 0.0, None)
    (tmp_path / "status-rank0.json").write_text('{"rank": 0, "step": "x"}')  # corrupt: still a status
    (tmp_path / "status-rank2.json").write_text("[1, 2")  # being replaced: read next time
    statuses = read_statuses(tmp_path)
    assert sorted(statuses) == [0] and statuses[0].rank == 0 and statuses[0].step == -1


def test_seconds_in_phase_sync_waits_and_steps_are_derived_once() -> None:
    st = RankStatus(0, heartbeat_wall=100.0, step=4, phase=BARRIER)
    assert st.steps == 5 and st.in_sync and st.live_phase is not None and st.live_phase.value == "collective"
    assert st.in_phase_s(101.0) == 3.5 and st.sync_wait_s(101.0) == 3.5 and st.waits_now(101.0, 3.0)
    assert st.in_phase_s(99.0) == 2.5, "a status written after now is not younger than it says"
    data = st.replace(phase={"name": "data", "op": "next", "since_s": 9.0})
    assert data.in_phase_s(101.0) == 10.0 and data.sync_wait_s(101.0) == 0.0 and not data.in_sync
    others = snapshot({0: st, 1: data}, but=1)
    assert others == {"0": {"phase": "collective", "op": "barrier", "seq": 12, "step": 4}}


def test_the_hang_floor_is_resolved_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpdoctor.live.top import Top
    from ddpdoctor.supervisor.statuses import DEFAULT_FLOOR_S, hang_floor_s

    monkeypatch.delenv("DDPDOCTOR_HANG_FLOOR_S", raising=False)
    assert hang_floor_s() == DEFAULT_FLOOR_S == Top([]).floor_s
    monkeypatch.setenv("DDPDOCTOR_HANG_FLOOR_S", "12")
    assert hang_floor_s() == 12.0 == Top([]).floor_s, "top and the watcher use the same floor"


def test_flight_dumps_and_gpu_files_are_named_by_the_run_dir(tmp_path: Path) -> None:
    for name in (RunDir.flight_dump_name(3), "fr-rank.json", "fr-rankx.json", ".fr-rank1.json.tmp"):
        (tmp_path / name).write_text("{}")
    assert RunDir.flight_dumps(tmp_path) == {3: tmp_path / "fr-rank3.json"}
    gpu = RunDir(tmp_path).gpu("node-1.example")
    assert RunDir.gpu_host(gpu) == "node-1.example"
