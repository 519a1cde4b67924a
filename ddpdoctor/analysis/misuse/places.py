"""Where a divergence was made, for a run: the ranks' records of ``load_state_dict`` calls and of
parameters a first forward changed, and ``wrote.py``'s readings of the user's script, in the
file where the lowest rank that built DDP model ``model`` wrapped it (or in every file the ranks
recorded a line in), each as (file:line, the lines said) for a finding's place and text, and
None where the script does not say or says it in more than ``_SHOWN`` places."""

from __future__ import annotations

import os
from collections import defaultdict

from ddpdoctor.analysis.failed.ledger import recorded_files, sites_of
from ddpdoctor.analysis.misuse.models import builder, ddp_models, wrapped_file
from ddpdoctor.analysis.misuse.wrote import (
    Wrote,
    grads_written_after,
    written_after,
    written_anywhere,
    written_in_forward,
    written_later,
    wrote_after_wrapping,
)
from ddpdoctor.trace import schema
from ddpdoctor.trace.reader import Run

_SHOWN = 3


def loads_of(run: Run, model: int, target: str) -> dict[int, list[tuple[int, int, str]]]:
    """rank -> [(ts, step, file:line)] of load_state_dict calls on ``model`` (or an optimizer)."""
    out: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for rank, trace in run.ranks.items():
        sites = sites_of(trace)
        for ts, step, info in trace.meta.get(schema.LOAD_STATE, []):
            if info.get("target") != target or (target == "model" and info.get("model") != model):
                continue
            out[rank].append((ts, step, sites.get(info.get("site", -1), "")))
    return out


def changed_in_forward(run: Run, model: int) -> dict[str, str]:
    """name -> the module holding it, for the parameters a first forward of ``model`` changed
    in place on some rank (``probes/ddp_model.py``)."""
    out: dict[str, str] = {}
    for trace in run.ranks.values():
        for _, _, info in trace.meta.get(schema.INPLACE, []):
            if info.get("model") == model:
                owners = info.get("modules") or {}
                out.update({n: str(owners.get(n, "")) for n in info.get("params", [])})
    return out


def in_script_after_wrapping(run: Run, model: int, names: list[str]) -> tuple[str, str] | None:
    """The one statement after the model's wrapping, before its loops, that writes ``names``
    (``wrote_after_wrapping``)."""
    where = _wrapped(run, model)
    found = wrote_after_wrapping(*where, names) if where is not None else None
    if found is None or where is None:
        return None
    return f"{os.path.basename(where[0])}:{found.line}", found.text(*where)


def in_script_later(run: Run, model: int) -> tuple[str, str] | None:
    """The statements in the loops after the wrapping that write its weights under a condition
    (``written_later``), the first ``_SHOWN``: "f:L (`code`, under `if ...:`, writing at f:L)"."""
    where = _wrapped(run, model)
    return _said(where, written_later(*where)[:_SHOWN]) if where is not None else None


def in_script_after(run: Run, model: int, names: list[str]) -> tuple[str, str] | None:
    """The statements after the wrapping that write ``names``, with a condition or without
    (``written_after``)."""
    where = _wrapped(run, model)
    found = written_after(*where, names) if where is not None else []
    return _said(where, found) if where is not None and len(found) <= _SHOWN else None


def in_script_grads(run: Run, model: int) -> tuple[str, str, int | None] | None:
    """The statements after the wrapping that write gradients (``grads_written_after``), and the
    one rank they are written on where each sits under an ``if`` that holds only for that rank
    (`if rank == 0 and step % 10 == 0:`), else None."""
    where = _wrapped(run, model)
    found = grads_written_after(*where) if where is not None else []
    said = _said(where, found) if where is not None and len(found) <= _SHOWN else None
    if said is None:
        return None
    pinned = {w.rank for w in found}
    return said[0], said[1], pinned.pop() if len(pinned) == 1 else None


def in_forward(run: Run, owners: dict[str, str]) -> tuple[str, str] | None:
    """Where the user's files write these parameters in a forward (``written_in_forward``;
    name -> the class holding it)."""
    files = recorded_files(run)
    return _listed(
        sorted({w for name, owner in owners.items() for w in written_in_forward(files, owner, name)})
    )


def in_place_anywhere(run: Run, names: list[str]) -> tuple[str, str] | None:
    """Where the user's files write these tensors in place, in any function (``written_anywhere``)."""
    return _listed(written_anywhere(recorded_files(run), names))


def _wrapped(run: Run, model: int) -> tuple[str, int] | None:
    owner, models = builder(run), ddp_models(run)
    return wrapped_file(owner, models[model]) if owner is not None and 0 <= model < len(models) else None


def _said(where: tuple[str, int], found: list[Wrote]) -> tuple[str, str] | None:
    if not found:
        return None
    name = os.path.basename(where[0])
    said = [
        f"{name}:{w.line} (`{w.code}`{f', under `{w.under[1]}`' if w.under else ''}"
        f"{f', writing at {name}:{w.write[0]}' if w.write else ''})"
        for w in found
    ]
    return f"{name}:{found[0].line}", ", ".join(said)


def _listed(found: list[tuple[str, int, str]]) -> tuple[str, str] | None:
    if not found or len(found) > _SHOWN:
        return None
    said = ", ".join(f"{os.path.basename(p)}:{n} (`{code}`)" for p, n, code in found)
    return f"{os.path.basename(found[0][0])}:{found[0][1]}", said
