"""PPO on MuJoCo (CleanRL's ppo_continuous_action.py defaults): `python scripts/ppo_continuous.py --compile`."""

import functools
from dataclasses import dataclass

import tyro

from leanrl.algorithms import ppo
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(ppo.Args):
    exp_name: str = "ppo_continuous"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "HalfCheetah-v5"
    """a gymnasium continuous-control id, e.g. `HalfCheetah-v5`, `Hopper-v5`, `Walker2d-v5`"""
    total_timesteps: int = 1_000_000
    """total environment steps of the experiment"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    num_minibatches: int = 32
    """the number of mini-batches"""
    update_epochs: int = 10
    """the K epochs to update the policy"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    ppo.check_args(args)
    device = resolve_device(args.device)
    if args.async_:  # each collector builds its own envs
        ppo.train_async(args, functools.partial(make_env, args.env_id, args.num_envs, gamma=args.gamma), device)
    else:
        envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed, gamma=args.gamma)
        ppo.train(args, envs, device)
        envs.close()
