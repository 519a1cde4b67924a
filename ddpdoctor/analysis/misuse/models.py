"""The DistributedDataParallel models a job built, as the run header and the findings name them.

A job may wrap several models (a GAN's generator and discriminator, a teacher and a student):
each ``ddp_init`` record carries the model's index on its rank, and each ``unused`` record the
index of the model it is about, so the header and every finding speak of the same model.
"""

from __future__ import annotations

from typing import Any

from ddpdoctor.analysis.failed.ledger import sites_of
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import RankTrace, Run


def rank_models(trace: RankTrace) -> list[dict[str, Any]]:
    """One rank's DDP constructor records, in construction order."""
    init = trace.kind(schema.DDP_INIT)
    return [dict(f[0]) for f in init.fields if f and isinstance(f[0], dict)]


def builder(run: Run) -> RankTrace | None:
    """The lowest rank that built a DDP model: the job's models are named as it saw them."""
    return next((t for _, t in sorted(run.ranks.items()) if rank_models(t)), None)


def ddp_models(run: Run) -> list[dict[str, Any]]:
    """Every DDP model of the job, as the lowest rank that built any saw them."""
    trace = builder(run)
    return rank_models(trace) if trace is not None else []


def wrapped_at(trace: RankTrace, model: dict[str, Any]) -> str:
    """Where ``trace``'s rank wrapped ``model`` in DDP, as file:line (its user's line), or ""."""
    site = model.get("site")
    return sites_of(trace).get(site, "") if isinstance(site, int) else ""


def wrapped_file(trace: RankTrace, model: dict[str, Any]) -> tuple[str, int] | None:
    """Where ``trace``'s rank wrapped ``model`` in DDP: the file's path as recorded, and the line."""
    site = model.get("site")
    for _, _, info in trace.meta.get(schema.SITE, []):
        if isinstance(site, int) and info.get("id") == site and isinstance(info.get("line"), int):
            return str(info.get("file")), int(info["line"])
    return None


def model_of(trace: RankTrace, record: dict[str, Any]) -> dict[str, Any]:
    """The model an ``unused`` record is about (the last built, for traces without the index)."""
    models = rank_models(trace)
    if not models:
        return {}
    index = record.get("model")
    return models[index] if isinstance(index, int) and 0 <= index < len(models) else models[-1]


def label(model: dict[str, Any], models: list[dict[str, Any]]) -> str:
    """How findings name a model: its class, with its index when the job has several."""
    name = str(model.get("module", "model"))
    return f"{name} (DDP model #{model.get('index', 0)})" if len(models) > 1 else name


def alike_runs(models: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Consecutive models alike (class, parameters, buckets, options), each run named once: a
    job that wraps its module again each epoch, or after each error it catches, builds hundreds."""
    runs: list[tuple[tuple[str, ...], list[dict[str, Any]]]] = []
    for model in models:
        opts = sorted(f"{k}={v!r}" for k, v in model.get("options", {}).items())
        key = (
            str(model.get("module", "model")),
            str(model.get("params", 0)),
            str(len(model.get("buckets", []))),
        )
        key += tuple(opts)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(model)
        else:
            runs.append((key, [model]))
    named = []
    for key, group in runs:
        if len(group) == 1:
            named.append((label(group[0], models), group))
        else:
            first, last = group[0].get("index", 0), group[-1].get("index", 0)
            named.append((f"{key[0]} (DDP models #{first}-#{last}, {len(group)} wrappers alike)", group))
    return named
