"""DQN on Atari (CleanRL's dqn_atari.py defaults): `python scripts/dqn_atari.py --compile --cudagraphs`.

Memory: the buffer keeps each observation (4x84x84 bytes) and the newest frame of the next one, about 35 GB
at the default 1e6 transitions, on the learner's device unless `--buffer-device cpu`. Checkpoints leave the
buffer out unless `--save-buffer` is given.
"""

from dataclasses import dataclass

import tyro

from leanrl.algorithms import dqn
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(dqn.Args):
    exp_name: str = "dqn_atari"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "BreakoutNoFrameskip-v4"
    """any ALE game: `BreakoutNoFrameskip-v4` or `ALE/Breakout-v5`"""
    total_timesteps: int = 10_000_000
    """total environment steps of the experiment"""
    learning_rate: float = 1e-4
    """the learning rate of the optimizer"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    target_network_frequency: int = 1000
    """the env steps it takes to update the target network"""
    batch_size: int = 32
    """the batch size of samples from the replay memory"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total_timesteps` it takes from start_e to go end_e"""
    learning_starts: int = 80_000
    """env steps before learning starts"""
    train_frequency: int = 4
    """the env steps between two updates"""
    clip_reward: bool = True
    """clip rewards to their sign before learning (scores are still logged raw)"""
    eval_epsilon: float = 0.05
    """epsilon of the evaluation policy (CleanRL's; a greedy Atari agent can stall, e.g. never pressing FIRE)"""
    checkpoint_every: int = 100_000
    """save a checkpoint every this many iterations (0: only at exit)"""
    sticky_actions: bool = False
    """repeat the previous action with probability 0.25 (Machado et al., 2018)"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    dqn.check_args(args)
    device = resolve_device(args.device)
    envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed, sticky_actions=args.sticky_actions)
    eval_envs = (make_env(args.env_id, args.eval_episodes, device=device, seed=args.seed + 10_000,
                          sticky_actions=args.sticky_actions) if args.eval_every else None)
    dqn.train(args, envs, device, eval_envs)
    envs.close()
    if eval_envs is not None:
        eval_envs.close()
