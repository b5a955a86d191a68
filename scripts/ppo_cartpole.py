"""PPO on CartPole simulated in torch on the run's device: no host sync in the whole loop.
`python scripts/ppo_cartpole.py [--compile --cudagraphs] [--graph-iteration] [--async ...]`"""

import functools

import tyro

import leanrl
from leanrl.algorithms import ppo, ppo_async
from leanrl.envs import check_recordable, make_env

# rl-baselines3-zoo's tuned CartPole settings (its learning rate and clip range both annealed to 0): solved in 100k
# steps instead of CleanRL's 500k.
DEFAULTS = ppo_async.Args(exp_name="ppo_cartpole", env_id="torch/CartPole-v1", total_timesteps=100_000, num_envs=8,
                          num_steps=32, num_minibatches=1, update_epochs=20, learning_rate=1e-3, gamma=0.98,
                          gae_lambda=0.8, clip_coef=0.2, anneal_clip=True, ent_coef=0.0)

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(ppo_async.Args, default=DEFAULTS, description=__doc__)
        ppo_async.check_args(args)
        if args.capture_video:  # before anything is built
            check_recordable(args.env_id)
        device = leanrl.resolve_device(args.device)
        make_envs = functools.partial(leanrl.EnvBuffers.of, functools.partial(make_env, args.env_id), args.num_envs,
                                      args.num_env_buffers)
        make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, device=device,
                                           seed=args.seed + 10_000)
        if args.async_:  # each collector builds its own envs; a one-env instance gives the trainer the spaces
            ppo_async.train(args, make_envs, make_env(args.env_id, 1), device, make_eval_envs)
        else:
            envs = make_envs(device=device, seed=args.seed)
            ppo.train(args, envs, device, make_eval_envs)
            envs.close()
