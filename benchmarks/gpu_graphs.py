"""Does a DDP step captured in a CUDA graph still work under ddpdoctor? (needs an NVIDIA GPU)

PyTorch's recipe for whole-network capture with DDP (NCCL, DDP built on a side stream, 11
eager warm-up steps, then ``torch.cuda.graph`` around forward, backward and the optimizer
step) is run twice with one rank: plain torchrun, then under ``ddpdoctor run``. The doctor's
probes sit inside that step (forward and backward hooks, its Python comm hook on every bucket,
device timing, which pauses while a graph is captured), so the check is the patient's: the
capture succeeds, the graph replays, eager steps after it train on, and the parameters at
the end are bit-identical to the plain run's. It also reports what the doctor recorded: the
eager steps only (a replay runs no Python, so no probe sees it).

    PYTHONPATH=. python benchmarks/gpu_graphs.py [--replays 20] [--out DIR]

Exit 0 when the doctor's run matches the plain one, 1 when not, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARMUP = 11  # PyTorch's documented minimum of DDP-enabled eager steps before a capture


def worker(args: argparse.Namespace) -> None:
    """One rank: warm up on a side stream, capture one whole step, replay it, then go eager."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    result: dict[str, Any] = {"torch": torch.__version__, "capture": None, "eager_after": None}
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    model = model.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.batch, args.width, device="cuda", generator=gen)
    y = torch.randn(args.batch, args.width, device="cuda", generator=gen)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = (ddp(x) - y).square().mean()
        loss.backward()
        opt.step()
        return loss

    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    losses = []
    try:
        with torch.cuda.graph(graph):
            static_loss = (ddp(x) - y).square().mean()
            static_loss.backward()
            opt.step()
        for _ in range(args.replays):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            graph.replay()
            losses.append(static_loss.item())
        result["capture"] = "ok"
    except Exception as exc:  # the check's finding, not ours to hide
        result["capture"] = f"{type(exc).__name__}: {exc}"
    try:
        for _ in range(5):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            losses.append(step().item())
        result["eager_after"] = "ok"
    except Exception as exc:
        result["eager_after"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.synchronize()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    result["params_sha256"] = digest.hexdigest()
    result["losses"] = [float.hex(v) for v in losses]
    Path(args.out_dir, "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, out: Path, doctor: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += [__file__, "--worker", "--out-dir", str(out), "--replays", str(args.replays)]
    cmd += ["--width", str(args.width), "--batch", str(args.batch)]
    if doctor:
        cmd = [sys.executable, "-m", "ddpdoctor", "run", "--out", str(out / "run"), "--", *cmd]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        code: int | str = proc.returncode
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        code, tail = "timeout", str(exc.stderr or "")[-3000:]
    path = out / "result.json"
    got = json.loads(path.read_text()) if path.exists() else {}
    return {"exit": code, "tail": tail if code != 0 else "", **got}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out-dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    if torch.cuda.device_count() == 0:
        print("gpu_graphs: no CUDA GPU here", file=sys.stderr)
        return 2
    root = Path(args.out or tempfile.mkdtemp(prefix="gpu_graphs-"))
    plain = _launch(args, root / "plain", doctor=False)
    doctor = _launch(args, root / "doctor", doctor=True)
    recorded: dict[str, int] = {}
    findings: list[str] = []
    if (root / "doctor" / "run").exists():
        from ddpdoctor.analysis import diagnose
        from ddpdoctor.trace.reader import load_run

        run = load_run([root / "doctor" / "run"])
        for rank_trace in run.ranks.values():
            for kind, events in rank_trace.events.items():
                recorded[kind] = recorded.get(kind, 0) + len(events.ts)
        findings = [f"{f.severity} {f.kind}: {f.summary}" for f in diagnose(run).findings] + run.notes
    same = bool(plain.get("params_sha256")) and plain.get("params_sha256") == doctor.get("params_sha256")
    ok = plain.get("exit") == doctor.get("exit") and same and plain.get("losses") == doctor.get("losses")
    print(
        json.dumps(
            {
                "plain": plain,
                "doctor": doctor,
                "bit_identical": same,
                "recorded": recorded,
                "findings": findings,
                "ok": ok,
            },
            indent=2,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
