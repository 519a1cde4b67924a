"""counted_train.py as if its model were on a GPU: the device timer runs against the fake CUDA
of tests/fake_cuda.py, and every Linear layer "launches" device work on the fake stream
(1 ms in forward, 2 ms in backward) that runs after the CPU has moved on. Everything else,
gloo included, is the real CPU job."""

import runpy
from pathlib import Path

import torch.nn as nn

from ddpdoctor.probes import cuda_timing
from tests.fake_cuda import FakeCuda

FAKE = FakeCuda()
cuda_timing.device_of = lambda module: "cuda:0"
cuda_timing._cuda = lambda: FAKE
MS = 1_000_000


def _launch_forward(module, inputs, output):
    FAKE.current_stream().launch(1 * MS)


def _launch_backward(module, grad_input, grad_output):
    FAKE.current_stream().launch(2 * MS)


_init = nn.Linear.__init__


def _linear_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.register_forward_hook(_launch_forward)
    self.register_full_backward_hook(_launch_backward)


nn.Linear.__init__ = _linear_init
runpy.run_path(str(Path(__file__).with_name("counted_train.py")), run_name="__main__")
assert FAKE.synchronizes == 0
