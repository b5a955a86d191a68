"""TD3 on MuJoCo (CleanRL's td3_continuous_action.py defaults): `python scripts/td3_continuous.py --compile`.

`--env-id`: a gymnasium continuous-control id (`HalfCheetah-v5`, `Hopper-v5`, `Walker2d-v5`, `Pendulum-v1`) or
`torch/Pendulum-v1`. Observations and rewards are raw (no running normalization), as CleanRL's. Checkpoints leave
the replay buffer out unless `--save-buffer` is given (see `--help`).
"""

import functools

import tyro

import leanrl
from leanrl.algorithms import td3
from leanrl.envs import check_recordable, make_env

DEFAULTS = td3.Args(exp_name="td3_continuous", env_id="HalfCheetah-v5")

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(td3.Args, default=DEFAULTS, description=__doc__)
        td3.check_args(args)
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        make_envs = functools.partial(make_env, args.env_id, device=device, normalize=False)
        envs = make_envs(args.num_envs, seed=args.seed)
        td3.train(args, envs, device, functools.partial(make_envs, args.eval_episodes, seed=args.seed + 10_000))
        envs.close()
