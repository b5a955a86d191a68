"""Tools the off-policy loops (TD3, SAC, DQN) call; each loop itself is in its algorithm's file: the checks on
their common arguments, torchrl's replay buffer and its place in a checkpoint, where a run stands (`Run`), the
Logger's burn-in for a run that compiles only once learning starts, the vmapped twin critic, and what a script's
`main` does."""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from torch.func import functional_call
from torch.utils._pytree import tree_map

import leanrl

if TYPE_CHECKING:  # torchrl, the `offpolicy` extra, is imported when a buffer is made (see check_replay_args)
    from torchrl.data import ReplayBuffer


def check_replay_args(args, learning_rates=("learning_rate",)) -> int:
    """Fail on replay settings that cannot work, or on a missing torchrl, before any environment is built or
    anything compiled. Returns the number of iterations (vector env steps)."""
    leanrl.check_flags(args, positive=("num_envs", "buffer_size", "batch_size", "eval_episodes", *learning_rates),
                       non_negative=("learning_starts", "eval_every"), unit_interval=("gamma",))
    if args.total_timesteps < args.num_envs:
        raise leanrl.UsageError(f"total_timesteps = {args.total_timesteps} is less than one step of num_envs = "
                                f"{args.num_envs} environments")
    if args.batch_size > args.buffer_size:
        raise leanrl.UsageError(f"batch_size = {args.batch_size} must be at most buffer_size = {args.buffer_size}")
    if args.learning_starts >= args.total_timesteps:
        raise leanrl.UsageError(f"learning_starts = {args.learning_starts} must be less than total_timesteps = "
                                f"{args.total_timesteps}: otherwise no update would ever run")
    if not 0 < args.tau <= 1:
        raise leanrl.UsageError(f"tau = {args.tau} must be in (0, 1]")
    leanrl.require_extra("the replay buffer of TD3, SAC and DQN", "torchrl", "offpolicy")
    return args.total_timesteps // args.num_envs


def check_envs(algo: str, args, envs, make_eval_envs):
    """The env matches the arguments, and an evaluation has envs to run in."""
    if envs.num_envs != args.num_envs:
        raise leanrl.UsageError(f"envs has {envs.num_envs} environments, args.num_envs = {args.num_envs}")
    if (args.eval_every or args.capture_video) and make_eval_envs is None:
        raise leanrl.UsageError(f"{algo}: --eval-every / --capture-video need evaluation envs: train() was given no "
                                "make_eval_envs")


def open_eval_envs(args, make_eval_envs, run_dir: str):
    """The envs evaluations run in, or None when the run does not evaluate. With --capture-video the first one films
    its episodes into `<run_dir>/videos`."""
    if not (args.eval_every or args.capture_video):
        return None
    return make_eval_envs(video_folder=os.path.join(run_dir, "videos") if args.capture_video else None)


def check_box_spaces(algo: str, observation_space, action_space):
    """TD3 and SAC act in a bounded Box and read flat observations."""
    if hasattr(action_space, "n") or not hasattr(action_space, "low"):
        raise leanrl.UsageError(f"{algo} needs a continuous (Box) action space; got {action_space} "
                                "(use DQN for discrete actions)")
    low, high = torch.as_tensor(action_space.low), torch.as_tensor(action_space.high)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise leanrl.UsageError(f"{algo} needs a bounded action space; got low={action_space.low}, "
                                f"high={action_space.high}")
    if len(observation_space.shape) != 1:
        raise leanrl.UsageError(f"{algo} reads flat observations; got shape {observation_space.shape}")


