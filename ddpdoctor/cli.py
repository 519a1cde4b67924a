"""The command line: wiring only; each command calls into supervisor, analysis and reports.

Exit codes: `run` and `demo` exit with the job's own code (128+N when a signal killed it),
except that `run --on-hang kill` exits 124 (as timeout(1) does) when it stopped a hung job;
`diagnose` exits 0 when it finds no error, 1 when a finding has severity "error", and 2 when
its input cannot be read (or the command line is wrong).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

import ddpdoctor
from ddpdoctor.cli_common import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_HANG_KILLED, fail, fresh_out, leave  # noqa: F401
from ddpdoctor.cli_common import load_run_dirs as _load
from ddpdoctor.rundir import RunDir


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ddpdoctor.__version__, prog_name="ddpdoctor")
def main() -> None:
    """Diagnose PyTorch DistributedDataParallel jobs: hangs, stragglers and DDP misuse.

    \b
    ddpdoctor run -- torchrun --nproc_per_node 4 train.py   # no change to train.py
    ddpdoctor diagnose ddpdoctor-runs/<timestamp>
    ddpdoctor report RUN_DIR [RUN_DIR ...] -o report.html
    ddpdoctor report RUN_DIR [RUN_DIR ...] -o trace.json   (Perfetto)
    ddpdoctor top RUN_DIR [RUN_DIR ...]                    # a running job, rank by rank
    ddpdoctor attach PID                                   # a job started without ddpdoctor
    """


def _nvml_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--nvml-interval and --no-nvml, shared by `run` and `demo`."""
    func = click.option("--no-nvml", is_flag=True, help="Do not sample GPUs.")(func)
    return click.option(
        "--nvml-interval",
        type=float,
        default=0.5,
        show_default=True,
        metavar="SECONDS",
        help="Sample this node's GPUs through NVML this often (utilisation, memory, power, "
        "clocks, temperature, throttling, memory per rank).",
    )(func)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory, new or without an earlier run (default: ./ddpdoctor-runs/<timestamp>).",
)
@click.option(
    "--hang-timeout",
    default="auto",
    show_default=True,
    metavar="SECONDS|auto",
    help="Hangs the ranks' statuses prove are reported at once; a rank that stalls (no CPU, same "
    "stack) after this long; a wait on a busy rank only past an explicit value. "
    "auto: 5x the slowest step seen, at least 30 s (DDPDOCTOR_HANG_FLOOR_S).",
)
@click.option(
    "--on-hang",
    type=click.Choice(["dump", "kill"]),
    default="dump",
    show_default=True,
    help="dump: report stacks and diagnosis, keep waiting (the job may recover). "
    "kill: report, then stop the job and exit 124.",
)
@_nvml_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    out: str | None,
    hang_timeout: str,
    on_hang: str,
    nvml_interval: float,
    no_nvml: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (torchrun, python -m torch.distributed.run, mp.spawn...) under the doctor.

    \b
    Example:  ddpdoctor run -- torchrun --nproc_per_node 2 train.py --epochs 3
    The job's output, results and exit code are unchanged; ddpdoctor adds one banner line,
    a closing summary (on stderr) and a run directory holding every rank's trace.

    Multi-node: one `ddpdoctor run` per node. Under torchrun --nnodes N the nodes share their
    ranks' liveness through the job's own rendezvous store and print one verdict for the whole
    job (DDPDOCTOR_STORE=host:port names another store, =off keeps each node to itself).

    Gradient buckets are timed by a comm hook, and any comm hook costs a step something (one
    more pass over the gradients; in Python, 50-150 µs a bucket). DDPDOCTOR_BUCKET_TIMING=auto
    (the default) times them where a step can carry it (0.5 % of a step; the summary says where
    not), =on always, =off never (no per-bucket spans; stragglers measured by their time in
    backward).
    """
    watch = _watch_options(hang_timeout, on_hang)
    sys.exit(_run_and_summarise(list(command), out, watch, _nvml_interval(nvml_interval, no_nvml)))


def _nvml_interval(interval: float, off: bool) -> float | None:
    """Seconds between GPU samples, or None when sampling is off."""
    if off:
        return None
    if not interval > 0:
        raise click.BadParameter("must be positive", param_hint="--nvml-interval")
    return interval


def _watch_options(hang_timeout: str, on_hang: str) -> object:

    from ddpdoctor import _env
    from ddpdoctor.supervisor.launch import WatchOptions

    timeout: float | None = None
    if hang_timeout != "auto":
        try:
            timeout = float(hang_timeout)
        except ValueError:
            raise click.BadParameter("a number of seconds, or auto", param_hint="--hang-timeout") from None
        if timeout <= 0:
            raise click.BadParameter("must be positive", param_hint="--hang-timeout")
    try:  # the ranks' settings too: a bad value stops here, in one line, not in every rank
        floor = _env.number(_env.HANG_FLOOR, 0.0) or None
        _env.writer_settings()
        _env.bucket_timing()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return WatchOptions(timeout, on_hang, floor)


def _run_and_summarise(
    command: list[str], out: str | None, watch: object = None, nvml_interval: float | None = None
) -> int:
    from ddpdoctor.rundir import new_run_dir
    from ddpdoctor.supervisor.launch import WatchOptions, banner, eprint, run_job

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise click.UsageError("no command to run: ddpdoctor run -- COMMAND ...")
    fresh_out(out)
    if shutil.which(command[0]) is None and not os.path.exists(command[0]):  # before an empty run dir
        click.echo(f"ddpdoctor: cannot start {command[0]!r}: command not found", err=True)
        return EXIT_NOT_FOUND
    try:
        run_dir = new_run_dir(out)
    except OSError as exc:
        raise click.ClickException(f"cannot create the run directory: {exc}") from exc
    eprint(banner(run_dir))
    try:
        watching = watch if isinstance(watch, WatchOptions) else WatchOptions()
        result = run_job(command, run_dir, watching, nvml_interval=nvml_interval)
    except OSError as exc:
        raise click.ClickException(f"cannot start {command[0]!r}: {exc.strerror or exc}") from exc
    eprint(_startup_text(run_dir) or _summary_text(run_dir))
    return EXIT_HANG_KILLED if result.killed_on_hang else result.exit_code


def _startup_text(run_dir: Path) -> str:
    """The one-line cause of a job that failed before any rank started recording, or ""."""
    try:
        from ddpdoctor.probes import startup

        meta = json.loads((run_dir / RunDir.RUN_META).read_text(encoding="utf-8"))
        started = int(meta.get("started_ns") or 0)
        errors = [e for e in startup.read(run_dir) if int(e.get("wall_ns") or 0) >= started]
        if not errors or RunDir(run_dir).traces():
            return ""
        return f"ddpdoctor: startup failed: {errors[0]['line']}\n  run dir: {run_dir}"
    except Exception:
        return ""


def _summary_text(run_dir: Path) -> str:
    """The closing summary and report.html; never lets a reporting problem hide the job's own
    exit code."""
    from ddpdoctor.analysis import diagnose
    from ddpdoctor.reports import terminal
    from ddpdoctor.trace.reader import TraceError, load_run

    try:
        diag = diagnose(load_run([run_dir]))
        report = _write_report(diag, RunDir(run_dir).path / RunDir.REPORT)
        text = terminal.render(diag, report=report)
    except TraceError as exc:
        text = f"ddpdoctor: nothing recorded ({exc}); did the job call init_process_group?"
    except Exception as exc:  # a bug of ours must not change the job's exit code
        text = f"ddpdoctor: could not summarise the run: {exc!r}"
    return f"{text}\n  run dir: {run_dir}"


def _write_report(diag: object, path: Path) -> str:
    """Write the HTML report; returns its path, or why there is none (never raises)."""
    from ddpdoctor import reports

    try:
        reports.write(diag, path, "html")
    except Exception as exc:  # a report failure is reported, never fatal
        return f"not written ({exc!r})"
    return str(path)


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.diagnosis/1).")
def diagnose(run_dirs: tuple[str, ...], as_json: bool) -> None:
    """Read the traces in RUN_DIRS (one per node) and say what is wrong.

    Exits 0 when nothing is wrong, 1 when a finding is an error, 2 on unreadable input.
    """
    from ddpdoctor.reports import json_report, terminal

    diag = _load(run_dirs, as_json)
    if as_json:
        click.echo(json_report.render(diag))
    else:
        existing = Path(run_dirs[0]) / RunDir.REPORT
        click.echo(terminal.render(diag, report=str(existing) if existing.is_file() else None))
    leave(EXIT_FINDINGS if diag.has_errors else 0)


EXIT_NOT_FOUND = 127  # as a shell exits for a command it cannot find
_FORMATS = ("html", "perfetto", "json")
_REPORT_SCHEMA = "ddpdoctor.report/1"


def _report_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--json", "as_json", is_flag=True, help="Say what was written, as JSON.")(func)
    func = click.option(
        "--format",
        "-f",
        "fmt",
        type=click.Choice(_FORMATS),
        default=None,
        help="html: the self-contained report; perfetto: a Chrome/Perfetto trace; json: the "
        "diagnosis (as diagnose --json). Default: from the file suffix (.html, .json), else html.",
    )(func)
    func = click.option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False),
        default=None,
        help="File to write (default: report.html, trace.json or diagnosis.json in the first RUN_DIR).",
    )(func)
    return click.argument("run_dirs", nargs=-1, required=True, type=click.Path())(func)


def _report(run_dirs: tuple[str, ...], output: str | None, fmt: str | None, as_json: bool) -> None:
    from ddpdoctor import reports

    fmt = fmt or (reports.format_of(output) if output else None) or "html"
    if output and reports.format_of(output) not in (None, fmt) and fmt != "json":
        raise click.BadParameter(f"{output} names another format than {fmt}", param_hint="--output")
    path = Path(output or Path(run_dirs[0]) / reports.FORMATS[fmt][2])
    diag = _load(run_dirs, as_json, _REPORT_SCHEMA)
    try:
        reports.write(diag, path, fmt)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}", as_json, _REPORT_SCHEMA, path=str(path))
    if as_json:
        click.echo(json.dumps({"schema": _REPORT_SCHEMA, "format": fmt, "path": str(path)}))
    else:
        click.echo(f"ddpdoctor: wrote {path}")
    leave(0)


@main.command()
@_report_options
def report(run_dirs: tuple[str, ...], output: str | None, fmt: str | None, as_json: bool) -> None:
    """Write the report of RUN_DIRS (one per node) to one file.

    \b
    Examples:
      ddpdoctor report node0/run node1/run -o report.html   # self-contained HTML, opens offline
      ddpdoctor report run -o trace.json                     # for ui.perfetto.dev
      ddpdoctor report run -f json -o diagnosis.json
    The Perfetto trace has one process per rank, a compute and a comm thread each, every rank
    on rank 0's clock. Exits 2 on unreadable input.
    """
    _report(run_dirs, output, fmt, as_json)


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--format",
    "-f",
    "fmt",
    type=click.Choice(("perfetto", "jsonl", "html", "json")),
    default="perfetto",
    show_default=True,
    help="jsonl: each rank's trace as JSON lines, to grep; the others as `report --format`.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(),
    default=None,
    help="jsonl: a directory (default: RUN_DIR/jsonl); the others: the file, as `report -o`.",
)
@click.option("--json", "as_json", is_flag=True, help="Say what was written, as JSON.")
def export(run_dirs: tuple[str, ...], fmt: str, output: str | None, as_json: bool) -> None:
    """Export RUN_DIRS: each rank's trace as JSON lines (``--format jsonl``: one
    ``trace-rankN.jsonl`` per rank, ``[kind, ts_us, dur_us, step, *fields]``, which diagnose and
    report read too), or a Perfetto trace (the default) or the report, as `report` writes them.

    \b
    Example:
      ddpdoctor export run -f jsonl -o run-jsonl && grep barrier run-jsonl/trace-rank3.jsonl
    """
    if fmt != "jsonl":
        _report(run_dirs, output, fmt, as_json)
        return
    from ddpdoctor.supervisor.ends import settle_unsupervised
    from ddpdoctor.trace.export import export_jsonl

    out = Path(output or Path(run_dirs[0]) / "jsonl")
    written: list[str] = []
    for run_dir in map(Path, run_dirs):
        if run_dir.is_dir():
            settle_unsupervised(run_dir)  # dead ranks' traces completed from their rings first
            written += [str(p) for p in export_jsonl(run_dir, out)]
    if not written:
        click.echo(f"ddpdoctor: no rank traces in {', '.join(run_dirs)}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if as_json:
        click.echo(json.dumps({"schema": "ddpdoctor.export/1", "format": "jsonl", "paths": written}))
    else:
        click.echo(f"ddpdoctor: wrote {len(written)} trace(s) as JSON lines in {out}")


@main.command()
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory, new or without an earlier run (default: ./ddpdoctor-runs/<timestamp>).",
)
@click.option("--nproc", default=2, show_default=True, help="Ranks to start.")
@click.option("--epochs", default=2, show_default=True, help="Epochs to train.")
@_nvml_options
def demo(out: str | None, nproc: int, epochs: int, nvml_interval: float, no_nvml: bool) -> None:
    """Train a small bundled DDP model under the doctor (gloo on CPU, nccl on GPUs)."""
    from ddpdoctor.demo import TRAIN_SCRIPT

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(TRAIN_SCRIPT),
        f"--epochs={epochs}",
    ]
    sys.exit(_run_and_summarise(command, out, None, _nvml_interval(nvml_interval, no_nvml)))


from ddpdoctor.commands import COMMANDS  # noqa: E402

for _command in COMMANDS:
    main.add_command(_command)


if __name__ == "__main__":
    main()
