"""The model fingerprint (probes/fingerprint.py): exact, complete, and off the training thread
on a GPU (faked at the torch.cuda Event/stream boundary)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ddpdoctor.probes import fingerprint as fp
from ddpdoctor.trace import schema
from tests.fake_cuda import FakeCuda

M64 = 1 << 64


def reference(t: torch.Tensor) -> int:
    """The hash in plain Python integers: sum of int(bits) * w[pos % ROW] * row_weight(pos // ROW)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.detach().reshape(-1).view(width).tolist()
    w = fp._weights(torch.device("cpu")).tolist()
    total = 0
    for pos, b in enumerate(bits):
        row = pos // fp.ROW
        rw = (row * fp._GOLDEN + 1) % M64 | 1
        total += b * w[pos % fp.ROW] * rw
    u = total % M64
    return (u ^ (u >> 53)) & fp.MASK


@pytest.fixture
def small_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 8 and chunks of 2 rows, so a small tensor crosses chunks and leaves a tail."""
    monkeypatch.setattr(fp, "ROW", 8)
    monkeypatch.setattr(fp, "CHUNK_ROWS", 2)
    monkeypatch.setattr(fp, "_WEIGHTS", {})


def test_the_hash_is_the_documented_sum_across_chunks_and_tail(small_rows: None) -> None:
    for n in (1, 7, 8, 9, 16, 37, 100):
        t = torch.randn(n)
        assert fp.hashes([t]) == [reference(t)], n


def test_bit_identical_tensors_agree_and_any_change_or_permutation_is_seen(small_rows: None) -> None:
    t = torch.randn(6, 7)
    (h,) = fp.hashes([t])
    assert fp.hashes([t.clone()]) == [h]
    assert fp.hashes([t.t().contiguous().t()]) == [h]  # same values, another memory layout
    flipped = t.clone()
    flipped.view(torch.int32)[3, 4] ^= 1  # one bit of one element
    assert fp.hashes([flipped]) != [h]
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # a permutation keeps every sum of the values
    assert fp.hashes([swapped]) != [h]
    assert fp.hashes([torch.roll(t.reshape(-1), 1)]) != [h]
    sign = torch.randn(9, dtype=torch.float64)
    flipped64 = sign.clone()
    flipped64[4] = -flipped64[4]  # the top bit of a 64-bit element
    assert fp.hashes([flipped64]) != fp.hashes([sign])
    negzero = torch.zeros(5)
    negzero[2] = -0.0
    assert fp.hashes([negzero]) != fp.hashes([torch.zeros(5)])  # bits, not values


def test_every_dtype_and_the_thread_count_do_not_matter() -> None:
    tensors = [
        torch.randn(300).bfloat16(),
        torch.randn(300).half(),
        torch.randn(300).double(),
        torch.randint(0, 100, (300,)),
        torch.rand(300) > 0.5,
        torch.randn(300, dtype=torch.complex64),
        torch.zeros(0),
    ]
    copies = [t.clone() for t in tensors]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fp.hashes(tensors)
        torch.set_num_threads(2)
        assert fp.hashes(tensors) == one
    finally:
        torch.set_num_threads(before)
    assert all(0 <= h <= fp.MASK for h in one) and one[-1] == 0
    for t, copy in zip(tensors, copies, strict=True):  # never a write into the model's tensors
        assert torch.equal(t.view(-1).view(torch.uint8), copy.view(-1).view(torch.uint8))


class _Collector:
    """What the fingerprinting uses of the collector."""

    def __init__(self) -> None:
        self.step, self.events, self.live, self.disabled = -1, 0, True, set()
        self.records: list[tuple] = []

    def put(self, record: tuple) -> None:
        self.records.append(record)


class _Wrapper(torch.nn.Module):
    """Stands in for DistributedDataParallel: the model under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _model() -> tuple[_Wrapper, list[Any]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    return _Wrapper(net), list(net.parameters())


def test_cpu_records_names_once_then_values_at_the_scheduled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, interval=4)
    f.add(ddp, 0, registered)
    opt = torch.optim.SGD(registered, lr=0.1)
    for step in range(12):
        c.step = step
        f.after_step(opt)
    f.at_exit()
    records = [r for r in c.records if r[0] == schema.FINGERPRINT]
    assert [(r[3], r[4]["at"]) for r in records] == [
        (-1, "init"),
        (0, "step"),
        (3, "step"),
        (7, "step"),
        (11, "step"),
        (11, "exit"),  # taken though step 11 was checked: a rank on another interval has only this
    ]
    first = records[0][4]
    names = [n for n, _ in ddp.module.named_parameters()] + [n for n, _ in ddp.module.named_buffers()]
    assert first["names"] == names and first["n_params"] == 6
    assert first["numels"][:2] == [32, 8]
    assert all("names" not in r[4] for r in records[1:])  # sent once, until the list changes
    tensors = list(ddp.module.parameters()) + list(ddp.module.buffers())
    assert records[-1][4]["values"] == fp.hashes(tensors)


def test_a_parameter_added_or_unfrozen_after_wrapping_is_marked_unsynced() -> None:
    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, interval=4)
    f.add(ddp, 0, registered[:4])  # the last Linear was frozen at construction
    ddp.module.extra = torch.nn.Parameter(torch.ones(3))
    side = torch.nn.Linear(2, 2)
    params = [*ddp.module.parameters(), *side.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    c.step = 0
    f.after_step(torch.optim.SGD(params, lr=0.1))
    model, outside = [r[4] for r in c.records[1:] if r[0] == schema.FINGERPRINT]
    assert [model["names"][i] for i in model["unsynced"]] == ["extra", "2.weight", "2.bias"]
    assert outside["model"] == -1 and outside["optimizer"] == 0 and outside["unsynced"] == [0, 1]
    assert outside["names"] == ["param_groups[0][7] [2, 2]", "param_groups[0][8] [2]"]
    assert outside["numels"] == [4, 2]


def test_a_module_wrapped_again_is_checked_through_the_new_wrapper_only() -> None:
    """Re-wrapped after unfreezing layers: the old wrapper may live on in a reference cycle, but
    what the job syncs is what the new one registered."""
    c = _Collector()
    old, registered = _model()
    f = fp.Fingerprints(c, interval=4)
    f.add(old, 0, registered[:4])  # the last Linear frozen at the first wrap
    new = _Wrapper(old.module)
    f.add(new, 1, registered)  # unfrozen, wrapped again: every parameter registered
    for p in registered:
        p.grad = torch.zeros_like(p)
    c.step = 0
    f.after_step(torch.optim.SGD(registered, lr=0.1))
    checked = [r[4] for r in c.records if r[4].get("at") == "step"]
    assert [r["model"] for r in checked] == [1] and "unsynced" not in checked[0]


def test_a_wrapper_freed_before_exit_is_checked_as_it_goes() -> None:
    """A main() that returns frees its wrapper before the interpreter exits (only a comm hook's
    reference cycle kept it alive): its final state is checked as it goes, once."""
    c = _Collector()
    f = fp.Fingerprints(c, interval=4)

    def train() -> list[int]:
        ddp, registered = _model()
        f.add(ddp, 0, registered)
        opt = torch.optim.SGD(registered, lr=0.1)
        for step in range(6):
            c.step = step
            f.after_step(opt)
        with torch.no_grad():
            registered[0].add_(1.0)  # a rank's own edit after the last scheduled check
        return fp.hashes(list(ddp.module.parameters()) + list(ddp.module.buffers()))

    final = train()
    f.at_exit()
    records = [r for r in c.records if r[0] == schema.FINGERPRINT]
    assert [(r[3], r[4]["at"]) for r in records] == [(-1, "init"), (0, "step"), (3, "step"), (5, "exit")]
    assert records[-1][4]["values"] == final


def test_every_model_gets_one_exit_check_however_its_wrapper_ends() -> None:
    """One wrapper freed before exit, one alive at exit and freed after it: each model's final
    state is checked once, and the first one's check does not stand in for the second's."""
    c = _Collector()
    f = fp.Fingerprints(c, interval=4)
    first, registered = _model()
    second, more = _model()
    f.add(first, 0, registered)
    f.add(second, 1, more)
    opt = torch.optim.SGD(registered + more, lr=0.1)
    for step in range(4):
        c.step = step
        f.after_step(opt)
    del first  # freed: checked as it goes
    f.at_exit()  # the second, alive
    del second  # freed after the exit check: not checked again
    exits = [(r[3], r[4]["model"]) for r in c.records if r[0] == schema.FINGERPRINT and r[4]["at"] == "exit"]
    assert exits == [(3, 0), (3, 1)]


def test_the_interval_keeps_the_cost_within_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(0, 10**12, 10**6))  # every reading of the clock: 1 ms later
    monkeypatch.setattr(fp, "_now", lambda: next(clock))
    f = fp.Fingerprints(_Collector())
    f.last = (-1, 0)  # no model yet: the first interval stays the least
    f._schedule(0, 2_000_000)
    assert f.interval == fp.MIN_INTERVAL and f.next_due == 63
    # 63 steps took ~1 ms each and a check costs 2 ms: 2 / (0.001 * 1) = 2000 -> 2048.
    f.last = (0, f.last[1] - 63 * 10**6)
    f._schedule(63, 2_000_000)
    assert f.interval == 2048 and f.next_due == 2047
    assert (f.next_due + 1) % f.interval == 0  # aligned: the ranks' checks coincide


