"""probes/optimizer.py: one record per step of the optimizer the job calls, also when that one
steps another inside its own step (ZeroRedundancyOptimizer, Lookahead, a framework's wrapper)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddpdoctor.probes import collector as _c
from ddpdoctor.probes import optimizer as probe


class _Names:
    def intern(self, value: str) -> str:
        return value


class _Collector:
    """What the probe uses of a collector: it packs its record with the name interned."""

    def __init__(self) -> None:
        self.disabled: set[str] = set()
        self.optimizer_t0 = 0
        self.optimizer_outer: Any = None
        self.records: list[tuple] = []
        self.events = self.step = 0
        self.optimizer_kind, self.writer = "optimizer", _Names()

    def pack(self, kind: str, t0: int, t1: int, step: int, fields: tuple) -> None:
        self.records.append((kind, t0, t1, *fields))


class Wrapping(torch.optim.Optimizer):
    """Steps an inner optimizer inside its own step, then does work of its own (ZeRO's sync)."""

    def __init__(self, params: list[torch.Tensor], fail: bool = False) -> None:
        self.inner = torch.optim.SGD(params, lr=0.1)
        super().__init__(params, {})
        self.fail = fail

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()
        if self.fail:
            self.fail = False
            raise RuntimeError("the wrapper's own work failed")


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Collector]:
    c = _Collector()
    monkeypatch.setattr(_c, "ACTIVE", c)
    handles = [
        register_optimizer_step_pre_hook(probe._pre),
        register_optimizer_step_post_hook(probe._post),
    ]
    yield c
    for h in handles:
        h.remove()


def test_a_wrapper_s_step_is_one_step_named_after_the_wrapper(collector: _Collector) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = Wrapping([p])
    opt.step()
    opt.step()
    assert [r[3] for r in collector.records] == ["Wrapping", "Wrapping"]
    plain = torch.optim.SGD([p], lr=0.1)  # and a plain optimizer after it: its own record
    plain.step()
    assert collector.records[-1][3] == "SGD"


def test_a_step_that_raised_does_not_swallow_the_next(collector: _Collector) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = Wrapping([p], fail=True)
    with pytest.raises(RuntimeError):
        opt.step()
    opt.step()
    assert [r[3] for r in collector.records] == ["Wrapping"]
