"""PPO on MuJoCo (CleanRL's ppo_continuous_action.py defaults): `python scripts/ppo_continuous.py --compile`."""

import functools
from dataclasses import dataclass
from typing import Literal

import tyro

import leanrl
from leanrl.algorithms import ppo, ppo_async
from leanrl.envs import check_recordable, make_env


@dataclass
class Args(ppo_async.Args):
    vectorization_mode: Literal["sync", "async"] = "sync"
    """how gymnasium steps the envs: `sync` in this process; `async` each in a worker process of its own
    (gymnasium's AsyncVectorEnv, observations in shared memory), so that with --num-env-buffers 2 a buffer's envs
    step while the policy acts on the other's (docs/performance.md#env-buffers)"""


DEFAULTS = Args(exp_name="ppo_continuous", env_id="HalfCheetah-v5", total_timesteps=1_000_000, learning_rate=3e-4,
                num_envs=1, num_steps=2048, num_minibatches=32, update_epochs=10, clip_coef=0.2, ent_coef=0.0)

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(Args, default=DEFAULTS, description=__doc__)
        ppo_async.check_args(args)
        gymnasium = not args.env_id.startswith("torch/")
        if args.vectorization_mode == "async" and (args.async_ or not gymnasium):
            raise leanrl.UsageError("--vectorization-mode async: gymnasium's envs in a run without --async (a "
                                    "torch/ env steps on the device, an async collector steps its envs itself)")
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        # gamma also discounts the reward normalizer's returns
        env_kwargs = dict(gamma=args.gamma, vectorization_mode=args.vectorization_mode) if gymnasium else {}
        make_envs = functools.partial(leanrl.EnvBuffers.of, functools.partial(make_env, args.env_id, **env_kwargs),
                                      args.num_envs, args.num_env_buffers)
        # evaluations read the training envs' observation statistics (ppo.train copies them) and raw rewards
        raw_rewards = {"normalize_reward": False} if gymnasium else {}
        make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, device=device,
                                           seed=args.seed + 10_000, **raw_rewards)
        if args.async_:  # each collector builds its own envs; a one-env instance gives the trainer the spaces
            ppo_async.train(args, make_envs, make_env(args.env_id, 1), device, make_eval_envs)
        else:
            envs = make_envs(device=device, seed=args.seed)
            ppo.train(args, envs, device, make_eval_envs)
            envs.close()
