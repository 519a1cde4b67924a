"""Policy-gradient (REINFORCE) on a pure-Python point-mass navigation simulator, one environment
per rank for domain randomization. Rollouts cost tens of ms per update, but healthy: the
variants randomize friction and goal size only, every rank integrates with the same 4 physics
substeps and horizon, so the ranks reach each gradient all-reduce at about the same time."""
import math
import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = None

ENV_VARIANTS = [
    {"friction": 0.10, "substeps": 4, "goal_radius": 0.15},
    {"friction": 0.05, "substeps": 4, "goal_radius": 0.10},
]
HORIZON = 24
N_ENVS = 4
SOLVER_ITERS = 100


class PointMass:
    def __init__(self, friction, substeps, goal_radius, seed):
        self.friction, self.substeps, self.goal_radius = friction, substeps, goal_radius
        self.rng = random.Random(seed)

    def reset(self):
        self.pos = [self.rng.uniform(-1, 1), self.rng.uniform(-1, 1)]
        self.vel = [0.0, 0.0]
        self.goal = [self.rng.uniform(-1, 1), self.rng.uniform(-1, 1)]
        return self.obs()

    def obs(self):
        return [self.pos[0], self.pos[1], self.vel[0], self.vel[1],
                self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]]

    def step(self, action):
        ax, ay = (math.cos(action * math.pi / 4), math.sin(action * math.pi / 4))
        dt = 0.05 / self.substeps
        for _ in range(self.substeps):
            for _ in range(SOLVER_ITERS):  # drag solver iterations
                self.vel[0] += dt * (ax - self.friction * self.vel[0]) / SOLVER_ITERS
                self.vel[1] += dt * (ay - self.friction * self.vel[1]) / SOLVER_ITERS
            self.pos[0] = max(-1.5, min(1.5, self.pos[0] + dt * self.vel[0]))
            self.pos[1] = max(-1.5, min(1.5, self.pos[1] + dt * self.vel[1]))
        dist_goal = math.hypot(self.goal[0] - self.pos[0], self.goal[1] - self.pos[1])
        return self.obs(), -dist_goal + (1.0 if dist_goal < self.goal_radius else 0.0), dist_goal < self.goal_radius


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))

    def forward(self, obs):
        return self.net(obs)


@torch.no_grad()
def collect_rollouts(policy, envs):
    obs = [env.reset() for env in envs]
    obs_buf, act_buf, rew_buf = [], [], []
    for _ in range(HORIZON):
        o = torch.tensor(obs)
        acts = torch.distributions.Categorical(logits=policy(o)).sample()
        steps = [env.step(a) for env, a in zip(envs, acts.tolist())]
        obs_buf.append(o)
        act_buf.append(acts)
        rew_buf.append(torch.tensor([r for _, r, _ in steps]))
        obs = [ob for ob, _, _ in steps]
    returns, ret = [], torch.zeros(len(envs))
    for r in reversed(rew_buf):
        ret = r + 0.98 * ret
        returns.append(ret)
    returns = torch.stack(returns[::-1]).flatten()
    adv = (returns - returns.mean()) / (returns.std() + 1e-6)
    return torch.cat(obs_buf), torch.cat(act_buf), adv


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    variant = ENV_VARIANTS[rank % len(ENV_VARIANTS)]
    envs = [PointMass(seed=1000 * rank + i, **variant) for i in range(N_ENVS)]

    model = DDP(Policy())
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for update in range(120):
        obs, acts, adv = collect_rollouts(model.module, envs)
        logp = torch.log_softmax(model(obs), dim=-1).gather(1, acts.unsqueeze(1)).squeeze(1)
        loss = -(logp * adv).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and update % 25 == 0:
            print(f"update {update} loss {loss.item():.4f} steps {len(acts)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
