"""Device spans from CUDA events, against a fake that keeps the device running behind the CPU."""

from __future__ import annotations

import random
import time

import pytest

from ddpdoctor.probes import cuda_timing
from ddpdoctor.probes.cuda_timing import DeviceTimer
from ddpdoctor.trace import schema
from tests.fake_cuda import FakeCuda, FakeEvent, FakeStream

MS = 1_000_000


def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def one_step(timer: DeviceTimer, cuda: FakeCuda, comm: FakeStream, step: int, slow_ns: int = 0) -> dict:
    """A DDP step as the device sees it; returns the true device times (monotonic ns)."""
    truth = {}
    fwd = timer.begin(schema.DEV_FORWARD, step, (1, 1, step, 0))
    cuda.default.launch(20 * MS)
    timer.finish(fwd)
    truth["forward"] = (fwd.start.done_at, fwd.end.done_at)
    bwd = timer.begin(schema.DEV_BACKWARD, step)
    ready = cuda.default.launch(10 * MS + slow_ns)
    bucket = timer.begin(schema.DEV_ALLREDUCE, step, (0, 4096, step))  # the comm hook's entry
    reduced = comm.launch(15 * MS, after=ready)
    # The future's callback runs now, long before the device has reduced anything; its
    # current stream is one that waits for the collective.
    assert not bucket.start.query()
    cuda.set_stream(comm)
    timer.finish(bucket)
    cuda.set_stream(None)
    cuda.default.wait_until(reduced)  # DDP's finalize makes the compute stream wait
    timer.finish(bwd)
    truth["allreduce"] = (bucket.start.done_at, bucket.end.done_at)
    truth["backward"] = (bwd.start.done_at, bwd.end.done_at)
    opt = timer.begin(schema.DEV_OPTIMIZER, step, ("SGD",))
    cuda.default.launch(5 * MS)
    timer.finish(opt)
    truth["optimizer"] = (opt.start.done_at, opt.end.done_at)
    return truth


def by_kind(out: list[tuple]) -> dict[str, list[tuple]]:
    kinds: dict[str, list[tuple]] = {}
    for ev in out:
        kinds.setdefault(ev[0], []).append(ev)
    return kinds


def test_spans_are_device_times_on_the_monotonic_clock() -> None:
    """The CPU races ahead (every launch returns at once); the spans are what the device did."""
    cuda, out = FakeCuda(), []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=0.002)
    comm = FakeStream("nccl")
    t_cpu = time.monotonic_ns()
    truths = [one_step(timer, cuda, comm, step) for step in range(3)]
    assert time.monotonic_ns() - t_cpu < 40 * MS  # the CPU launched 3 x 50 ms of work at once
    assert out == []  # and nothing has completed on the device yet
    wait_for(lambda: len(out) == 12)
    timer.stop()
    kinds = by_kind(out)
    for name, kind in [
        ("forward", schema.DEV_FORWARD),
        ("backward", schema.DEV_BACKWARD),
        ("allreduce", schema.DEV_ALLREDUCE),
        ("optimizer", schema.DEV_OPTIMIZER),
    ]:
        assert [ev[3] for ev in kinds[kind]] == [0, 1, 2]
        for ev, truth in zip(kinds[kind], truths, strict=True):
            start, end = truth[name]
            assert abs(ev[1] - start) < MS and abs(ev[2] - end) < MS, (name, ev, truth[name])
    for ev in kinds[schema.DEV_ALLREDUCE]:
        assert 14 * MS < ev[2] - ev[1] < 16 * MS and ev[4:] == (0, 4096, ev[3])
    for ar, bwd in zip(kinds[schema.DEV_ALLREDUCE], kinds[schema.DEV_BACKWARD], strict=True):
        assert bwd[1] < ar[1] < ar[2] <= bwd[2]  # gradients ready inside backward; reduced by its end
    assert cuda.synchronizes == 0


def test_events_are_pooled_and_recycled() -> None:
    cuda, out = FakeCuda(), []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=0.001)
    comm = FakeStream("nccl")
    for step in range(30):
        one_step(timer, cuda, comm, step)
        wait_for(lambda s=step: len(out) == 4 * (s + 1))  # the job syncs once a step (loss.item())
    timer.stop()
    assert cuda.records >= 30 * 8
    assert cuda.events_created <= 16  # 8 per step in flight, an anchor, the reference