def make_twin_q(qnet, looped: bool = False):
    """One critic, `q_value(params, obs, action)` -> (batch,), and both in one call, `twin_q(params, obs, action)`
    -> (2, batch), where `params` holds the two networks' weights stacked (a TensorDict, or a dict by dotted
    parameter name) and `qnet` is a weightless (meta) copy of the architecture. `twin_q` is one vmapped call, or two
    calls when `looped`: compiled on a CPU, inductor lowers vmap's batched product with a single output column (the
    last layer, and its weight's gradient) to slow reduction kernels, about 2 ms of a 4.3 ms TD3 critic update at
    batch 256 (cpu-2core-intel-xeon)."""

    def q_value(params, obs, action):
        # LeanRL's `with params.to_module(qnet)` here makes torch 2.13's Dynamo fail (an internal error, at the
        # first compiled call, under no_grad); functional_call is the same computation and compiles.
        return functional_call(qnet, _by_dotted_name(params), (obs, action))

    def twin_q_looped(params, obs, action):
        params = _by_dotted_name(params)
        return torch.stack([q_value({name: p[i] for name, p in params.items()}, obs, action) for i in range(2)])

    return q_value, twin_q_looped if looped else torch.vmap(q_value, (0, None, None))


def _by_dotted_name(params) -> dict:
    return params if isinstance(params, dict) else dict(params.flatten_keys(".").items())


def make_replay_buffer(size: int, batch_size: int, device) -> ReplayBuffer:
    """torchrl's ReplayBuffer with its storage on `device` (allocated for `size` transitions at the first
    `extend`, with the keys, shapes and dtypes of that first batch). `sample()` draws `batch_size`
    transitions uniformly, with replacement, so every batch has the same shape: what a graphed update needs."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines say it allocated the storage

    if batch_size > size:
        raise ValueError(f"batch_size = {batch_size} is larger than buffer_size = {size}")
    return ReplayBuffer(storage=LazyTensorStorage(size, device=device), batch_size=batch_size)


def store(rb: ReplayBuffer, obs, action, out, next_obs):
    """Add one vector step. `next_obs` is the true next observation (from the env's `final_obs`, not the reset
    observation that follows an episode's end), kept with `terminated` apart from `truncated`, so that the
    target bootstraps through a time limit and only stops at a termination."""
    rb.extend(TensorDict(obs=obs, action=action, reward=out["reward"], next_obs=next_obs,
                         terminated=out["terminated"], truncated=out["truncated"], batch_size=[obs.shape[0]]))

@dataclass
class Run:
    """Where an off-policy run stands: what its checkpoint holds besides the learner's weights and optimizers, and
    what `train` returns."""

    learner: object
    """the algorithm's networks, optimizers and accelerated functions (with `state_dict` / `load_state_dict`)"""
    rb: ReplayBuffer
    obs: torch.Tensor | None = None
    """the observation the next action is taken from"""
    global_step: int = 0
    iteration: int = 0
    fill_start: int = 0
    """global step at which the buffer started filling (moves when resumed without the buffer)"""
    updates: int = 0
    """updates by this process (compile and capture happen in the first few)"""
    logged: dict = field(default_factory=dict)
    """the last values written to the log"""

    def state_dict(self, envs, save_buffer: bool) -> dict:
        return dict(self.learner.state_dict(), envs=envs.state_dict(), obs=self.obs, global_step=self.global_step,
                    iteration=self.iteration, fill_start=self.fill_start,
                    replay_buffer=replay_state_dict(self.rb, save_buffer))

    def load_state_dict(self, state: dict, envs, seed: int):
        self.learner.load_state_dict(state)
        self.global_step, self.iteration = state["global_step"], state["iteration"]
        self.obs = leanrl.restore_envs(envs, state["envs"], state["obs"], seed=seed + self.global_step)
        restored = load_replay_state_dict(self.rb, state["replay_buffer"])
        # Without its buffer, a resumed run updates again once learning_starts new transitions are stored.
        self.fill_start = state["fill_start"] if restored else self.global_step


def start(learner, rb: ReplayBuffer, args, envs, may_change=("learning_starts",)) -> tuple[Run, str]:
    """A fresh run from a reset with `args.seed`, or the one `args.resume` names (`may_change`: the flags a resume
    may change, see `leanrl.load_checkpoint`); and its checkpoint's path."""
    run = Run(learner, rb)
    ckpt_path = os.path.join(leanrl.make_run_dir(args, args.env_id), "checkpoint.pt")
    if args.resume:
        state = leanrl.load_checkpoint(args.resume, args, may_change)
        leanrl.restore_rng(state)
        run.load_state_dict(state, envs, args.seed)
    else:
        run.obs = envs.reset(seed=args.seed)
    return run, ckpt_path


def burn_in(args, run: Run, updates: int, updates_in=lambda before, after: 1) -> int:
    """The Logger's burn-in for an off-policy run: the iterations this process takes to its `updates`-th update,
    after which every accelerated function has been compiled and captured (updates begin only once the buffer
    holds learning_starts transitions, long after `leanrl.WARMUP` iterations, so compile time would otherwise
    dilute SPS). `updates_in(before, after)`: the updates of an iteration from global step `before` to `after`."""
    step, iterations, done = run.global_step, 0, 0
    while done < updates:
        before, step, iterations = step, step + args.num_envs, iterations + 1
        if step - run.fill_start > args.learning_starts:
            done += updates_in(before, step)
    return iterations


def box_calls(learner, args, device) -> dict:
    """TD3's and SAC's accelerated functions with inputs of this run's shapes, for per-call timing (benchmarks)."""
    B, obs_dim, action_dim = args.batch_size, learner.obs_dim, learner.action_dim
    obs, next_obs = torch.randn(B, obs_dim, device=device), torch.randn(B, obs_dim, device=device)
    actions = learner.low + (learner.high - learner.low) * torch.rand(B, action_dim, device=device)
    rewards, terminated = torch.randn(B, device=device), torch.zeros(B, dtype=torch.bool, device=device)
    return {"policy": (learner.policy, (torch.randn(args.num_envs, obs_dim, device=device),)),
            "update_critic": (learner.update_critic, (obs, actions, rewards, next_obs, terminated)),
            "update_actor": (learner.update_actor, (obs,))}


def replay_state_dict(rb: ReplayBuffer, include: bool):
    """The buffer's contents and write cursor for a checkpoint, or None when `include` is False."""
    return rb.state_dict() if include else None


def load_replay_state_dict(rb: ReplayBuffer, state) -> bool:
    """Restore what `replay_state_dict` saved, onto the buffer's own device (a checkpoint is loaded on CPU).
    Returns False, and says so, when the checkpoint holds no buffer: the caller refills it."""
    if state is None:
        print("leanrl: this checkpoint holds no replay buffer (save one with --save-buffer); the resumed run acts "
              "with the restored policy and updates again once learning_starts new transitions are stored.",
              file=sys.stderr)
        return False
    device = rb.storage.device
    state = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state)
    if not rb.storage.initialized:
        # torchrl 0.14 loads into an empty storage without its batch size (sampling then fails): allocate it with
        # one transition of the saved shapes and dtypes first; the load below overwrites it, cursor included.
        stored = TensorDict(state["_storage"]["_storage"], batch_size=[rb.storage.max_size]).unflatten_keys(".")
        rb.extend(stored[:1])
    rb.load_state_dict(state)
    return True


