"""PPO on Atari (CleanRL's ppo_atari.py defaults): `python scripts/ppo_atari.py --compile --cudagraphs`."""

import functools
from dataclasses import dataclass

import tyro

import leanrl
from leanrl.algorithms import ppo, ppo_async
from leanrl.envs import check_recordable, make_env


@dataclass
class Args(ppo_async.Args):
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25 (Machado et al., 2018)"""


# Truncation comes after 108k frames, rarely enough that CleanRL treats it as termination (no bootstrap). One env
# buffer, as CleanRL steps its envs: two measured no faster on a CPU (docs/performance.md#env-buffers).
DEFAULTS = Args(exp_name="ppo_atari", env_id="BreakoutNoFrameskip-v4", total_timesteps=10_000_000,
                clip_reward=True, bootstrap_truncated=False)

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(Args, default=DEFAULTS, description=__doc__)
        ppo_async.check_args(args)
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        make_envs = functools.partial(leanrl.EnvBuffers.of, functools.partial(
            make_env, args.env_id, sticky_actions=args.sticky_actions), args.num_envs, args.num_env_buffers)
        make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, device=device,
                                           seed=args.seed + 10_000, sticky_actions=args.sticky_actions)
        if args.async_:  # each collector builds its own envs; a one-env instance gives the trainer the spaces
            ppo_async.train(args, make_envs, make_env(args.env_id, 1), device, make_eval_envs)
        else:
            envs = make_envs(device=device, seed=args.seed)
            ppo.train(args, envs, device, make_eval_envs)
            envs.close()
