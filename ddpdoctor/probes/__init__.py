"""Probes: what runs inside each rank.

``install()`` patches torch as soon as it is imported (through a one-shot import hook when it
is not imported yet). The patches stay inert until the process calls ``init_process_group``,
which makes it a rank (``collector.activate``); only then is anything recorded.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_installed = False


def install() -> None:
    """Arm the probes in this process. Idempotent; never raises."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from ddpdoctor.probes import early

        early.install()
    except Exception as exc:
        sys.stderr.write(f"ddpdoctor: rank start record not written: {exc!r}\n")
    try:
        from ddpdoctor.probes import startup

        startup.install()
    except Exception as exc:
        sys.stderr.write(f"ddpdoctor: startup-failure hook not installed: {exc!r}\n")
    if "torch" in sys.modules:
        _patch_torch()
    else:
        sys.meta_path.insert(0, _TorchImportHook())


def _patch_torch() -> None:
    import torch

    if not torch.distributed.is_available():
        return
    from ddpdoctor.probes import checkpoint, collectives, data, ddp, optimizer, optsettings

    for module in (collectives, ddp, data, optimizer, checkpoint, optsettings):
        try:
            module.install()
        except Exception as exc:  # a torch whose internals moved: lose the probe, not the job
            sys.stderr.write(f"ddpdoctor: probe {module.__name__} not installed: {exc!r}\n")


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Runs `_patch_torch` once ``import torch`` has finished, without importing torch itself."""

    _busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch" or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            try:
                _patch_torch()
            except Exception as exc:
                sys.stderr.write(f"ddpdoctor: probes not installed: {exc!r}\n")

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec
