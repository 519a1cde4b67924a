"""ddpdoctor: diagnostics and profiling for PyTorch DistributedDataParallel jobs.

Most people use the CLI (``ddpdoctor run -- torchrun ...``), which needs no code change.
For those who prefer code, one line at the top of the training script does the same::

    import ddpdoctor; ddpdoctor.instrument()

This module stays tiny: every rank of every job imports it.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def instrument(out: str | os.PathLike[str] | None = None) -> None:
    """Record this process's DDP sync points, as `ddpdoctor run` would.

    Call it before or after ``init_process_group``. ``out`` is the run directory (the same on
    every rank); by default rank 0 creates ``./ddpdoctor-runs/<timestamp>`` and shares it.
    """
    from ddpdoctor import _env

    if out is not None:
        os.environ[_env.RUN_DIR] = os.fspath(out)
    import torch.distributed as dist

    from ddpdoctor import probes
    from ddpdoctor.probes import collector

    probes.install()
    if dist.is_available() and dist.is_initialized():
        collector.activate(dist)