def test_on_a_device_the_training_thread_never_waits_for_the_fingerprint() -> None:
    cuda = FakeCuda()
    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, cuda=cuda, interval=4)
    cuda.default.launch(200_000_000)  # the step's kernels keep the stream busy for 200 ms
    t0 = time.monotonic()
    f.add(ddp, 0, registered)
    assert time.monotonic() - t0 < 0.2  # returned without waiting for the stream
    assert c.records == [] and len(f.pending) == 1 and cuda.records == 1
    assert f.poll() == 0 and c.records == []  # the copy is not done: nothing read yet
    time.sleep(0.25)
    assert f.poll() == 1
    (record,) = c.records
    tensors = list(ddp.module.parameters()) + list(ddp.module.buffers())
    assert record[3] == -1 and record[4]["values"] == fp.hashes(tensors)
    assert cuda.synchronizes == 0


def test_pending_device_reads_are_written_at_exit() -> None:
    cuda = FakeCuda()
    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, cuda=cuda, interval=4)
    cuda.default.launch(50_000_000)
    f.add(ddp, 0, registered)
    c.step = 0
    f.after_step(torch.optim.SGD(registered, lr=0.1))
    f.at_exit(wait_s=2.0)
    records = [r for r in c.records if r[0] == schema.FINGERPRINT]
    assert [r[4]["at"] for r in records] == ["init", "step", "exit"]  # the exit check's read too
    assert all("values" in r[4] for r in records) and cuda.synchronizes == 0


