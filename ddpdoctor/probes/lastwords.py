"""How a rank ended, written from inside it, by means that work when it cannot run Python.

* ``fatal-rank{R}.txt``: ``faulthandler.enable`` (a C-level handler) writes "Fatal Python
  error: Aborted/Segmentation fault/..." and every thread's Python stack when the rank dies by
  SIGABRT (a C++ ``terminate``, gloo's enforce), SIGSEGV, SIGBUS, SIGFPE or SIGILL, then lets
  the signal kill the process as before. Left alone when the job enabled faulthandler itself.
* ``sigterm-rank{R}.txt``: ``faulthandler.register(SIGTERM, chain=True)`` writes the stacks and
  re-raises SIGTERM with its previous (default) action: the rank dies exactly as it would.
  Only while SIGTERM has its default action; a Python handler the job installs replaces ours.
* ``exit-rank{R}.json``: the status the rank exits with through ``exit()`` (its script's end,
  ``sys.exit(3)``, ``raise SystemExit(3)``), which no Python hook is told: a C handler
  (glibc's ``on_exit``, probes/_fast.c) writes it after Python's finalization. Without it
  ``sys.exit(3)`` would read as a clean exit, and the rank torchrun then stopped as the root.
  ``sys.exit`` and the ``exit()``/``quit()`` builtins are wrapped to add the caller's stack
  (``raise SystemExit(3)`` calls nothing: its status comes without a line).
  ``os._exit(code)`` skips that handler, atexit and every flush; its wrapper writes the code
  first.
* ``stderr-rank{R}.txt``: the last 64 KiB the rank wrote to its stderr (a C++ abort message,
  an NCCL line, a traceback), kept by a small tee process (``stderr_tee.py``) that outlives
  the rank. The tee writes every byte on to the original stderr; when that is a terminal the
  rank writes into a raw pseudo-terminal, so the job still sees a tty and no byte changes.
  ``stderr-rank{R}.open`` exists while the tee may still write.

The supervisor reads these after the job (supervisor/ends.py). Nothing here raises.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from ddpdoctor.probes import collector as _c
from ddpdoctor.rundir import RunDir

TEE_ENV = "DDPDOCTOR_TEE"  # "0": leave the rank's stderr as it is
_TEE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stderr_tee.py")
_files: list[Any] = []  # kept open for faulthandler's C handlers
_done: set[str] = set()  # steps already taken in this process (early, before init)
_ours: set[str] = set()  # the faulthandler registrations made here: undone in a forked child


def filename(kind: str, rank: int) -> str:
    """The name of one of a rank's end files (the layout lives in ``RunDir.last_words``)."""
    return RunDir("").last_words(kind, rank).name


def install(c: _c.Collector | Any) -> None:
    """Take every step not yet taken. ``probes/early.py`` calls this at a rank process's start
    (with the rank from its environment), so a rank that never reaches init_process_group
    leaves its stderr and its stack too; the collector's call at init then finds them done."""
    steps = (("fatal", _fatal), ("sigterm", _sigterm), ("exit", _exit_code), ("os_exit", _os_exit))
    for name, step in (*steps, ("tee", _tee)):
        if name in _done:
            continue
        try:
            step(c)
            _done.add(name)
        except Exception as exc:
            c.fail(f"lastwords.{name}", exc)


def _open(c: _c.Collector, kind: str) -> Any:
    fh = open(os.path.join(c.run_dir, filename(kind, c.rank)), "w", encoding="utf-8")  # noqa: SIM115
    _files.append(fh)
    return fh


def _fatal(c: _c.Collector) -> None:
    if faulthandler.is_enabled():
        return  # the job's own (PYTHONFAULTHANDLER, -X faulthandler): it writes to stderr
    faulthandler.enable(file=_open(c, "fatal"), all_threads=True)
    _ours.add("fatal")