def test_one_stream_is_one_stream_however_often_it_is_asked_for() -> None:
    """``current_stream()`` returns a new object at every call: the streams the resolver takes
    anchors on are counted by handle (by ``id`` they grew by one a span: thousands of anchor
    records per poll, the resolver holding the GIL against the training thread)."""
    cuda, out = FakeCuda(), []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=0.001)
    comm = FakeStream("nccl")
    for step in range(10):
        one_step(timer, cuda, comm, step)
    wait_for(lambda: len(out) == 40)
    timer.stop()
    assert len(timer.streams) == 1  # spans begin on the default stream (by id: 41 of them)


def test_the_offset_is_the_largest_bound_in_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_timing, "WINDOW_NS", 50)
    timer = DeviceTimer([].append, "cuda:0", FakeCuda(), poll_s=60.0)
    timer.stop(flush=False)
    timer.bounds.clear()
    rng = random.Random(3)
    seen: list[tuple[int, float]] = []
    for t in range(1, 2000, 3):
        device_ns = rng.uniform(0, 100)
        timer._bound(t, device_ns)
        seen.append((t, t - device_ns))
        assert timer.offset() == max(b for tc, b in seen if tc >= t - 50)
    assert len(timer.bounds) <= 17  # at most the window's bounds, most of them dropped sooner


def test_memory_is_bounded_and_drops_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_timing, "MAX_EVENTS", 10)
    cuda, out = FakeCuda(), []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=60)  # the resolver never runs
    spans = []
    for step in range(6):
        fwd = timer.begin(schema.DEV_FORWARD, step, (1, 1, step, 0))
        timer.finish(fwd)
        spans.append(fwd)
    assert cuda.events_created == 11  # the pool's 10 and the reference
    assert spans[-1] is None and timer.dropped >= 1
    wait_for(lambda: cuda.default.query())
    timer.stop()  # resolves what completed: the spans that got both events
    assert [ev[3] for ev in out] == [0, 1, 2, 3, 4]


def test_a_device_error_switches_timing_off_once() -> None:
    cuda, out, errors = FakeCuda(), [], []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=60, on_error=errors.append)
    cuda_timing.ACTIVE = timer
    try:

        def broken(self, stream=None):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        from tests import fake_cuda

        original = fake_cuda.FakeEvent.record
        fake_cuda.FakeEvent.record = broken
        try:
            assert timer.begin(schema.DEV_FORWARD, 0) is None
            assert timer.begin(schema.DEV_FORWARD, 1) is None
        finally:
            fake_cuda.FakeEvent.record = original
        assert len(errors) == 1 and cuda_timing.ACTIVE is None
    finally:
        cuda_timing.ACTIVE = None
        timer.stop(flush=False)


def test_cpu_models_start_no_timer() -> None:
    import torch

    assert cuda_timing.device_of(torch.nn.Linear(2, 2)) is None


def test_nothing_is_recorded_or_queried_during_a_cuda_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, out = FakeCuda(), []
    timer = DeviceTimer(out.append, "cuda:0", cuda, poll_s=60)
    before = timer.begin(schema.DEV_FORWARD, 0, (1, 1, 0))
    monkeypatch.setattr(cuda_timing, "CAPTURING", 1)
    records = cuda.records
    assert timer.begin(schema.DEV_BACKWARD, 0) is None
    timer.finish(before)  # a span cut by the capture
    assert cuda.records == records
    queried = []
    monkeypatch.setattr(FakeEvent, "query", lambda self: queried.append(self) or True)
    assert timer.poll() == 0 and queried == []
    monkeypatch.undo()
    wait_for(cuda.default.query)
    timer.stop()
    assert out == [] and before.start in timer.free  # its event came back to the pool


def test_graph_captures_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_timing, "CAPTURING", 0)
    seen = []
    begin = cuda_timing.counting_begin(lambda graph: seen.append(cuda_timing.CAPTURING))
    end = cuda_timing.counting_end(lambda graph: seen.append(cuda_timing.CAPTURING))
    begin(None)
    end(None)
    assert seen == [1, 1] and cuda_timing.CAPTURING == 0

    def fails(graph):
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        cuda_timing.counting_begin(fails)(None)
    assert cuda_timing.CAPTURING == 0
    cuda_timing._watch_captures()  # patches torch.cuda.CUDAGraph, which exists without a GPU too
    from torch.cuda.graphs import CUDAGraph

    from ddpdoctor.probes.patching import original

    assert original(CUDAGraph.capture_begin) is not CUDAGraph.capture_begin
