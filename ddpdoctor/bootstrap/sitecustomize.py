"""ddpdoctor's bootstrap, imported by every Python process of a job under `ddpdoctor run`.

`ddpdoctor run` puts this directory first on PYTHONPATH, so torchrun, its workers, mp.spawn
children and DataLoader workers all import it at startup. It
  1. chains to the user's own ``sitecustomize`` (only one module of that name can exist),
  2. arms the probes, which wait for ``import torch`` and stay inert until the process calls
     ``init_process_group``; so torchrun itself and DataLoader workers record nothing.
It never imports torch, and any failure here is reported once and otherwise ignored.
"""

import os
import sys


def _chain_user_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved_path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the user's, if any)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved_path


def _arm_probes() -> None:
    if not os.environ.get("DDPDOCTOR_RUN_DIR") or os.environ.get("DDPDOCTOR_DISABLE") == "1":
        return
    try:
        import ddpdoctor.probes
    except ImportError:  # the job runs another interpreter: reach our package by its path
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        sys.path.append(package_root)
        import ddpdoctor.probes
    ddpdoctor.probes.install()


try:
    _chain_user_sitecustomize()
except Exception as exc:  # the user's sitecustomize failed: say so, as Python would
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{exc!r}\n")
try:
    _arm_probes()
except Exception as exc:
    sys.stderr.write(f"ddpdoctor: bootstrap failed, this process is not recorded: {exc!r}\n")
