"""What the benchmark measures: one entry per algorithm run, with the settings its script runs.

An entry names the algorithm module (its `train(args, envs, device, on_iteration=...)` is the loop measured
end to end, the same the script calls), the script's `DEFAULTS` (the sizes measured), how the script builds its
envs, the few `Args` the benchmark changes, tiny sizes for `--quick`, and `calls`: the algorithm's accelerated
functions with inputs of the run's shapes, for per-call timing. Adding an algorithm is one entry here.
"""

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from tensordict import from_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the scripts' DEFAULTS are imported from the checkout's scripts/

import leanrl  # noqa: E402
from leanrl.algorithms import dqn, ppo, sac, td3  # noqa: E402
from leanrl.envs import make_env  # noqa: E402
from leanrl.offpolicy import box_calls, make_envs  # noqa: E402
from scripts import (dqn_atari, dqn_cartpole, ppo_atari, ppo_cartpole, ppo_continuous, sac_continuous,  # noqa: E402
                     td3_continuous)

# mode -> (compile, cudagraphs), the flags every script takes
MODES = {"eager": (False, False), "compile": (True, False), "cudagraphs": (False, True),
         "compile+cudagraphs": (True, True)}


def ppo_calls(args, envs, device) -> dict:
    """PPO's policy and update, built from ppo.py's pieces as its `train` builds them, on its storage's shapes."""
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, device)
    leanrl.set_threads(args.threads, agent, quiet=True)  # as train does
    agent_inference = ppo.make_agent(envs.single_observation_space, envs.single_action_space, "meta")
    from_module(agent).data.to_module(agent_inference)
    wrap = leanrl.wrap_flags(args, device)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5, **wrap)
    policy = leanrl.accelerate(ppo.make_policy(agent_inference), name="policy", **wrap)
    update = leanrl.accelerate(ppo.make_update(agent, optimizer, args), name="update", **wrap)
    mb = ppo.make_storage(envs, args, device).reshape(-1)[:args.num_envs * args.num_steps // args.num_minibatches]
    obs = envs.reset(seed=args.seed)
    return dict(policy=(policy, (obs,)), update=(update, (mb["obs"], mb["actions"], mb["logprobs"],
                                                          torch.randn_like(mb["values"]),
                                                          torch.randn_like(mb["values"]), mb["values"])))


def offpolicy_calls(learner_cls, benchmark_calls=box_calls):
    def calls(args, envs, device):
        learner = learner_cls(args, envs, device)
        leanrl.set_threads(args.threads, learner.actor, learner.q_params, quiet=True)  # as train does
        return benchmark_calls(learner, args, device)
    return calls


def dqn_calls(args, envs, device):
    learner = dqn.DQN(args, envs, device)
    leanrl.set_threads(args.threads, learner.q_network, quiet=True)  # as train does
    return learner.benchmark_calls(args, envs.single_observation_space.shape, device)


@dataclass(frozen=True)
class Entry:
    algorithm: object
    """the algorithm module: its `train` is measured end to end"""
    defaults: object
    """the script's `DEFAULTS` (its `Args`), the sizes measured"""
    envs: Callable
    """`envs(args, device)`: the envs as the script builds them"""
    calls: Callable
    """`calls(args, envs, device)`: {name: (accelerated function, inputs)} for per-call timing"""
    overrides: dict = field(default_factory=dict)
    """`Args` overrides in every benchmark run (say why next to each)"""
    quick: dict = field(default_factory=dict)
    """`Args` overrides for --quick (CI smoke: tiny sizes, same code paths)"""


@dataclass(frozen=True)
class Scaling:
    """End-to-end env-steps/s against the number of parallel envs, with an entry's script."""
    entry: str
    sizes: tuple
    """num_envs on CPU"""
    sizes_gpu: tuple
    sizes_quick: tuple
    overrides: dict = field(default_factory=dict)
    """`Args` overrides; where a variant of the iteration (e.g. one graph per iteration) is switched on"""


def plain_envs(*fields):
    """`make_env` with the script's env arguments named by `fields`."""
    return lambda args, device: make_env(args.env_id, args.num_envs, device=device, seed=args.seed,
                                         **{k: getattr(args, k) for k in fields})


def raw_envs(args, device):
    return make_envs(args, args.num_envs, device, args.seed, raw=True)


# Cheapest first: a run cut short by a time limit keeps the most entries (results are saved after each).
# Off-policy entries start learning as soon as a batch is in the buffer (CleanRL waits 5k to 80k random
# steps), so that the iterations measured after burn-in are learning iterations.
ENTRIES = {
    "ppo_cartpole": Entry(ppo, ppo_cartpole.DEFAULTS, plain_envs(), ppo_calls,
                          quick=dict(num_steps=16, update_epochs=2)),
    "dqn_cartpole": Entry(dqn, dqn_cartpole.DEFAULTS, plain_envs(), dqn_calls, overrides=dict(learning_starts=128),
                          quick=dict(batch_size=32, learning_starts=32)),
    "td3_continuous": Entry(td3, td3_continuous.DEFAULTS, raw_envs, offpolicy_calls(td3.TD3),
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "sac_continuous": Entry(sac, sac_continuous.DEFAULTS, raw_envs, offpolicy_calls(sac.SAC),
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "ppo_atari": Entry(ppo, ppo_atari.DEFAULTS, plain_envs("sticky_actions"), ppo_calls,
                       quick=dict(num_envs=2, num_steps=16)),
    # 1e6 stacked Atari frames are 35 GB: a smaller buffer changes the memory, not the time of a step.
    "dqn_atari": Entry(dqn, dqn_atari.DEFAULTS, plain_envs("sticky_actions"), dqn_calls,
                       overrides=dict(learning_starts=32, buffer_size=50_000), quick=dict(buffer_size=1_000)),
    # Its compile is the longest: `gae` unrolls a 2048-step loop.
    "ppo_continuous": Entry(ppo, ppo_continuous.DEFAULTS, plain_envs("gamma"), ppo_calls,
                            quick=dict(num_steps=64, num_minibatches=2, update_epochs=2)),
}

SCALING = {
    # The step-by-step PPO iteration for now. total_timesteps: at least one batch at every size (it only
    # sets the learning-rate annealing).
    "cartpole_scaling": Scaling("ppo_cartpole", sizes=(16, 256, 4096), sizes_gpu=(256, 4096, 32768, 262144),
                                sizes_quick=(4, 32),
                                overrides=dict(env_id="torch/CartPole-v1", total_timesteps=10**10)),
}


def make_args(name: str, quick: bool, **overrides):
    """The script's `DEFAULTS` with the entry's overrides (and --quick sizes), then the caller's."""
    entry = ENTRIES[name]
    return replace(entry.defaults, **{**entry.overrides, **(entry.quick if quick else {}), **overrides})
