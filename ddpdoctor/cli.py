"""The command line: wiring only; each command calls into supervisor, analysis and reports.

Exit codes: `run` and `demo` exit with the job's own code (128+N when a signal killed it),
except that `run --on-hang kill` exits 124 (as timeout(1) does) when it stopped a hung job;
`diagnose` exits 0 when it finds no error, 1 when a finding has severity "error", and 2 when
its input cannot be read (or the command line is wrong).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

import ddpdoctor
from ddpdoctor.rundir import RunDir

EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_HANG_KILLED = 124  # `run --on-hang kill` stopped a hung job


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
    help="Run directory (default: ./ddpdoctor-runs/<timestamp>).",
)
@click.option(
    "--hang-timeout",
    default="auto",
    show_default=True,
    metavar="SECONDS|auto",
    help="Report a hang when a rank waits in a sync point this long, or no rank progresses. "
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
        _env.number(_env.FLUSH_INTERVAL, 0.25)
        _env.number(_env.BUFFER_EVENTS, 100000, integer=True)
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


def _load(run_dirs: tuple[str, ...], as_json: bool = False) -> Any:
    """Read and diagnose RUN_DIRS, or exit 2 saying why they cannot be read (as a JSON error
    object on stdout too when the caller scripts against JSON)."""
    from ddpdoctor.analysis import diagnose as diagnose_run
    from ddpdoctor.trace.reader import TraceError, load_run

    try:
        return diagnose_run(load_run(run_dirs))
    except TraceError as exc:
        click.echo(f"ddpdoctor: {exc}", err=True)
        if as_json:
            from ddpdoctor.reports import json_report

            click.echo(json.dumps(json_report.error(str(exc), run_dirs), indent=2))
        sys.exit(EXIT_BAD_INPUT)


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
    sys.exit(EXIT_FINDINGS if diag.has_errors else 0)


_FORMATS = ("html", "perfetto", "json")


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
    diag = _load(run_dirs)
    try:
        reports.write(diag, path, fmt)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from exc
    if as_json:
        click.echo(json.dumps({"schema": "ddpdoctor.report/1", "format": fmt, "path": str(path)}))
    else:
        click.echo(f"ddpdoctor: wrote {path}")


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


@main.command(hidden=True)
@_report_options
def export(run_dirs: tuple[str, ...], output: str | None, fmt: str | None, as_json: bool) -> None:
    """Alias of `report --format perfetto` (kept for scripts that call it)."""
    _report(run_dirs, output, fmt or "perfetto", as_json)


@main.command()
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: ./ddpdoctor-runs/<timestamp>).",
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


@main.command()
@click.option(
    "--model",
    default="mlp",
    show_default=True,
    help="mlp, convnet, transformer, or an import path module:callable returning an nn.Module.",
)
@click.option(
    "--input-shape",
    default=None,
    metavar="D,D,...",
    help="One sample's shape, without the batch (built-ins: mlp 256, convnet 3,32,32, transformer 32,64).",
)
@click.option("--batch-size", default=64, show_default=True, help="Global batch, the same in every mode.")
@click.option("--steps", default=20, show_default=True, help="Measured steps per mode.")
@click.option("--warmup", default=3, show_default=True, help="Warm-up steps per mode, not measured.")
@click.option("--nproc", default=2, show_default=True, help="DDP processes (torchrun --nproc_per_node).")
@click.option(
    "--loss",
    default="cross_entropy",
    show_default=True,
    help="cross_entropy (class targets), mse, l1, smooth_l1 or bce_with_logits (targets like the output).",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: ./ddpdoctor-runs/<timestamp>); DDP's own run is in its ddp/.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.bench/1).")
def bench(
    model: str,
    input_shape: str | None,
    batch_size: int,
    steps: int,
    warmup: int,
    nproc: int,
    loss: str,
    out: str | None,
    as_json: bool,
) -> None:
    """Measure one model as a single process, DataParallel and DDP, on the same global batch.

    \b
    Example:  ddpdoctor bench --model mypkg.models:build_model --input-shape 3,224,224 \\
                  --batch-size 64 --steps 50 --nproc 4
    Writes bench.json and bench.html in the run directory; exits 2 on a bad model or shape,
    1 when a mode failed.
    """
    from ddpdoctor.bench import models, report
    from ddpdoctor.bench.runner import BenchOptions, run_bench
    from ddpdoctor.rundir import new_run_dir

    try:
        models.check_spec(model)
        shape = models.input_shape(model, models.parse_shape(input_shape))
        if loss not in models.LOSSES:
            raise models.ModelSpecError(f"--loss {loss!r}: expected one of {', '.join(models.LOSSES)}")
    except models.ModelSpecError as exc:
        click.echo(f"ddpdoctor: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    for name, value in (("--batch-size", batch_size), ("--steps", steps), ("--nproc", nproc)):
        if value < 1:
            raise click.BadParameter("must be at least 1", param_hint=name)
    if warmup < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--warmup")
    if batch_size % nproc:
        raise click.BadParameter(
            f"{batch_size} does not split evenly over {nproc} DDP processes", param_hint="--batch-size"
        )
    try:
        run_dir = new_run_dir(out)
    except OSError as exc:
        raise click.ClickException(f"cannot create the run directory: {exc}") from exc
    opts = BenchOptions(model, shape, batch_size, steps, warmup, nproc, loss)
    result = run_bench(opts, run_dir)
    try:
        report.write(result, run_dir)
    except Exception as exc:  # the numbers still get printed
        result["html"] = f"not written ({exc!r})"
    click.echo(report.to_json(result) if as_json else report.terminal(result))
    sys.exit(0 if all(m.get("ok") for m in result["modes"].values()) else EXIT_FINDINGS)


@main.command()
@click.argument("run_dir_a", type=click.Path())
@click.argument("run_dir_b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.compare/1).")
def compare(run_dir_a: str, run_dir_b: str, as_json: bool) -> None:
    """Put two runs side by side: throughput, step times, phases and findings (B against A).

    \b
    Example:  ddpdoctor compare ddpdoctor-runs/before ddpdoctor-runs/after
    Findings present in one run but not the other are listed. Exits 2 on unreadable input.
    """
    from ddpdoctor.analysis.compare import compare as compare_runs
    from ddpdoctor.reports import compare as compare_report

    result = compare_runs(_load((run_dir_a,)), _load((run_dir_b,)))
    click.echo(json.dumps(result, indent=2) if as_json else compare_report.render(result))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.top/1) per refresh.")
@click.option("--interval", default=1.0, show_default=True, metavar="SECONDS", help="Refresh period.")
def top(run_dirs: tuple[str, ...], once: bool, as_json: bool, interval: float) -> None:
    """Watch a job under `ddpdoctor run` live, one row per rank (RUN_DIRS: one per node).

    \b
    Example:  ddpdoctor top ddpdoctor-runs/<timestamp>            # refreshes every second
              ddpdoctor top --once node0/run node1/run          # one frame, e.g. in a log
    Per rank: step, steps/s, the sync point it is in and for how long, its last collective
    (op and sequence number), how late it reaches the gradient sync (mean over the last
    steps), GPU use when NVML has it. Then the job (throughput, slowest rank, time since any
    rank progressed) and what is already clear (a straggler, a hang, a rank that raised).
    Reads only the ranks' small status files; exits when the run has finished, or on Ctrl-C.
    """
    from ddpdoctor.live import top as live_top

    if not interval > 0:
        raise click.BadParameter("must be positive", param_hint="--interval")
    dirs = [Path(d) for d in run_dirs]
    with contextlib.suppress(KeyboardInterrupt):
        live_top.run(dirs, once=once, as_json=as_json, interval=interval, echo=click.echo)


@main.command()
@click.argument("pid", type=int)
@click.option(
    "--watch",
    "watch_s",
    default=3.0,
    show_default=True,
    metavar="SECONDS",
    help="Look at the stacks several times over this long to tell stuck (no stack changes) "
    "from slow; 0 looks once.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory for the stacks and report (default: ./ddpdoctor-runs/<timestamp>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.attach/1).")
def attach(pid: int, watch_s: float, out: str | None, as_json: bool) -> None:
    """Diagnose a running job that was started without ddpdoctor, from its ranks' stacks.

    \b
    Example:  ddpdoctor attach 12345        # torchrun's pid, an mp.spawn parent's, or a rank's
    Finds every rank on this node (RANK/LOCAL_RANK/WORLD_SIZE in /proc/<pid>/environ), dumps
    each one's threads with py-spy, groups ranks that stand at the same place and says who
    waits for whom, where in your code, the likely cause and the fix - the verdict
    `ddpdoctor run` gives. Writes a run directory that `diagnose` and `report` read.
    Needs ptrace rights (same user; CAP_SYS_PTRACE or sudo under kernel.yama.ptrace_scope>=1).
    Exits 0 when the job progresses, 1 when it is stuck, 2 when it cannot look.
    """
    from ddpdoctor.live.attach import AttachError
    from ddpdoctor.live.attach_run import attach as attach_job

    if watch_s < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--watch")
    try:
        result = attach_job(pid, watch_s, out)
    except AttachError as exc:
        click.echo(f"ddpdoctor: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as exc:
        raise click.ClickException(f"cannot write the run directory: {exc}") from exc
    click.echo(json.dumps(result.report, indent=2, default=str) if as_json else result.text)
    sys.exit(EXIT_FINDINGS if result.state == "stuck" else 0)


if __name__ == "__main__":
    main()
