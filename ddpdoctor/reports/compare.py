"""`ddpdoctor compare`: the terminal rendering of ``analysis.compare`` (80 columns)."""

from __future__ import annotations

import textwrap
from typing import Any

WIDTH = 80


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(cmp: dict[str, Any]) -> str:
    a, b = cmp["a"], cmp["b"]
    lines = [
        "ddpdoctor compare (ratio = B / A)",
        f"  A: {', '.join(a['run_dirs'])}",
        f"  B: {', '.join(b['run_dirs'])}",
        "",
        f"  {'':<22}{'A':>12}{'B':>12}{'B/A':>10}",
    ]

    def row(label: str, va: str, vb: str, ratio: str = "") -> None:
        lines.append(f"  {label:<22}{va:>12}{vb:>12}{ratio:>10}")

    row("ranks", str(a["world_size"]), str(b["world_size"]))
    row("steps", str(a["steps"]), str(b["steps"]))
    row("global batch", _num(a["global_batch"], "{}"), _num(b["global_batch"], "{}"))
    row("exit code", _num(a["exit_code"], "{}"), _num(b["exit_code"], "{}"))
    tp = cmp["throughput"]
    row(
        "steps/s",
        _num(a["steps_per_s"], "{:.2f}"),
        _num(b["steps_per_s"], "{:.2f}"),
        _ratio(tp["steps_per_s_ratio"]),
    )
    row("samples/s", _num(a["samples_per_s"]), _num(b["samples_per_s"]), _ratio(tp["samples_per_s_ratio"]))
    lines.append("  step time (ms, all ranks)")
    for q in ("mean", "p50", "p95", "max"):
        row(f"    {q}", _ms(a["step_time_s"][q]), _ms(b["step_time_s"][q]), _ratio(cmp["step_time_ratio"][q]))
    if cmp["phases"]:
        lines.append("  phases (ms per step, mean over ranks)")
        for phase, v in cmp["phases"].items():
            row(f"    {phase}", _ms(v["a"]), _ms(v["b"]), _ratio(v["ratio"]))
    lines.append("")
    found = cmp["findings"]
    for side, key in (("A", "only_a"), ("B", "only_b")):
        for f in found[key]:
            milder = f" (the other: {f['other_severity']})" if f.get("other_severity") else ""
            lines += textwrap.wrap(
                f"only in {side}: {f['severity']} {f['kind']}{milder}: {f['summary']}",
                WIDTH - 2,
                initial_indent="  ",
                subsequent_indent="      ",
            )
    if found["both"]:
        lines.append(f"  in both: {', '.join(found['both'])}")
    if not (found["only_a"] or found["only_b"] or found["both"]):
        lines.append("  No findings in either run.")
    return "\n".join(lines)
