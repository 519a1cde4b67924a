"""Clock alignment: a rank with a deliberately wrong wall clock still lines up with rank 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import JOBS, run_doctor, torchrun

from ddpdoctor.trace import schema
from ddpdoctor.trace.merge import time_base
from ddpdoctor.trace.reader import load_run
from ddpdoctor.trace.synthetic import SyntheticJob, write_run

SKEW_S = 3.0


def _barrier_ends(run, tb, rank: int) -> np.ndarray:
    coll = run.ranks[rank].kind(schema.COLLECTIVE)
    keep = np.array([f[0] == "barrier" for f in coll.fields])
    return tb.rel(rank, coll.end[keep])


@pytest.mark.e2e
def test_skewed_rank_is_aligned_by_measured_offset(tmp_path: Path) -> None:
    job = run_doctor(tmp_path, torchrun(2, JOBS / "skewed_clock_train.py"), TEST_CLOCK_SKEW_S=str(SKEW_S))
    assert job.returncode == 0, job.stderr
    run = load_run([job.run_dir])
    info = run.ranks[1].meta[schema.CLOCK][0][2]
    # The probe measured rank 1's clock to be SKEW_S ahead, to within its round trip.
    assert abs(info["offset_ns"] + SKEW_S * 1e9) < max(info["rtt_ns"], 5e6)
    assert run.ranks[0].meta[schema.CLOCK][0][2]["offset_ns"] == 0
    # Wall clocks alone put rank 1 three seconds off; aligned, barrier exits coincide.
    raw = [run.ranks[r].wall_offset_us() for r in (0, 1)]
    assert abs((raw[1] - raw[0]) / 1e6 - SKEW_S) < 1.0
    tb = time_base(run)
    e0, e1 = _barrier_ends(run, tb, 0), _barrier_ends(run, tb, 1)
    assert len(e0) == len(e1) == 6
    # A misaligned rank is off at every step; one step's exit may be late on a busy host (the
    # last barrier releases the ranks into their exit work), so the median says it.
    assert abs(np.median(e1 - e0)) < 5_000, e1 - e0  # µs


def test_merge_applies_offsets_across_run_dirs(tmp_path: Path) -> None:
    dirs = write_run(SyntheticJob(ranks=8, steps=5, ranks_per_host=4, host_skew_us={1: 2_500_000}), tmp_path)
    assert len(dirs) == 2
    run = load_run(dirs)
    tb = time_base(run)
    assert tb.max_skew_us == 2_500_000
    # Bucket 0's all-reduce ends at one instant on every rank (it waits for the last one).
    ends = {r: tb.rel(r, run.ranks[r].kind(schema.ALLREDUCE).end)[0] for r in run.ranks}
    assert len(set(ends.values())) == 1, ends
    # Without the clock records the second host is 2.5 s off, and the merge says so.
    dirs = write_run(
        SyntheticJob(ranks=8, steps=5, ranks_per_host=4, host_skew_us={1: 2_500_000}, record_clock=False),
        tmp_path / "unmeasured",
    )
    run = load_run(dirs)
    tb = time_base(run)
    ends = [tb.rel(r, run.ranks[r].kind(schema.ALLREDUCE).end)[0] for r in (0, 4)]
    assert ends[1] - ends[0] == 2_500_000
    assert any("not measured" in n for n in tb.notes)