def test_optimizer_settings_are_noted_when_they_change_at_checks_and_scheduler_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpdoctor.probes import collector, optsettings

    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, interval=4)
    f.add(ddp, 0, registered)
    monkeypatch.setattr(fp, "ACTIVE", f)
    monkeypatch.setattr(collector, "ACTIVE", c)
    monkeypatch.setattr(optsettings, "SCHEDULER_NOTES", 2)
    optsettings.install()
    opt = torch.optim.SGD(registered, lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(12):
        c.step = step
        opt.step()
        f.after_step(opt)
        sched.step()
        if step == 5:
            opt.param_groups[0]["momentum"] = 0.5  # by hand: seen at the next check (step 7)
    noted = [r for r in c.records if r[0] == schema.OPT_SETTINGS]
    notes = [(r[3], r[4]["by"], r[4]["groups"][0]["lr"], r[4]["groups"][0]["momentum"]) for r in noted]
    # The scheduler's constructor steps it once, then its first cut (after step 1); with the two
    # notes a scheduler may write spent, the checks note what the steps applied: at step 3 the
    # rate of step 1's cut (no change), at 7 and 11 the later cuts and the momentum set by hand.
    assert notes == [
        (-1, "scheduler", 0.1, 0.9),
        (1, "scheduler", 0.05, 0.9),
        (7, "check", 0.0125, 0.5),
        (11, "check", 0.003125, 0.5),
    ]
    assert all(
        r[4]["type"] == "SGD" and "params" not in r[4]["groups"][0]
        for r in c.records[1:]
        if r[0] == schema.OPT_SETTINGS
    )


def test_settings_are_numbers_as_json_holds_them() -> None:
    from ddpdoctor.probes.optsettings import settings

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01), betas=(0.8, 0.99), foreach=None)
    (group,) = settings(opt.param_groups)
    assert group["lr"] == pytest.approx(0.01) and group["betas"] == [0.8, 0.99]
    assert "foreach" not in group and "params" not in group and group["amsgrad"] is False


def test_an_optimizer_freed_notes_its_last_settings_and_the_next_gets_a_number_of_its_own() -> None:
    import gc

    c = _Collector()
    ddp, registered = _model()
    f = fp.Fingerprints(c, interval=4)
    f.add(ddp, 0, registered)
    opt = torch.optim.SGD(registered, lr=0.1)
    c.step = 0
    f.after_step(opt)
    opt.param_groups[0]["lr"] = 0.5
    c.step = 2
    del opt
    gc.collect()
    again = torch.optim.SGD(registered, lr=0.1)  # may reuse the freed one's id
    c.step = 3
    f.after_step(again)
    noted = [
        (r[3], r[4]["optimizer"], r[4]["by"], r[4]["groups"][0]["lr"])
        for r in c.records
        if r[0] == schema.OPT_SETTINGS
    ]
    assert noted == [(0, 0, "check", 0.1), (2, 0, "gone", 0.5), (3, 1, "check", 0.1)]
