"""A collective inside a ``torch.compile``'d function, under the doctor: dynamo traces it whole
into its graph as torch's traceable collective (through the probe's Python wrapper, which it
inlines or rewrites), without a graph break or a recompile, and the results are those of the
same job without the doctor; the eager collectives around it are recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_lines, run_doctor, run_plain, torchrun

pytestmark = pytest.mark.e2e

JOB = """
import torch, torch.distributed as dist
import torch._dynamo.testing
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
counter = torch._dynamo.testing.CompileCounter()

@torch.compile(backend=counter, fullgraph=True)  # a graph break would raise
def doubled_sum(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1

model = DDP(torch.nn.Linear(2, 2))  # a DDP job: the model wrapped before the first compiled call
compiled = [doubled_sum(torch.ones(3) * (rank + i)).tolist() for i in range(3)]
for i in range(3):
    t = torch.ones(2) * (rank + i)
    dist.all_reduce(t)  # EAGER_LINE
if rank == 1:  # one rank prints: two would interleave
    print("compiled:", compiled, "graphs:", counter.frame_count, "ops:", counter.op_count)
    print("eager:", t.tolist())
dist.barrier()
dist.destroy_process_group()
"""


def test_a_compiled_collective_is_traced_whole_and_the_eager_ones_recorded(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    plain = run_plain(tmp_path, torchrun(2, script))
    assert plain.returncode == 0, plain.stderr[-3000:]
    job = run_doctor(tmp_path, torchrun(2, script))
    assert job.returncode == 0, job.stderr[-3000:]

    def results(stdout: str) -> list[str]:
        return sorted(line for line in stdout.splitlines() if line.startswith(("compiled:", "eager:")))

    assert results(job.stdout) == results(plain.stdout)
    # one graph per rank, with the collective in it (as without the doctor): no graph break
    assert "compiled: [[3.0, 3.0, 3.0], [7.0, 7.0, 7.0], [11.0, 11.0, 11.0]] graphs: 1" in job.stdout
    eager_line = next(i for i, text in enumerate(JOB.splitlines(), 1) if "EAGER_LINE" in text)
    for rank in (0, 1):
        records = read_lines(job.run_dir / f"trace-rank{rank}.jsonl")
        sites = {r[4]["id"]: (Path(r[4]["file"]).name, r[4]["line"]) for r in records if r[0] == "site"}
        calls = [r for r in records if r[0] == "collective" and r[4] == "all_reduce"]
        # fields: op, bytes, group, group_size, seq, async, site, sig
        assert [(sites[r[10]], r[5]) for r in calls] == [(("job.py", eager_line), 8)] * 3
        assert [r[8] for r in calls] == sorted(r[8] for r in calls)  # the group's own numbers
        barrier = [r for r in records if r[0] == "collective" and r[4] == "barrier"]
        assert len(barrier) == 1 and barrier[0][8] > calls[-1][8]
