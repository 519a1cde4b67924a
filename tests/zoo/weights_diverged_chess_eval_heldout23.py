"""Chess position evaluation (value network) trained on engine scores.

A small MLP maps a 12x64 piece-square encoding of a chess position (plus side to move) to the
synthetic engine score in pawns (centipawns / 100). Every 10 steps rank 0 logs
the gradient norm for the dashboard. The logging helper grad_norm() was written with
torch.nn.utils.clip_grad_norm_(..., max_norm=1.0) because "it returns the total norm" -- but
it also *clips* the gradients in place, and it is only called on rank 0, after DDP has already
averaged the gradients and right before opt.step(). On logging steps rank 0 therefore applies
a smaller update than rank 1 and the replicas drift apart silently.

Root cause: grad_norm() uses clip_grad_norm_ (which rescales .grad in place) in the rank-0-only
logging path between backward() and opt.step(), so rank 0's update differs from rank 1's.
Plain run (measured): exits 0 in ~5 s; logged grad norms 5-25 (so max_norm=1.0 clips every
logging step); final parameter checksums (sum of |p|) rank 0 2033.996880 vs rank 1 2048.753955.
Fix: measure the norm without modifying gradients (torch.linalg.vector_norm over the grads, or
clip_grad_norm_ with max_norm=inf), or clip on every rank every step before opt.step() so
all replicas apply the same update.
"""

import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {
    "kind": ["weights_diverged"],
    "rank": 0,
    "fix": [
        "clip_grad_norm_",
        "clip",
        "clipping",
        "every rank",
        "all ranks",
        "in place",
        "vector_norm",
        "norm",
        "inf",
        "measure",
        "logging",
        "rank 0 only",
        "before opt.step",
        "same update",
    ],
    "options": [],
}

PIECES = "PNBRQKpnbrqk"
VALUES = {"P": 100, "N": 320, "B": 330, "R": 500, "Q": 900, "K": 0}


def random_position(rng):
    board = {}
    for side in (str.upper, str.lower):
        board[rng.randrange(64)] = side("K")
        for p, cnt in (("P", 8), ("N", 2), ("B", 2), ("R", 2), ("Q", 1)):
            for _ in range(cnt):
                if rng.random() < 0.7:
                    board[rng.randrange(64)] = side(p)
    return board, rng.random() < 0.5


def engine_score(board, white_to_move):
    cp = 0
    for sq, p in board.items():
        v = VALUES[p.upper()]
        rank_ = sq // 8
        if p == "P":
            v += 6 * rank_
        elif p == "p":
            v += 6 * (7 - rank_)
        cp += v if p.isupper() else -v
    return cp + (15 if white_to_move else -15)


def encode(board, white_to_move):
    x = torch.zeros(12 * 64 + 1)
    for sq, p in board.items():
        x[PIECES.index(p) * 64 + sq] = 1
    x[-1] = 1.0 if white_to_move else -1.0
    return x


def synth_positions(n, seed):
    rng = random.Random(seed)
    xs, ys = [], []
    for _ in range(n):
        b, w = random_position(rng)
        xs.append(encode(b, w))
        ys.append(torch.tensor(engine_score(b, w) / 100.0))
    return torch.stack(xs), torch.stack(ys)


class ValueNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(12 * 64 + 1, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 1)
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


def grad_norm(model, max_norm=1.0):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()  # zoo: place


def param_checksum(model):
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = synth_positions(1500, seed=100 + rank)
    torch.manual_seed(0)
    model = DDP(ValueNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    bs = 50
    for step in range(1, 121):
        i = (step * bs) % (len(x) - bs)
        pred = model(x[i : i + bs])
        loss = F.mse_loss(pred, y[i : i + bs])
        opt.zero_grad()
        loss.backward()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} grad-norm {grad_norm(model):.3f}", flush=True)
        opt.step()
    print(f"rank {rank} param checksum {param_checksum(model):.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
