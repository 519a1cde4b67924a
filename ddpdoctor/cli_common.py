"""What every command shares: exit codes, and reading run directories or saying why not."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from ddpdoctor.rundir import RunDir
from ddpdoctor.supervisor import launch

EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_HANG_KILLED = launch.EXIT_HANG_KILLED  # `run --on-hang kill` stopped a hung job: declared there


def fail(message: str, as_json: bool, schema: str, **fields: Any) -> NoReturn:
    """Exit 2 saying why: on stderr, and as the one JSON object (with an ``error`` field) on
    stdout when the caller scripts against JSON, so a script never reads an empty stdout."""
    click.echo(f"ddpdoctor: {message}", err=True)
    if as_json:
        click.echo(json.dumps({"schema": schema, "error": message, **fields}, indent=2))
    sys.exit(EXIT_BAD_INPUT)


def is_run_dir(path: Path) -> bool:
    """A directory ``ddpdoctor run`` (or a recorded rank) wrote: its run.json, a status or a trace."""
    run = RunDir(path)
    return (path / RunDir.RUN_META).is_file() or any(True for _ in run.statuses()) or bool(run.all_traces())


def load_run_dirs(run_dirs: tuple[str, ...], as_json: bool = False, schema: str = "") -> Any:
    """Read and diagnose RUN_DIRS, or exit 2 saying why they cannot be read (as a JSON error
    object on stdout too when the caller scripts against JSON: ``schema`` names the command's
    own, the diagnosis' by default)."""
    from ddpdoctor.analysis import diagnose as diagnose_run
    from ddpdoctor.analysis.diagnosis import fewer_collections
    from ddpdoctor.supervisor.ends import settle_unsupervised
    from ddpdoctor.trace.reader import TraceError, load_run

    for run_dir in run_dirs:  # recorded without `ddpdoctor run`: complete dead ranks' traces
        if os.path.isdir(run_dir):
            settle_unsupervised(Path(run_dir))
    try:
        with fewer_collections():  # the reading too: its ranks' columns live as long as the run
            return diagnose_run(load_run(run_dirs))
    except TraceError as exc:
        if as_json and not schema:
            from ddpdoctor.reports import json_report

            click.echo(f"ddpdoctor: {exc}", err=True)
            click.echo(json.dumps(json_report.error(str(exc), run_dirs), indent=2))
            sys.exit(EXIT_BAD_INPUT)
        fail(str(exc), as_json, schema, run_dirs=list(run_dirs))


def fresh_out(out: str | None) -> None:
    """Refuse an ``--out`` that holds an earlier run (exit 2), before anything is started."""
    if out is not None and RunDir(out).holds_run():
        raise click.BadParameter(
            f"{out} holds an earlier run: give a new directory, or remove that one", param_hint="--out"
        )


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once the output is written, without the interpreter's teardown: it
    would free every object of the run one at a time (0.4 s at 1,024 ranks x 10,000 steps),
    and a command that read a run holds nothing else to close (its files are written and
    closed, its reader's worker processes joined)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a reader that went away (``| head``): exit as Python would
        sys.exit(code)
    os._exit(code)
