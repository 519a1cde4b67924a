"""Environment variables through which `ddpdoctor run` configures the ranks it launches.

Every option the ranks need travels this way, so torchrun, mp.spawn and any other launcher
pass it on unchanged.
"""

RUN_DIR = "DDPDOCTOR_RUN_DIR"  # where ranks write their traces; its presence arms the bootstrap
BOOTSTRAP_DIR = "DDPDOCTOR_BOOTSTRAP_DIR"  # our sitecustomize directory, to find the user's own
FLUSH_INTERVAL = "DDPDOCTOR_FLUSH_S"  # seconds between trace flushes (FLUSH_INTERVAL_S)
BUFFER_EVENTS = "DDPDOCTOR_BUFFER_EVENTS"  # events waiting to be written before dropping (BUFFER_EVENTS_N)
FLUSH_INTERVAL_S = 0.25
BUFFER_EVENTS_N = 65536  # the ring's slots (128 bytes each: 8 MiB)
DISABLE = "DDPDOCTOR_DISABLE"  # "1": the bootstrap does nothing at all
# Per-bucket all-reduce spans need a timer in DDP's comm hook slot, and any hook there costs the
# step (a pass over the gradients; a GIL trip per bucket in Python): "auto" (the default) times
# them where a step can carry that (probes/commhook.py), "on" always, "off" never.
BUCKET_TIMING = "DDPDOCTOR_BUCKET_TIMING"
BUCKET_TIMING_MODES = ("auto", "on", "off")  # the first is the default
# "1": the probes' hot paths run in Python even where their C module (probes/_fast.c) is built
# (A/B measurements, and tests that check both paths record the same).
PURE_PYTHON = "DDPDOCTOR_PURE_PYTHON"
# Where `ddpdoctor native --build` puts the C++ bucket timer built for this torch (probes/native.py);
# default $XDG_CACHE_HOME/ddpdoctor, else ~/.cache/ddpdoctor.
CACHE = "DDPDOCTOR_CACHE"
HANG_FLOOR = "DDPDOCTOR_HANG_FLOOR_S"  # supervisor only: floor of the adaptive hang threshold (30)
STORE = "DDPDOCTOR_STORE"  # supervisor only: host:port of the store nodes share, or "off"
PYSPY = "DDPDOCTOR_PYSPY"  # supervisor only: the py-spy to run, or "off" (default: ours, else PATH)


def number(name: str, default: float, *, integer: bool = False) -> float:
    """A positive number from the environment (``default`` when unset), or a ValueError whose
    message is one line that names the variable and says what it must be."""
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = -1
    if not value > 0 or value != value or value == float("inf"):
        kind = "a positive whole number" if integer else "a positive number of seconds"
        raise ValueError(f"{name}={raw!r}: must be {kind}")
    return value


def bucket_timing() -> str:
    """``DDPDOCTOR_BUCKET_TIMING`` ("auto" when unset), or a ValueError naming what it may be."""
    import os

    raw = os.environ.get(BUCKET_TIMING, "").strip().lower() or BUCKET_TIMING_MODES[0]
    if raw not in BUCKET_TIMING_MODES:
        raise ValueError(f"{BUCKET_TIMING}={raw!r}: must be one of {', '.join(BUCKET_TIMING_MODES)}")
    return raw


def writer_settings() -> tuple[float, int]:
    """(seconds between flushes, events that may wait to be written) from the environment or
    their defaults; a bad value is a ValueError that names it (``number``)."""
    flush = number(FLUSH_INTERVAL, FLUSH_INTERVAL_S)
    return flush, int(number(BUFFER_EVENTS, BUFFER_EVENTS_N, integer=True))
