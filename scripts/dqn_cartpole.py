"""DQN on CartPole (CleanRL's dqn.py defaults): `python scripts/dqn_cartpole.py --compile`.

The default env is `torch/CartPole-v1`: gymnasium's CartPole dynamics (checked step for step in
tests/test_envs.py) simulated in torch on the run's device, so the whole loop runs without a host sync.
`--env-id CartPole-v1` runs gymnasium's own, as CleanRL does.
"""

import functools

import tyro

import leanrl
from leanrl.algorithms import dqn
from leanrl.envs import check_recordable, make_env

DEFAULTS = dqn.Args(exp_name="dqn_cartpole", env_id="torch/CartPole-v1", total_timesteps=500_000)

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(dqn.Args, default=DEFAULTS, description=__doc__)
        dqn.check_args(args)
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        make_envs = functools.partial(make_env, args.env_id, device=device)
        envs = make_envs(args.num_envs, seed=args.seed)
        dqn.train(args, envs, device, functools.partial(make_envs, args.eval_episodes, seed=args.seed + 10_000))
        envs.close()
