"""What the off-policy tests share: a scripted env (transitions known in advance) and small settings."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from leanrl.algorithms import dqn
from leanrl.envs import make_env

BOX3 = gym.spaces.Box(-1, 1, (3,), np.float32)
TORQUE = gym.spaces.Box(-2, 2, (1,), np.float32)


class ScriptedEnv:
    """A scripted vector env: obs of env i at step t is [t, i, 0] ([t, i, -1] just after a reset); the scripted
    `ends` say which envs end how at which step (which a real env would not do on request)."""

    obs_dtype = torch.float32
    on_device = False
    device = torch.device("cpu")

    def __init__(self, num_envs=2, action_space=TORQUE, ends=None):
        self.num_envs, self.t = num_envs, 0
        self.single_observation_space, self.single_action_space = BOX3, action_space
        self.ends = ends or {}  # step -> (terminated list, truncated list)

    def obs(self, t, reset=False):
        return torch.tensor([[float(t), float(i), -1.0 if reset else 0.0] for i in range(self.num_envs)])

    def reset(self, seed=None):
        self.t = 0
        return self.obs(0)

    def step(self, action):
        self.t += 1
        terminated, truncated = (torch.tensor(x) for x in self.ends.get(self.t, ([False] * self.num_envs,) * 2))
        done = terminated | truncated
        final_obs = self.obs(self.t)
        next_obs = torch.where(done[:, None], self.obs(self.t, reset=True), final_obs)
        return TensorDict(next_obs=next_obs, final_obs=final_obs, reward=torch.full((self.num_envs,), float(self.t)),
                          terminated=terminated, truncated=truncated, episode_return=done.float() * 7,
                          episode_length=done.long() * self.t, batch_size=[self.num_envs])

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass

    def close(self):
        pass


def small(module, **kw):
    base = dict(hidden_dim=16, batch_size=8, buffer_size=64, learning_starts=4, total_timesteps=1000, num_envs=2,
                progress=False, checkpoint_every=0)
    if module is dqn:
        base.pop("hidden_dim")
    return module.Args(**{**base, **kw})


def batch(B=8, obs_dim=3, act_dim=1, terminated_every=3):
    """A replay sample of random transitions, as `Replay.sample` returns it."""
    return dict(obs=torch.randn(B, obs_dim), action=torch.rand(B, act_dim) * 4 - 2, reward=torch.randn(B),
                next_obs=torch.randn(B, obs_dim), terminated=torch.arange(B) % terminated_every == 0)


class Reached(Exception):
    pass


class EpisodeRecorder:
    """Records the return of every finished episode (a test-side host read) and stops the run, by raising
    `Reached`, as soon as the mean of the last 10 reaches `threshold`."""

    def __init__(self, env, threshold):
        self.env, self.threshold, self.returns, self.steps = env, threshold, [], 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, action):
        out = self.env.step(action)
        self.steps += self.env.num_envs
        ended = out["episode_length"] > 0
        self.returns += out["episode_return"][ended].tolist()
        if len(self.returns) >= 10 and np.mean(self.returns[-10:]) >= self.threshold:
            raise Reached
        return out


def reaches(module, tmp_path, env_id, threshold, **kw):
    """Train until the mean return of the last 10 episodes reaches `threshold` (True), or for all of
    `total_timesteps` (a failure, with the returns in the message)."""
    args = module.Args(env_id=env_id, seed=1, run_dir=str(tmp_path), checkpoint_every=0, progress=False, **kw)
    envs = EpisodeRecorder(make_env(env_id, args.num_envs, seed=args.seed), threshold)
    try:
        module.train(args, envs, torch.device("cpu"))
    except Reached:
        print(f"{module.__name__}: last 10 episodes {np.mean(envs.returns[-10:]):.1f} after {envs.steps} steps")
        return True
    pytest.fail(f"after {envs.steps} steps, last 10 episodes: {envs.returns[-10:]}")


# Pendulum: CleanRL's algorithms and defaults, except smaller networks (64 units instead of 256), batch 128 and
# 1000 random steps instead of 5000-25000 (both solve Pendulum either way; this costs a fraction of the CPU time).
PENDULUM_LEARNING = dict(num_envs=1, total_timesteps=20_000, learning_starts=1000, hidden_dim=64, batch_size=128,
                         log_every=1000)
