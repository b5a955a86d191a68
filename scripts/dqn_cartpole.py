"""DQN on CartPole (CleanRL's dqn.py defaults): `python scripts/dqn_cartpole.py --compile`.

The default env is `torch/CartPole-v1`: gymnasium's CartPole dynamics (checked step for step in
tests/test_envs.py) simulated in torch on the run's device, so the whole loop runs without a host sync.
`--env-id CartPole-v1` runs gymnasium's own, as CleanRL does.
"""

from dataclasses import dataclass

import tyro

from leanrl.algorithms import dqn
from leanrl.envs import make_env
from leanrl import resolve_device


@dataclass
class Args(dqn.Args):
    exp_name: str = "dqn_cartpole"
    """the name of this experiment (prefix of the run directory)"""
    env_id: str = "torch/CartPole-v1"
    """`torch/CartPole-v1` (on-device) or any gymnasium id with discrete actions, e.g. `CartPole-v1`"""
    total_timesteps: int = 500_000
    """total environment steps of the experiment"""


if __name__ == "__main__":
    args = tyro.cli(Args)
    dqn.check_args(args)
    device = resolve_device(args.device)
    envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed)
    eval_envs = (make_env(args.env_id, args.eval_episodes, device=device, seed=args.seed + 10_000)
                 if args.eval_every else None)
    dqn.train(args, envs, device, eval_envs)
    envs.close()
    if eval_envs is not None:
        eval_envs.close()
