"""`top`'s replica check: do the ranks still hold the same weights, from their status files?

Each rank's status carries its last few model fingerprint checks, one number for all the
parameters of each DDP model and one for its buffers (probes/recent.py). Per model, `top`
takes the latest check every rank has (same step, same moment: after construction, after an
optimizer step, at exit) and compares the parameters' numbers. Ranks at different checks, or a
rank without one yet, are not compared: the next refresh will have a common one. Buffers are
not compared: DDP broadcasts them every forward and each rank's BatchNorm then updates them from
its own batch, and with ``broadcast_buffers=False`` they differ by design (the analysis judges
them, analysis/misuse/divergence.py). Only the analysis, with every tensor's fingerprint, names the
parameters and the cause.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ddpdoctor.analysis.findings import rank_list
from ddpdoctor.analysis.misuse.fingerprints import AT_ORDER, Key, odd_ranks, when_checked
from ddpdoctor.probes.status import RankStatus


def _checks(statuses: Mapping[int, RankStatus]) -> dict[int, dict[int, dict[Key, tuple[int, int]]]]:
    """model -> rank -> {check: (the parameters' number, the rank's own step)}, each rank's in
    the order it took them. A check after an optimizer step is keyed by the sequence number of
    its step's first gradient all-reduce where every rank's status says it (the step every
    rank shares: under a Join a rank's own count stands still while it shadows the others),
    else by the rank's own step."""
    out: dict[int, dict[int, dict[Key, tuple[int, int]]]] = defaultdict(lambda: defaultdict(dict))
    by_seq = all(
        isinstance(fp.get("seq"), int)
        for st in statuses.values()
        for fp in st.fingerprints or []
        if fp.get("at") == "step"
    )
    for rank, st in statuses.items():
        for fp in st.fingerprints or []:
            try:
                model, step, at, params = int(fp["model"]), int(fp["step"]), fp["at"], int(fp["params"])
            except (KeyError, TypeError, ValueError):
                continue
            if at in AT_ORDER:
                key = (int(fp["seq"]) if by_seq and at == "step" else step, AT_ORDER[at], at)
                out[model][rank][key] = (params, step)
    return out


def weights_diverged(statuses: Mapping[int, RankStatus]) -> list[dict[str, Any]]:
    """A ``weights_diverged`` finding per DDP model whose ranks' parameters differ at the latest
    check every rank took (the ranks named differ from the majority; on a tie, all)."""
    out: list[dict[str, Any]] = []
    for model, by_rank in sorted(_checks(statuses).items()):
        if len(by_rank) < 2 or len(by_rank) < len(statuses):
            continue  # a rank without a check of this model yet
        common = set.intersection(*(set(checks) for checks in by_rank.values()))
        if not common:
            continue
        first = by_rank[min(by_rank)]
        key = max(common, key=list(first).index)  # the latest: the checks are in the order taken
        groups: dict[int, list[int]] = defaultdict(list)
        for rank in sorted(by_rank):
            groups[by_rank[rank][key][0]].append(rank)
        step = max(checks[key][1] for checks in by_rank.values())  # a rank that never joined's
        if len(groups) < 2:
            continue
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
        odd = odd_ranks(ordered, set())
        who = (
            f"on rank(s) {rank_list(odd)} differ from the other ranks'"
            if len(odd) < len(by_rank)
            else f"differ across ranks {rank_list(odd)} (no majority)"
        )
        at = ("at " if key[2] == "step" else "") + when_checked((step, *key[1:]))
        text = (
            f"DDP model #{model}: the parameters {who} {at}: the replicas no longer "
            "hold the same weights. `ddpdoctor diagnose` names the parameters and the cause."
        )
        out.append(
            {"kind": "weights_diverged", "ranks": odd, "model": model, "step": step, "at": key[2],
             "groups": ordered, "text": text}
        )  # fmt: skip
    return out
