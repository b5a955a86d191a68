"""TD3 on MuJoCo (CleanRL's td3_continuous_action.py defaults): `python scripts/td3_continuous.py --compile`.

Checkpoints leave the replay buffer out unless `--save-buffer` is given (see `--help`).
"""

from dataclasses import dataclass

import tyro

from leanrl.algorithms import td3
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(td3.Args):
    exp_name: str = "td3_continuous"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "HalfCheetah-v5"
    """a gymnasium continuous-control id, e.g. `HalfCheetah-v5`, `Hopper-v5`, `Walker2d-v5`, `Pendulum-v1`"""


def make(env_id, num_envs, device, seed):
    # Off-policy learners see raw observations and rewards (no running normalization), as CleanRL's.
    if env_id.startswith("torch/"):
        return make_env(env_id, num_envs, device=device, seed=seed)
    return make_env(env_id, num_envs, device=device, seed=seed, normalize_obs=False, normalize_reward=False)


if __name__ == "__main__":
    args = tyro.cli(Args)
    td3.check_args(args)
    device = resolve_device(args.device)
    envs = make(args.env_id, args.num_envs, device, args.seed)
    eval_envs = make(args.env_id, args.eval_episodes, device, args.seed + 10_000) if args.eval_every else None
    td3.train(args, envs, device, eval_envs)
    envs.close()
    if eval_envs is not None:
        eval_envs.close()
