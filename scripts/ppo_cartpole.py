"""PPO on CartPole simulated in torch on the run's device: no host sync in the whole loop."""

import functools
from dataclasses import dataclass

import tyro

from leanrl.algorithms import ppo
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(ppo.Args):
    exp_name: str = "ppo_cartpole"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "torch/CartPole-v1"
    """an on-device env: `torch/CartPole-v1` (or `torch/Pendulum-v1`)"""
    total_timesteps: int = 100_000
    """total environment steps of the experiment"""
    # rl-baselines3-zoo's tuned CartPole settings: solved in 100k steps instead of CleanRL's 500k.
    num_envs: int = 8
    """the number of parallel environments"""
    num_steps: int = 32
    """the number of steps to run in each environment per policy rollout"""
    num_minibatches: int = 1
    """the number of mini-batches"""
    update_epochs: int = 20
    """the K epochs to update the policy"""
    learning_rate: float = 1e-3
    """the learning rate of the optimizer"""
    gamma: float = 0.98
    """the discount factor gamma"""
    gae_lambda: float = 0.8
    """the lambda for the general advantage estimation"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""

if __name__ == "__main__":
    args = tyro.cli(Args)
    ppo.check_args(args)
    device = resolve_device(args.device)
    if args.async_:  # each collector builds its own envs
        ppo.train_async(args, functools.partial(make_env, args.env_id, args.num_envs), device)
    else:
        envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed)
        ppo.train(args, envs, device)
        envs.close()