def make_envs(args, num_envs: int, device, seed: int, raw: bool = False, **env_kwargs):
    """`num_envs` envs of `args.env_id`, as the off-policy scripts build them. `raw`: gymnasium envs without
    running normalization of observations and rewards, as CleanRL's TD3 and SAC (the torch envs never normalize)."""
    from leanrl.envs import make_env

    if raw and not args.env_id.startswith("torch/"):
        env_kwargs.update(normalize_obs=False, normalize_reward=False)
    return make_env(args.env_id, num_envs, device=device, seed=seed, **env_kwargs)


def main(algorithm, args, **env_kwargs):
    """A script's `main`: check `args` (before anything is built), build the envs (see `make_envs`, with
    `env_kwargs`), train with `algorithm.train`, which builds its evaluation envs with the same kwargs, close them."""
    from leanrl.envs import check_recordable

    algorithm.check_args(args)
    if args.capture_video:
        check_recordable(args.env_id)
    device = leanrl.resolve_device(args.device)
    envs = make_envs(args, args.num_envs, device, args.seed, **env_kwargs)
    make_eval_envs = functools.partial(make_envs, args, args.eval_episodes, device, args.seed + 10_000, **env_kwargs)
    try:
        return algorithm.train(args, envs, device, make_eval_envs)
    finally:
        envs.close()
