"""Where a submodule's output is left out of the loss (analysis/misuse/unread.py) and where only a
method DDP never runs uses it (leftout.skips_module's "elsewhere"): read from source, once the
gradients have said which parameters got none."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.analysis.misuse.leftout import skips_module
from ddpdoctor.analysis.misuse.unread import dropped_at, key_read, output_of

SCRIPT = """
import torch.nn as nn


class Net(nn.Module):
    def forward(self, x):
        h = self.trunk(x)
        side = self.side_head(h)
        return {"main": self.main_head(h), "side": side}


class Pair(nn.Module):
    def __init__(self):
        self.trunk, self.cls, self.box, self.ranker = nn.Linear(2, 2), nn.Linear(2, 2), None, None

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.box(h)

    def evaluate(self, x):
        return self.ranker(self.trunk(x))


class Scored(nn.Module):
    def __init__(self):
        self.calib = nn.Linear(2, 2)

    def scores(self, x):
        return self.calib(x)

    def forward(self, x):
        return self.scores(x)


def loss_of(out, y, cfg):
    loss = (out["main"] - y).pow(2).mean()
    parts = {}
    if cfg.side_weight > 0:
        parts["side"] = cfg.side_weight * out["side"].mean()
    return loss + sum(parts.values())


def train(model, x, y, cfg):
    out = model(x)
    logits, _ = model(x)
    a, b = model(x)
    kept, dropped = model(x)
    return loss_of(out, y, cfg) + logits.sum() + a.sum() + b.sum() + kept.sum()
"""


def test_an_output_read_only_under_an_if_or_dropped_where_the_model_is_called(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    p = str(path)
    assert output_of(p, "Net", "side_head") == ("side", 9), "through a name assigned from it"
    assert output_of(p, "Net", "main_head") == ("main", 9)
    assert output_of(p, "Pair", "box") == (1, 18) and output_of(p, "Pair", "cls") == (0, 18)
    assert output_of(p, "Net", "trunk") is None, "it feeds both keys: which one, unsaid"
    assert output_of(p, "Missing", "x") is None and output_of(str(tmp_path / "gone.py"), "Net", "x") is None
    assert key_read([p], "side", "Net") == {  # the store into parts["side"] is no read
        "how": "if", "path": p, "line": 38, "code": "if cfg.side_weight > 0:"
    }  # fmt: skip
    assert key_read([p], "main", "Net") is None, "read outside any if"
    assert key_read([p], "aux", "Net") == {"how": "never"}
    (tmp_path / "other.py").write_text('names = ["side"]\n')
    assert key_read([p, str(tmp_path / "other.py")], "side", "Net") is None, "used some other way"
    assert dropped_at(p, 45, 1) == "logits, _ = model(x)"
    assert dropped_at(p, 45, 0) is None and dropped_at(p, 46, 1) is None, "read later"
    assert dropped_at(p, 47, 1) == "kept, dropped = model(x)", "bound to a name its function never reads"
    assert dropped_at(p, 44, 0) is None, "not unpacked"


def test_a_submodule_only_a_method_ddp_never_runs_uses(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(SCRIPT)
    found = skips_module(str(path), "Pair", "ranker")
    assert found is not None and (found["how"], found["line"], found["method"]) == (
        "elsewhere",
        21,
        "evaluate",
    )
    assert skips_module(str(path), "Scored", "calib") is None, "read by a method the forward calls"
