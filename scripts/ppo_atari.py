"""PPO on Atari (CleanRL's ppo_atari.py defaults): `python scripts/ppo_atari.py --compile --cudagraphs`."""

import functools
from dataclasses import dataclass

import tyro

from leanrl.algorithms import ppo
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(ppo.Args):
    exp_name: str = "ppo_atari"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """any ALE game: `BreakoutNoFrameskip-v4` or `ALE/Breakout-v5`"""
    total_timesteps: int = 10_000_000
    """total environment steps of the experiment"""
    clip_reward: bool = True
    """clip rewards to their sign before learning (scores are still logged raw)"""
    bootstrap_truncated: bool = False
    """truncation comes after 108k frames, rarely enough that CleanRL treats it as termination"""
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25 (Machado et al., 2018)"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    ppo.check_args(args)
    device = resolve_device(args.device)
    if args.async_:  # each collector builds its own envs
        ppo.train_async(args, functools.partial(make_env, args.env_id, args.num_envs, sticky_actions=args.sticky_actions), device)
    else:
        envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed, sticky_actions=args.sticky_actions)
        ppo.train(args, envs, device)
        envs.close()
