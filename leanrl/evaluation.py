"""Evaluation every few thousand steps, on an env of its own: the tool PPO, TD3, SAC and DQN share."""

import os

import torch

from leanrl.cli import UsageError


def open_eval_envs(args, make_eval_envs, run_dir: str):
    """The envs a run's evaluations run in (`--eval-every`, or `--capture-video`, which evaluates at the end), or
    None when it does not evaluate. `make_eval_envs(video_folder=...)` builds `args.eval_episodes` of them; with
    --capture-video the first one films its episodes into `<run_dir>/videos`."""
    if not (args.eval_every or args.capture_video):
        return None
    if make_eval_envs is None:
        raise UsageError("--eval-every / --capture-video: train() was given no make_eval_envs")
    return make_eval_envs(video_folder=os.path.join(run_dir, "videos") if args.capture_video else None)


def crossings(before: int, after: int, every: int) -> int:
    """How many multiples of `every` the step count passed going from `before` to `after`."""
    return after // every - before // every


@torch.no_grad()
def evaluate(policy, envs, seed: int, own_draws: bool = True) -> torch.Tensor:
    """Mean return of one episode in each of `envs.num_envs` environments, acting with `policy` (obs -> action),
    from a reset with `seed` (the same start states at every evaluation). Reads one flag to the host per step:
    it is meant to run every few thousand training steps, not in the hot loop.

    `own_draws`: the policy's and the envs' random draws come from torch's generators seeded with `seed` and put back
    as they were after, so the same weights score the same at every evaluation, and a run with evaluations trains as
    the same run without them. False where other threads draw from those generators meanwhile (async collector
    threads): putting them back would replay the other threads' draws."""
    if not own_draws:
        return _mean_return(policy, envs, seed)
    cuda = envs.device.type == "cuda"
    with torch.random.fork_rng(devices=[envs.device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:  # that device's generator only: the forked one
            with torch.cuda.device(envs.device):
                torch.cuda.manual_seed(seed)
        return _mean_return(policy, envs, seed)


def _mean_return(policy, envs, seed: int) -> torch.Tensor:
    obs = envs.reset(seed=seed)
    returns = finished = None
    while finished is None or not bool(finished.all()):
        out = envs.step(policy(obs))
        ended = out["episode_length"] > 0  # a whole episode ended (an Atari life loss is not one)
        if finished is None:
            returns, finished = torch.zeros_like(out["episode_return"]), torch.zeros_like(ended)
        returns = torch.where(ended & ~finished, out["episode_return"], returns)
        finished = finished | ended
        obs = out["next_obs"]
    return returns.mean()
