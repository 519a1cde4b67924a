"""Environment variables through which `ddpdoctor run` configures the ranks it launches.

Every option the ranks need travels this way, so torchrun, mp.spawn and any other launcher
pass it on unchanged.
"""

RUN_DIR = "DDPDOCTOR_RUN_DIR"  # where ranks write their traces; its presence arms the bootstrap
BOOTSTRAP_DIR = "DDPDOCTOR_BOOTSTRAP_DIR"  # our sitecustomize directory, to find the user's own
FLUSH_INTERVAL = "DDPDOCTOR_FLUSH_S"  # seconds between trace flushes (default 0.25)
BUFFER_EVENTS = "DDPDOCTOR_BUFFER_EVENTS"  # events held in memory before dropping (default 100000)
DISABLE = "DDPDOCTOR_DISABLE"  # "1": the bootstrap does nothing at all
HANG_FLOOR = "DDPDOCTOR_HANG_FLOOR_S"  # supervisor only: floor of the adaptive hang threshold (30)