def _sigterm(c: _c.Collector) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the job handles SIGTERM: never stand in its way
    faulthandler.register(signal.SIGTERM, file=_open(c, "sigterm"), all_threads=True, chain=True)
    _ours.add("sigterm")


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, the job's own multiprocessing fork) is not the rank:
    a SIGTERM or a crash there must not write its stacks into the rank's files, where they would
    read as the rank's death. The child's signals go back to what they were without us."""
    if "sigterm" in _ours:
        faulthandler.unregister(signal.SIGTERM)
    if "fatal" in _ours:
        faulthandler.disable()
    _ours.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _exit_code(c: _c.Collector) -> None:
    try:
        from ddpdoctor.probes import _fast
    except ImportError:
        return  # built without its C module: an exit's status stays unknown
    path = os.path.join(c.run_dir, filename("exit", c.rank))
    if not _fast.exit_code(path):  # now, for an exit() from native code mid-run
        return
    pid = os.getpid()

    def again() -> None:  # to run before libtorch's destructors; not in a forked child
        if os.getpid() == pid:
            _fast.exit_code(path)

    atexit.register(again)
    real = sys.exit
    if getattr(real, "__ddpdoctor__", False):
        return

    def note(code: Any, frame: Any) -> None:
        """The call's caller and its status as the process will exit with it (None: 0, an int
        modulo 256, anything else is printed and exits 1), for the line a finding points at."""
        if os.getpid() != pid:
            return
        with contextlib.suppress(Exception):
            status = 0 if code is None else code & 0xFF if isinstance(code, int) else 1
            frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame, 16)]
            _fast.exit_note(json.dumps({"code": status, "frames": frames}))

    def exit(status: Any = None, /) -> None:  # sys.exit's own name and signature
        note(status, sys._getframe(1))
        real(status)

    exit.__ddpdoctor__ = True  # type: ignore[attr-defined]
    exit.__wrapped__ = real  # type: ignore[attr-defined]
    sys.exit = exit
    import builtins

    quitter = type(getattr(builtins, "exit", None))
    if quitter.__name__ != "Quitter":
        return  # python -S: no exit()/quit() builtins

    class Quitter(quitter):  # type: ignore[misc, valid-type]  # site's exit()/quit(), same repr
        def __call__(self, code: Any = None) -> None:
            note(code, sys._getframe(1))
            super().__call__(code)

    for name in ("exit", "quit"):
        setattr(builtins, name, Quitter(name, getattr(builtins, name).eof))


def _os_exit(c: _c.Collector) -> None:
    real = os._exit
    if getattr(real, "__ddpdoctor__", False):
        return
    pid, path = os.getpid(), os.path.join(c.run_dir, filename("exit", c.rank))

    def _exit(code: int) -> None:
        if os.getpid() == pid:
            with contextlib.suppress(Exception), open(path, "w", encoding="utf-8") as fh:
                # who called it (outermost first): the line a finding can point at
                stack = traceback.extract_stack(sys._getframe(1), 16)
                frames = [(f.filename, f.lineno, f.name) for f in stack]
                record = {"how": "os._exit", "code": code, "wall_ns": time.time_ns(), "frames": frames}
                fh.write(json.dumps(record))
        real(code)

    _exit.__ddpdoctor__ = True  # type: ignore[attr-defined]
    _exit.__wrapped__ = real  # type: ignore[attr-defined]
    os._exit = _exit


def _tee(c: _c.Collector) -> None:
    if os.environ.get(TEE_ENV) == "0" or not sys.platform.startswith("linux"):
        return
    try:
        os.fstat(2)
    except OSError:
        return  # no stderr at all
    out = os.path.join(c.run_dir, filename("stderr", c.rank))
    marker = os.path.join(c.run_dir, filename("stderr-open", c.rank))
    if os.isatty(2):
        read_end, write_end = _raw_pty()
    else:
        read_end, write_end = os.pipe()
    try:
        with open(marker, "w", encoding="utf-8"):
            pass
        subprocess.Popen(
            [sys.executable, "-S", "-E", "-s", _TEE, out, marker],
            stdin=read_end,
            stdout=2,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C and torchrun's signals are for the rank, not the tee
        )
    except BaseException:
        os.close(read_end)
        os.close(write_end)
        with contextlib.suppress(OSError):
            os.unlink(marker)
        raise
    os.close(read_end)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)


def _raw_pty() -> tuple[int, int]:
    """(master, slave) of a pty that passes bytes unchanged, with stderr's window size."""
    import fcntl
    import pty
    import termios
    import tty

    master, slave = pty.openpty()
    tty.setraw(slave)
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(2, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    return master, slave
