"""What every command shares: exit codes, and reading run directories or saying why not."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_HANG_KILLED = 124  # `run --on-hang kill` stopped a hung job


def load_run_dirs(run_dirs: tuple[str, ...], as_json: bool = False) -> Any:
    """Read and diagnose RUN_DIRS, or exit 2 saying why they cannot be read (as a JSON error
    object on stdout too when the caller scripts against JSON)."""
    from ddpdoctor.analysis import diagnose as diagnose_run
    from ddpdoctor.supervisor.ends import settle_unsupervised
    from ddpdoctor.trace.reader import TraceError, load_run

    for run_dir in run_dirs:  # recorded without `ddpdoctor run`: complete dead ranks' traces
        if os.path.isdir(run_dir):
            settle_unsupervised(Path(run_dir))
    try:
        return diagnose_run(load_run(run_dirs))
    except TraceError as exc:
        click.echo(f"ddpdoctor: {exc}", err=True)
        if as_json:
            from ddpdoctor.reports import json_report

            click.echo(json.dumps(json_report.error(str(exc), run_dirs), indent=2))
        sys.exit(EXIT_BAD_INPUT)
