"""The commands beside the run -> diagnose -> report path: bench, compare, top, attach, native.

Each is a plain click command; ``cli.main`` adds them to the group.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import click

from ddpdoctor.cli_common import EXIT_BAD_INPUT, EXIT_FINDINGS, fail, fresh_out, is_run_dir, load_run_dirs


@click.command()
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
    fresh_out(None if out is None else str(Path(out) / "ddp"))  # DDP's run, under the doctor
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


@click.command()
@click.argument("run_dir_a", type=click.Path())
@click.argument("run_dir_b", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.compare/1).")
def compare(run_dir_a: str, run_dir_b: str, as_json: bool) -> None:
    """Put two runs side by side: throughput, step times, phases and findings (B against A).

    \b
    Example:  ddpdoctor compare ddpdoctor-runs/before ddpdoctor-runs/after
    Findings present in one run but not the other are listed. Exits 2 on unreadable input.
    """
    from ddpdoctor.analysis.slow.compare import compare as compare_runs
    from ddpdoctor.reports import compare as compare_report

    schema = "ddpdoctor.compare/1"
    result = compare_runs(
        load_run_dirs((run_dir_a,), as_json, schema), load_run_dirs((run_dir_b,), as_json, schema)
    )
    click.echo(json.dumps(result, indent=2) if as_json else compare_report.render(result))


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
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
    for d in dirs:  # a typo or another directory: say so, never watch nothing forever
        if not d.is_dir():
            fail(f"{d}: not a directory", as_json, "ddpdoctor.top/1", run_dirs=list(run_dirs))
        if not is_run_dir(d):
            fail(f"{d}: not a ddpdoctor run directory", as_json, "ddpdoctor.top/1", run_dirs=list(run_dirs))
    with contextlib.suppress(KeyboardInterrupt):
        live_top.run(dirs, once=once, as_json=as_json, interval=interval, echo=click.echo)


@click.command()
@click.argument("pid")
@click.option(
    "--watch",
    "watch_s",
    default=3.0,
    show_default=True,
    metavar="SECONDS",
    help="Look at the stacks several times over this long to tell stuck (no stack changes, and "
    "no main thread that waited at every look ran between them) from slow; 0 looks once.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory for the stacks and report, new or without an earlier run "
    "(default: ./ddpdoctor-runs/<timestamp>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.attach/1).")
def attach(pid: str, watch_s: float, out: str | None, as_json: bool) -> None:
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
    fresh_out(out)
    schema = "ddpdoctor.attach/1"
    if not pid.isdigit():
        hint = " (a run directory is read by `ddpdoctor diagnose`)" if Path(pid).exists() else ""
        fail(f"{pid!r} is not a process id{hint}", as_json, schema)
    try:
        result = attach_job(int(pid), watch_s, out)
    except AttachError as exc:
        fail(str(exc), as_json, schema, pid=int(pid))
    except OSError as exc:
        fail(f"cannot write the run directory: {exc}", as_json, schema, pid=int(pid))
    click.echo(json.dumps(result.report, indent=2, default=str) if as_json else result.text)
    sys.exit(EXIT_FINDINGS if result.state == "stuck" else 0)


@click.command()
@click.option("--build", "do_build", is_flag=True, help="Compile it for this torch if it is not built.")
@click.option("--verbose", is_flag=True, help="Show the compiler's output while building.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ddpdoctor.native/1).")
def native(do_build: bool, verbose: bool, as_json: bool) -> None:
    """Say whether the C++ bucket timer is built for this torch, or build it (--build).

    \b
    DDP reduces gradient buckets in C++; timing each one from Python costs 50-240 us a bucket.
    Built once (about a minute), the timer does it in C++ for every later job on CPU; until
    then buckets are timed in Python. Exits 1 if it is not built (or the build failed).
    """
    import torch

    from ddpdoctor.probes import native as nat

    result: dict = {"schema": "ddpdoctor.native/1", "torch": torch.__version__, "path": str(nat.built_path())}
    if do_build and not nat.built_path().is_file():
        try:
            result["build_s"] = round(nat.build(verbose)[1], 1)
        except Exception as exc:  # no compiler, no headers: the Python timer stays
            result["error"] = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
    result["built"] = nat.built_path().is_file()
    if as_json:
        click.echo(json.dumps(result))
    else:
        state = "built" if result["built"] else "not built (buckets are timed in Python)"
        click.echo(f"C++ bucket timer for torch {result['torch']}: {state}\n  {result['path']}")
        if "build_s" in result:
            click.echo(f"  compiled in {result['build_s']} s")
        if "error" in result:
            click.echo(f"  build failed: {result['error']}", err=True)
    sys.exit(0 if result["built"] else EXIT_FINDINGS)


COMMANDS = (bench, compare, top, attach, native)
