"""Planar two-link robot arm: learning to reach a target with REINFORCE.

Every rank simulates its own batch of arms (vectorised in torch) with a Gaussian
policy, collects episodes that end early when the fingertip reaches the target, and
computes a policy-gradient loss summed over all valid (non-terminated) time steps. The
summed gradient is then normalised to a per-step average by `normalise_by_steps()`
before gradient clipping and the Adam step.

Root cause: the normalisation divides the gradients *after* backward, i.e. after DDP
has already averaged them across ranks, and it divides by the rank's *own* number of
valid steps. Episodes terminate at different times on different ranks, so each rank
scales the same synchronised gradient by a different factor and takes a different
step. The replicas drift apart silently; exit code 0.

Fix: normalise the loss before backward with a global count (all_reduce the number of
valid steps across ranks and divide the loss by it, times the world size), so the
gradients every rank steps with are identical.

Observed (plain run): exit 0 in ~6 s; rank 0 prints the mean return every 10 iterations
(-58 -> between -40 and -48) and its own step count (e.g. 920, 877, 737 valid steps; rank 1's counts
differ). Checked separately: all policy weights differ between the ranks, max |diff| ~6e-3
(mu.0.weight); the Adam moments differ by up to ~1e-3; log_std is the least affected.
"""
import gc
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EXPECT = {"kind": ["weights_diverged", "model_differs", "gradients_not_synced"], "rank": None,
          "fix": ["all_reduce", "before backward", "global count", "every rank"],
          "options": []}

L1, L2 = 1.0, 0.8
N_ENVS, HORIZON, TOL = 24, 40, 0.15


class ReachEnv:
    def __init__(self, n, generator):
        self.n, self.g = n, generator

    def reset(self):
        self.q = (torch.rand(self.n, 2, generator=self.g) - 0.5) * math.pi
        ang = torch.rand(self.n, generator=self.g) * 2 * math.pi
        rad = 0.4 + torch.rand(self.n, generator=self.g) * 1.2
        self.target = torch.stack([rad * torch.cos(ang), rad * torch.sin(ang)], dim=1)
        return self.obs()

    def tip(self):
        a1, a12 = self.q[:, 0], self.q[:, 0] + self.q[:, 1]
        return torch.stack([L1 * torch.cos(a1) + L2 * torch.cos(a12),
                            L1 * torch.sin(a1) + L2 * torch.sin(a12)], dim=1)

    def obs(self):
        return torch.cat([torch.sin(self.q), torch.cos(self.q), self.target, self.target - self.tip()], dim=1)

    def step(self, action):
        self.q = self.q + 0.15 * action.clamp(-1, 1)
        dist_to_target = (self.tip() - self.target).norm(dim=1)
        reward = -dist_to_target - 0.01 * (action ** 2).sum(1)
        done = dist_to_target < TOL
        return self.obs(), reward + 2.0 * done.float(), done


class GaussianPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
        self.log_std = nn.Parameter(torch.full((2,), -0.5))

    def forward(self, obs):
        return self.mu(obs), self.log_std.expand(obs.shape[0], 2)


def rollout(policy, env, sample_gen):
    obs_buf, act_buf, rew_buf, alive_buf = [], [], [], []
    obs = env.reset()
    alive = torch.ones(env.n, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(HORIZON):
            mu, log_std = policy(obs)
            act = mu + log_std.exp() * torch.randn(mu.shape, generator=sample_gen)
            nxt, rew, done = env.step(act)
            obs_buf.append(obs); act_buf.append(act)  # noqa: E702
            rew_buf.append(rew * alive); alive_buf.append(alive.clone())  # noqa: E702
            alive = alive & ~done
            obs = nxt
            if not alive.any():
                break
    return torch.stack(obs_buf), torch.stack(act_buf), torch.stack(rew_buf), torch.stack(alive_buf)


def reward_to_go(rew, gamma=0.97):
    out = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[1])
    for t in reversed(range(rew.shape[0])):
        running = rew[t] + gamma * running
        out[t] = running
    return out


def normalise_by_steps(params, n_steps):
    for p in params:
        if p.grad is not None:
            p.grad.div_(n_steps)  # zoo: place


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(17)
    env_gen = torch.Generator().manual_seed(1000 + rank)
    act_gen = torch.Generator().manual_seed(2000 + rank)

    policy = DDP(GaussianPolicy())
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    env = ReachEnv(N_ENVS, env_gen)

    history = []
    for it in range(60):
        obs, act, rew, alive = rollout(policy, env, act_gen)
        T = obs.shape[0]
        ret = reward_to_go(rew)
        adv = (ret - ret[alive].mean()) / (ret[alive].std() + 1e-6)

        mu, log_std = policy(obs.reshape(T * N_ENVS, -1))
        logp = torch.distributions.Normal(mu, log_std.exp()).log_prob(act.reshape(T * N_ENVS, 2)).sum(-1)
        mask = alive.reshape(-1).float()
        loss = -(logp * adv.reshape(-1) * mask).sum()

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        n_valid = int(mask.sum().item())
        normalise_by_steps(policy.parameters(), n_valid)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()

        ep_return = torch.tensor([rew.sum(0).mean().item()])
        dist.all_reduce(ep_return)
        history.append(ep_return.item() / dist.get_world_size())
        if rank == 0 and it % 10 == 0:
            print(f"iter {it}: mean return {history[-1]:.3f} (steps this rank {n_valid})", flush=True)

    if rank == 0:
        out = os.path.join(tempfile.gettempdir(), "ddpdoctor-zoo")
        os.makedirs(out, exist_ok=True)
        torch.save(policy.module.state_dict(), os.path.join(out, "reachpolicy_heldout29.pt"))
    dist.barrier()
    del policy
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
