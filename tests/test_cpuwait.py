"""probes/cpuwait.py: the run-queue delay each backward record carries, read in C where the
module is built and in Python otherwise; both give up the same way (a new thread per step
would leak a descriptor each). In a subprocess: each reader keeps its broken state for life."""

from __future__ import annotations

import subprocess
import sys

import pytest

JOB = """
import sys, threading
from ddpdoctor.probes import cpuwait, fastpath
read = cpuwait._run_queue_us if sys.argv[1] == "python" else fastpath.module().run_queue_us
first = read()
assert first >= 0 and read() >= first, first  # this thread's delay so far, in µs: it only grows
seen = []
for _ in range(8):  # the main thread holds one descriptor: seven more threads get one each
    t = threading.Thread(target=lambda: seen.append(read()))
    t.start()
    t.join()
print(seen[:7].count(-1), seen[7], read())
"""


@pytest.mark.parametrize("path", ["c", "python"])
def test_each_reader_gives_up_after_eight_threads_and_says_unknown_from_then_on(path: str) -> None:
    from ddpdoctor.probes import fastpath

    if path == "c" and fastpath.module() is None:
        pytest.fail("the C module is not built: pip install -e . builds it (pyproject's ext-modules)")
    proc = subprocess.run([sys.executable, "-c", JOB, path], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "-1", "-1"]


def test_none_grads_in_c_is_the_python_loop() -> None:
    import torch

    from ddpdoctor.probes import fastpath
    from ddpdoctor.probes.ddp import _py_none_grads

    fast = fastpath.module()
    if fast is None:
        pytest.fail("the C module is not built")
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(4)]
    params[1].grad = torch.ones(2)
    assert fast.none_grads(params) == _py_none_grads(params) == [0, 2, 3]
    assert fast.none_grads(tuple(params[1:2])) == [] and fast.none_grads([]) == []
    with pytest.raises(TypeError):
        fast.none_grads(3)
    with pytest.raises(AttributeError):  # as p.grad in Python: the probe's except logs it once
        fast.none_grads([object()])
