"""DQN on Atari (CleanRL's dqn_atari.py defaults): `python scripts/dqn_atari.py --compile --cudagraphs`.

`--env-id`: any ALE game, `BreakoutNoFrameskip-v4` or `ALE/Breakout-v5`. Memory: the buffer keeps each
observation (4x84x84 bytes) and the newest frame of the next one, about 35 GB at the default 1e6 transitions, on
the learner's device unless `--buffer-device cpu`. Checkpoints leave the buffer out unless `--save-buffer`.
"""

import functools
from dataclasses import dataclass

import tyro

import leanrl
from leanrl.algorithms import dqn
from leanrl.envs import check_recordable, make_env


@dataclass
class Args(dqn.Args):
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25 (Machado et al., 2018)"""


# eval_epsilon 0.05 as CleanRL's evaluation: a greedy Atari agent can stall (e.g. never pressing FIRE).
DEFAULTS = Args(exp_name="dqn_atari", env_id="BreakoutNoFrameskip-v4", total_timesteps=10_000_000,
                learning_rate=1e-4, buffer_size=1_000_000, target_network_frequency=1000, batch_size=32, end_e=0.01,
                exploration_fraction=0.10, learning_starts=80_000, train_frequency=4, clip_reward=True,
                eval_epsilon=0.05, checkpoint_every=100_000)

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(Args, default=DEFAULTS, description=__doc__)
        dqn.check_args(args)
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        make_envs = functools.partial(make_env, args.env_id, device=device, sticky_actions=args.sticky_actions)
        envs = make_envs(args.num_envs, seed=args.seed)
        dqn.train(args, envs, device, functools.partial(make_envs, args.eval_episodes, seed=args.seed + 10_000))
        envs.close()
