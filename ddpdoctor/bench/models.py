"""What `bench` trains: a built-in reference model or the user's ``module:callable``, and a loss.

Everything here is importable without side effects, because both the CLI (to fail early on a
bad ``--model``) and every worker process build the model through it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

BUILTINS = ("mlp", "convnet", "transformer")
# Small on purpose: the default bench must finish in seconds on a 2-core CPU.
DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "mlp": (256,),
    "convnet": (3, 32, 32),
    "transformer": (32, 64),  # (sequence, features)
}
NUM_CLASSES = 10
LOSSES = ("cross_entropy", "mse", "l1", "smooth_l1", "bce_with_logits")


class ModelSpecError(Exception):
    """A --model, --input-shape or --loss that cannot be used; the message says why."""


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """'3,224,224' -> (3, 224, 224): the shape of one sample, without the batch dimension."""
    if text is None or not text.strip():
        return None
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ModelSpecError(f"--input-shape {text!r}: expected integers like 3,224,224") from None
    if not shape or any(d <= 0 for d in shape):
        raise ModelSpecError(f"--input-shape {text!r}: every dimension must be positive")
    return shape


def input_shape(model: str, shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """The per-sample input shape: the one given, or the built-in model's default."""
    if shape is not None:
        return shape
    if model in DEFAULT_SHAPES:
        return DEFAULT_SHAPES[model]
    raise ModelSpecError(f"--model {model}: give the shape of one input with --input-shape (e.g. 3,224,224)")


def resolve(spec: str) -> Callable[..., Any]:
    """The callable named by ``module:callable`` (dots allowed after the colon), or a clear error.

    The current directory is importable, as it is for ``python -m``, so a project's own
    ``mypkg.models:build_model`` works from its root.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelSpecError(
            f"--model {spec!r}: expected one of {', '.join(BUILTINS)} or an import path module:callable "
            "(e.g. mypkg.models:build_model)"
        )
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(f"--model {spec!r}: cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # the user's module raised at import time
        raise ModelSpecError(f"--model {spec!r}: importing {module_name!r} failed: {exc!r}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelSpecError(f"--model {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ModelSpecError(f"--model {spec!r}: {attr!r} is not callable")
    return obj


def check_spec(spec: str) -> None:
    """Fail early (in the CLI, before any process starts) on a model that cannot be found."""
    if spec not in BUILTINS:
        resolve(spec)


def build(spec: str, shape: tuple[int, ...]) -> Any:
    """A fresh model (same seed, so every mode starts from the same weights)."""
    import torch

    torch.manual_seed(0)
    if spec in BUILTINS:
        return _builtin(spec, shape)
    model = resolve(spec)()
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"--model {spec!r}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _builtin(name: str, shape: tuple[int, ...]) -> Any:
    from torch import nn

    if name == "mlp":
        features = 1
        for d in shape:
            features *= d
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, NUM_CLASSES),
        )
    if name == "convnet":
        if len(shape) != 3:
            raise ModelSpecError(f"--model convnet takes channels,height,width; got --input-shape {shape}")
        return nn.Sequential(
            nn.Conv2d(shape[0], 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, NUM_CLASSES),
        )
    if len(shape) != 2:
        raise ModelSpecError(f"--model transformer takes sequence,features; got --input-shape {shape}")
    return _transformer_class()(shape[1])


def _transformer_class() -> type:
    from torch import nn

    class Transformer(nn.Module):
        """A 2-layer encoder, mean-pooled over the sequence, then a classifier."""

        def __init__(self, features: int) -> None:
            super().__init__()
            heads = 4 if features % 4 == 0 else 1
            layer = nn.TransformerEncoderLayer(
                features, heads, dim_feedforward=2 * features, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(features, NUM_CLASSES)

        def forward(self, x: Any) -> Any:
            return self.head(self.encoder(x).mean(dim=1))

    return Transformer


def loss_and_target(name: str, output: Any) -> tuple[Callable[[Any, Any], Any], Any]:
    """The loss function and a fixed synthetic target shaped for ``output`` (one probe forward)."""
    import torch
    from torch import nn

    gen = torch.Generator(device="cpu").manual_seed(1)
    if name == "cross_entropy":
        if output.dim() < 2:
            raise ModelSpecError("--loss cross_entropy needs (batch, classes) outputs; try --loss mse")
        target = torch.randint(0, output.shape[1], (output.shape[0],), generator=gen)
        return nn.CrossEntropyLoss(), target.to(output.device)
    losses: dict[str, Any] = {
        "mse": nn.MSELoss(),
        "l1": nn.L1Loss(),
        "smooth_l1": nn.SmoothL1Loss(),
        "bce_with_logits": nn.BCEWithLogitsLoss(),
    }
    if name in losses:
        target = torch.rand(output.shape, generator=gen) if name == "bce_with_logits" else None
        if target is None:
            target = torch.randn(output.shape, generator=gen)
        return losses[name], target.to(output.device, output.dtype)
    raise ModelSpecError(f"--loss {name!r}: expected one of {', '.join(LOSSES)}")
