"""A DDP job whose rank 1 (or the ranks in TEST_CLOCK_SKEW_RANKS) believes the wall clock is
SKEW_S seconds ahead.

The skew is injected here, in the job (test-only), by replacing ``time.time_ns`` before
``init_process_group``: everything in this process that reads the wall clock, ddpdoctor's
header and clock probe included, sees the skewed time. Each step ends with a barrier, so the
true order of events across ranks is known.
"""

import os
import time

SKEW_NS = int(float(os.environ.get("TEST_CLOCK_SKEW_S", "0")) * 1e9)
if SKEW_NS and os.environ.get("RANK") in os.environ.get("TEST_CLOCK_SKEW_RANKS", "1").split(","):
    _real = time.time_ns
    time.time_ns = lambda: _real() + SKEW_NS  # noqa: E731

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(16, 4))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(6):
        opt.zero_grad()
        ddp(torch.randn(8, 16)).sum().backward()
        opt.step()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
