"""The per-rank stderr tee (run as a script with ``python -S``; the standard library only).

stdin: the read end of the rank's new stderr (a pipe, or a pty master); stdout: the rank's
original stderr. Every byte read is written on unchanged; the last ``TAIL`` bytes are kept in
``argv[1]`` (rewritten at most once a second, and at the end), and ``argv[2]`` is removed
when the rank and every process sharing its stderr have closed it. Signals sent to a process
group do not reach it (own session, and ignored), so the rank never writes into a dead pipe.
"""

import contextlib
import os
import signal
import sys
import time

TAIL = 64 * 1024


def _save(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        pass


def main() -> None:
    out_path, marker = sys.argv[1], sys.argv[2]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    tail = bytearray()
    passing = True
    saved_at, dirty = 0.0, False
    while True:
        try:
            chunk = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:  # EIO: the pty's last writer closed it
            break
        if not chunk:
            break
        if passing:
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(1, view) :]
            except OSError:
                passing = False  # the terminal went away: keep draining so the rank never blocks
        tail += chunk
        if len(tail) > 2 * TAIL:
            del tail[:-TAIL]
        dirty = True
        now = time.monotonic()
        if now - saved_at >= 1.0:
            _save(out_path, bytes(tail[-TAIL:]))
            saved_at, dirty = now, False
    if dirty or not os.path.exists(out_path):
        _save(out_path, bytes(tail[-TAIL:]))
    with contextlib.suppress(OSError):
        os.unlink(marker)


if __name__ == "__main__":
    main()
