#!/usr/bin/env python3
"""Set-up in two commands, on a fresh clone with only Python 3.11+ and pip:

    python3 dev.py demo    # .venv in the checkout (torch pinned, ddpdoctor), then the demo
    python3 dev.py test    # the test extras and Chromium where the system allows, ruff, then the suite

Each install step is skipped while its stamp in .venv matches pyproject.toml, so a second run
goes straight to the demo or the tests. Arguments after ``test`` go to pytest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
TORCH = "torch==2.13.0"  # first and pinned: an unpinned torch pulls gigabytes of CUDA packages


def run(*cmd: str | Path) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def installed(stamp: str, *pip_args: str) -> None:
    """pip install ``pip_args`` into .venv unless the stamp says this pyproject (and the C source
    it builds, in place for an editable install) is installed."""
    sources = [ROOT / "pyproject.toml", *sorted(ROOT.glob("ddpdoctor/**/*.[ch]"))]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(pip_args).encode()).hexdigest()
    path = VENV / f".{stamp}"
    if path.exists() and path.read_text() == key:
        return
    if not PY.exists():
        venv.create(VENV, with_pip=True)
        run(PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(PY, "-m", "pip", "install", "--quiet", TORCH, "numpy")
    run(PY, "-m", "pip", "install", "--quiet", TORCH, *pip_args)
    path.write_text(key)


def chromium() -> None:
    """Chromium for the browser test where apt can install it (as root); else it skips."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        ok = subprocess.run(["apt-get", "update", "-qq"], env=env).returncode == 0
        if ok and subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env).returncode == 0:
            return
    print("dev.py: chromium is not installed here: the browser test will skip", file=sys.stderr)


def native_timer() -> None:
    """The C++ bucket timer, compiled for this torch once (about a minute); without it buckets
    are timed in Python, so a failed build is said and passed over."""
    if subprocess.run([str(BIN / "ddpdoctor"), "native", "--build"], cwd=ROOT).returncode:
        print("dev.py: the C++ bucket timer did not build: buckets are timed in Python", file=sys.stderr)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "demo":
        installed("installed", "-e", ".")
        native_timer()
        return subprocess.run([str(BIN / "ddpdoctor"), "demo", *argv[1:]], cwd=ROOT).returncode
    installed("test-installed", "-e", ".[test]")
    native_timer()
    chromium()
    for lint in (["check", "."], ["format", "--check", "."]):  # the style CI holds us to, first
        if subprocess.run([str(BIN / "ruff"), *lint], cwd=ROOT).returncode:
            return 1
    return subprocess.run([str(PY), "-m", "pytest", "-q", *argv[1:]], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
