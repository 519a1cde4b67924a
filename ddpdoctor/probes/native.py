"""The bucket timer in C++ (``probes/_hook.cpp``): where it is built for the torch in use,
DDP's gradient buckets are timed with no Python per bucket; elsewhere the Python hook
(``commhook.py``) times them, as before.

It is compiled against torch's own headers and libraries, so a build belongs to one torch and
one interpreter: ``ddpdoctor native --build`` compiles it once (about a minute on two cores)
into the cache (``DDPDOCTOR_CACHE``), under a name that holds a hash of the source, torch's
version and the interpreter's. A rank only loads a build that exists; it never compiles, so a
job never waits for a compiler. ``DDPDOCTOR_PURE_PYTHON=1`` keeps it out, as it does the C
probes.

Where it is loaded it also hands the C probes, as capsules (``capsules``), readers of a group's
collective sequence number, without torch's binding, which releases the GIL and takes it back,
of a plain tensor's dtype and bytes, and of whether a parameter has a gradient, without the
generic attribute lookups; and the step its notes carry, set with no pybind call. It is loaded
when the process group is made, so that every collective uses them.

It times DDP's own reduction of CPU gradients. Models on a GPU keep the Python hook, whose
bucket spans are also recorded on the device's clock (``cuda_timing.py``), and so do models with
complex parameters (their buckets are reduced as real views).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddpdoctor import _env
from ddpdoctor.probes import guard

SOURCE = Path(__file__).with_name("_hook.cpp")
_UNSET: Any = object()
_module: Any = _UNSET


def cache_dir() -> Path:
    root = os.environ.get(_env.CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddpdoctor"
    )
    return Path(root)


def build_name() -> str:
    """The build's module name: one per source, torch version and interpreter."""
    import torch

    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return f"ddpdoctor_hook_{key.hexdigest()[:16]}"


def built_path() -> Path:
    name = build_name()
    return cache_dir() / name / f"{name}.so"


def build(verbose: bool = False) -> tuple[Path, float]:
    """Compile the timer for this torch (a no-op where it is built): (its path, seconds)."""
    from torch.utils import cpp_extension

    name, t0 = build_name(), time.monotonic()
    folder = cache_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name, [str(SOURCE)], build_directory=str(folder), extra_cflags=["-O2"], verbose=verbose
    )
    return folder / f"{name}.so", time.monotonic() - t0


def module() -> Any:
    """The built timer, or None (not built for this torch, or switched off); once per process."""
    global _module
    if _module is _UNSET:
        _module = _load()
    return _module


def _load() -> Any:
    if os.environ.get(_env.PURE_PYTHON) == "1":
        return None
    try:
        path = built_path()
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            return None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _share_readers(mod)
        return mod
    except Exception as exc:
        guard.passthrough(exc)
        return None


def _share_readers(mod: Any) -> None:
    """The C probes read a group's sequence number, a tensor's dtype and bytes and whether a
    parameter has a gradient through the timer's readers, built against torch's headers, rather
    than torch's binding (which releases the GIL and takes it back) and the generic attribute
    lookups, and set the step its notes carry through its writer."""
    from ddpdoctor.probes import fastpath

    fast = fastpath.module()
    if fast is not None:
        for capsule in mod.capsules():
            fast.set_native(capsule)


def eligible(ddp: Any) -> bool:
    """Can the C++ timer time ``ddp``'s buckets? It is built, the model's gradients are real
    and on the CPU, and records are packed in C: its notes are packed from the writer thread
    too, and a C pack is one call under the GIL, never interleaved with the training thread's."""
    from ddpdoctor.probes import fastpath

    if module() is None or fastpath.module() is None:
        return False
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return bool(params) and all(p.device.type == "cpu" and not p.is_complex() for p in params)


def register(ddp: Any, notes: str) -> Any:
    """Put the C++ timer in ``ddp``'s comm hook slot, its notes in the file ``notes`` (""
    where the trace has no crash-safe ring: memory alone; the process's first timer opens it,
    later ones share it): its handle (``drain``, ``set_python_hook``), or None where the
    Python hook must time it."""
    if not eligible(ddp):
        return None
    return module().register_timer(ddp.reducer, ddp.process_group, notes)
