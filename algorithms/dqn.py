"""DQN (Mnih et al., 2015) with CleanRL's implementation details.

Read top to bottom: the arguments, the networks (an MLP, or the Nature CNN for Atari frame stacks), the policy
(epsilon-greedy, its schedule computed in-graph from a step counter it advances itself), the TD loss and its
gradient step as plain functions, `learn` (what an env step does for learning, one call: store the transition, and
every `train_frequency` steps sample a batch and update), then `train`: CleanRL's loop (the target copied every
`target_network_frequency` steps), after one block that decides how each phase runs.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, tensordict and leanrl.
`envs` is a `leanrl.VectorEnv` (leanrl/env.py). A transition stores the true next observation (the env's
`final_obs`) and `terminated` apart from `truncated`: the target cuts the bootstrap only on termination. For Atari
frame stacks the buffer keeps only the newest frame of the next observation (the rest of its stack is the
observation's last three frames): 3/8 of the memory saved, at no cost in exactness.
"""

import os
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module
from torch.func import functional_call

import leanrl
from leanrl.replay import burn_in, check_replay_args


@dataclass
class Args(leanrl.EvalArgs, leanrl.RunArgs):
    env_id: str = "CartPole-v1"
    """the id of the environment (discrete actions)"""
    num_envs: int = 1
    """the number of parallel environments"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    buffer_size: int = 10_000
    """the replay memory buffer size"""
    buffer_device: str | None = None
    """where the replay buffer lives (default: the learner's device); `cpu` keeps a large Atari buffer in host memory"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate (1: a hard copy)"""
    target_network_frequency: int = 500
    """the env steps it takes to update the target network"""
    batch_size: int = 128
    """the batch size of samples from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total_timesteps` it takes from start_e to go end_e"""
    learning_starts: int = 10_000
    """env steps before learning starts"""
    train_frequency: int = 10
    """the env steps between two updates"""
    clip_reward: bool = False
    """clip rewards to their sign before learning (Atari; scores are still logged raw)"""
    save_buffer: bool = False
    """include the replay buffer in checkpoints (all of its storage: about 35 GB for Atari at 1e6). Off by default,
    so that a checkpoint stays small and quick to write; a run resumed without it refills the buffer with the
    restored policy and updates again after learning_starts new steps"""
    eval_epsilon: float = 0.0
    """epsilon of the evaluation policy (0: greedy, deterministic; CleanRL's Atari evaluation uses 0.05)"""
    log_every: int = 1000
    """read metrics to the host every this many iterations (vector env steps)"""
    checkpoint_every: int = 50_000
    """save a checkpoint every this many iterations (0: only at exit)"""


def check_args(args: Args) -> int:
    """Fail on settings that cannot work, before anything is built; the number of iterations (vector env steps)."""
    num_iterations = check_replay_args(args)
    if args.train_frequency < 1 or args.target_network_frequency < 1:
        raise leanrl.UsageError(f"train_frequency = {args.train_frequency} and target_network_frequency = "
                                f"{args.target_network_frequency} must be at least 1")
    leanrl.check_flags(args, unit_interval=("start_e", "end_e", "exploration_fraction", "eval_epsilon"))
    return num_iterations


# ---------------------------------------------------------------------------------------------- networks
class QNetwork(nn.Module):
    """CleanRL's MLP (120, 84) for flat observations."""

    def __init__(self, obs_dim, num_actions, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, 120, device=device), nn.ReLU(),
            nn.Linear(120, 84, device=device), nn.ReLU(),
            nn.Linear(84, num_actions, device=device),
        )

    def forward(self, obs):
        return self.network(obs)


class AtariQNetwork(nn.Module):
    """The Nature CNN on uint8 frame stacks (N, 4, 84, 84)."""

    def __init__(self, num_actions, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4, device=device), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2, device=device), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1, device=device), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512, device=device), nn.ReLU(),
            nn.Linear(512, num_actions, device=device),
        )

    def forward(self, obs):
        # to float in the convolutions' channels_last layout in one copy (see ppo.AtariAgent.trunk)
        return self.network(obs.to(torch.float32, memory_format=torch.channels_last, copy=True).div_(255.0))


def make_q_network(observation_space, action_space, device=None):
    if not hasattr(action_space, "n"):
        raise leanrl.UsageError(f"DQN needs a discrete action space; got {action_space} "
                                "(use TD3 or SAC for continuous actions)")
    shape = observation_space.shape
    if len(shape) == 3:
        if tuple(shape) != (4, 84, 84):
            raise leanrl.UsageError(f"DQN's CNN reads (4, 84, 84) frame stacks; got {shape}")
        return AtariQNetwork(int(action_space.n), device).to(memory_format=torch.channels_last)  # see ppo.make_agent
    if len(shape) != 1:
        raise leanrl.UsageError(f"DQN reads flat observations or (4, 84, 84) frame stacks; got shape {shape}")
    return QNetwork(shape[0], int(action_space.n), device)


# ---------------------------------------------------------------------------- acting and learning
def linear_schedule(start_e: float, end_e: float, duration: float, t):
    """Epsilon at step `t` (a tensor): from start_e to end_e over `duration` steps, then end_e."""
    frac = (t / duration).clamp(max=1.0) if duration > 0 else torch.ones_like(t, dtype=torch.float32)
    return start_e + (end_e - start_e) * frac


def policy(dqn, args: Args, obs):
    """Epsilon-greedy, epsilon read from the schedule at `dqn.step` (a device tensor holding the global step), which
    the policy advances itself: the schedule decays in-graph, with no host value to pass in."""
    epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, dqn.step)
    greedy = dqn.q_inference(obs).argmax(-1)
    random_actions = torch.randint_like(greedy, dqn.num_actions)
    explore = torch.rand(greedy.shape, device=greedy.device) < epsilon
    dqn.step.add_(obs.shape[0])
    return torch.where(explore, random_actions, greedy), epsilon


@torch.no_grad()
def evaluation_policy(dqn, eval_epsilon: float, obs):
    greedy = dqn.q_inference(obs).argmax(-1)
    if eval_epsilon == 0:
        return greedy
    explore = torch.rand(greedy.shape, device=greedy.device) < eval_epsilon
    return torch.where(explore, torch.randint_like(greedy, dqn.num_actions), greedy)


UPDATE_METRICS = ("losses/td_loss", "losses/q_values")


def td_loss(dqn, args: Args, q_params, data):
    """The TD error's mean square against the target network's max, and UPDATE_METRICS."""
    obs, next_obs, rewards = data["obs"], data["next_obs"], data["reward"]
    if dqn.frame_stack:  # the buffer holds the newest frame of next_obs; the rest of its stack is obs[:, 1:]
        next_obs = torch.cat([obs[:, 1:], next_obs], 1)
    if args.clip_reward:
        rewards = rewards.sign()
    with torch.no_grad():
        target_max = dqn.q_target(next_obs).max(-1).values
        td_target = rewards + args.gamma * target_max * (~data["terminated"]).float()
    old_val = functional_call(dqn.q_network, q_params, (obs,)).gather(-1, data["action"].unsqueeze(-1)).squeeze(-1)
    loss = F.mse_loss(old_val, td_target)
    return loss, torch.stack([loss.detach(), old_val.detach().mean()])


def gradient_step(dqn, args: Args, data):
    """td_loss's step: zero_grad, backward, step."""
    loss, metrics = td_loss(dqn, args, dqn.q_named, data)
    dqn.optimizer.zero_grad()
    loss.backward()
    dqn.optimizer.step()
    return metrics


def learn(dqn, replay, logger, update, device, obs, action, out, *, updates: int):
    """What an env step does for learning, in one call: store its transitions (next_obs: the true next observation,
    `final_obs`, of a frame stack only its newest frame), count the episodes that ended, and `updates` times (the
    train_frequency steps it passed, once learning has started) sample a batch (onto the learner's `device`) and
    update. Returns the last update's metrics."""
    next_obs = out["final_obs"][:, -1:] if dqn.frame_stack else out["final_obs"]
    replay.extend(dict(obs=obs, action=action, reward=out["reward"], next_obs=next_obs, terminated=out["terminated"]))
    logger.record_episodes(out["episode_return"], out["episode_length"])
    metrics = ()
    for _ in range(updates):
        metrics = (update({k: x.to(device, non_blocking=True) for k, x in replay.sample().items()}),)
    return metrics


# ------------------------------------------------------------------------------------------- training
class DQN:
    """The Q-network, its target, the optimizer and the global step the policy's schedule reads. `q_inference` is a
    weightless copy that reads the Q-network's weights: an alias without autograd history."""

    def __init__(self, obs_space, act_space, args: Args, device):
        self.q_network = make_q_network(obs_space, act_space, device)
        self.num_actions, self.frame_stack = int(act_space.n), len(obs_space.shape) == 3
        self.q_inference = make_q_network(obs_space, act_space, "meta")
        from_module(self.q_network).data.to_module(self.q_inference)
        self.q_inference.requires_grad_(False)  # to_module made its slots Parameters again
        self.q_target = make_q_network(obs_space, act_space, device).requires_grad_(False)
        self.online, self.target = from_module(self.q_network).data, from_module(self.q_target).data
        self.target.update_(self.online)
        self.q_named = dict(self.q_network.named_parameters())
        self.optimizer = leanrl.make_adam(list(self.q_named.values()), args.learning_rate,
                                          **leanrl.Acceleration.of(args, device).flags)
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # the global step, advanced by the policy

    def parts(self) -> dict:  # what a checkpoint keeps (leanrl.state_of), loaded in place (leanrl.load_in_place)
        return dict(q_network=self.q_network, q_target=self.q_target, optimizer=self.optimizer)


def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace:
    """Run DQN to `args.total_timesteps`, from a checkpoint when `args.resume` names one; arguments and result as
    `td3.train`'s."""
    num_iterations = check_args(args)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, ("learning_starts",))
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    dqn = DQN(obs_space, act_space, args, device)  # (an unsuitable env's error: before the run directory exists)
    leanrl.set_threads(args.threads, dqn.q_network)  # before the first compiled call
    run_dir = leanrl.make_run_dir(args, args.env_id)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    replay = leanrl.Replay.of_transitions(args, obs_space, act_space, args.buffer_device or device, envs.obs_dtype,
                                          (1, *obs_space.shape[1:]) if dqn.frame_stack else None)  # the newest frame
    global_step = iteration = fill_start = 0
    if resumed:
        leanrl.restore_rng(resumed)
        leanrl.load_in_place(dqn.parts(), resumed)
        dqn.step.fill_(resumed["global_step"])
        global_step, iteration = resumed["global_step"], resumed["iteration"]
        obs = leanrl.restore_envs(envs, resumed["envs"], resumed["obs"], seed=args.seed + global_step)
        fill_start = leanrl.restore_replay(replay, resumed)
    else:
        obs = envs.reset(seed=args.seed)
    # The SPS clock starts once both functions have been compiled and captured: WARMUP + 1 updates.
    logger = leanrl.Logger.from_args(
        args, run_dir, args.total_timesteps, checkpoint=ckpt_path, start_step=global_step, device=device,
        burn_in=burn_in(args, global_step, fill_start, leanrl.WARMUP + 1,
                        lambda a, b: leanrl.crossings(a, b, args.train_frequency)))

    # ---- how each phase runs: every decision of the execution mode, here and nowhere else ----
    accel = leanrl.Acceleration.of(args, device)
    act = accel.eager_on_cpu("DQN's policy", "one observation at a time, compiling costs more than it saves")(
        partial(policy, dqn, args), name="policy")
    if replay.device != device:  # a buffer in host memory (a large Atari one): the step's storing and sampling
        # stay eager, the update alone is accelerated
        update, fast = accel(partial(gradient_step, dqn, args), name="update"), leanrl.Acceleration()
    elif accel.cpu_compile:  # a CPU has no graphs: the learner's step one graph, its gradient step functions
        update, fast = leanrl.functional_step(partial(td_loss, dqn, args), dqn.q_named, dqn.optimizer), accel
    else:  # zero_grad, backward, step: compiled and CUDA-graphed as a whole on a GPU
        update, fast = partial(gradient_step, dqn, args), accel
    graph = dict(compile_kwargs=leanrl.ONE_GRAPH) if fast.cpu_compile else {}
    step = partial(learn, dqn, replay, logger, update, device)
    learners = {}  # by the number of updates an env step makes (num_envs and train_frequency decide which occur)

    def learner(updates: int):
        if updates not in learners:
            learners[updates] = fast(partial(step, updates=updates), name=f"learn_{updates}", **graph)
        return learners[updates]
    # ----

    def checkpoint_state():
        return dict(leanrl.state_of(dqn.parts()), envs=envs.state_dict(), obs=obs, global_step=global_step,
                    iteration=iteration, fill_start=fill_start,
                    replay_buffer=replay.state_dict() if args.save_buffer else None)

    eval_envs = leanrl.open_eval_envs(args, make_eval_envs, run_dir)
    evaluate = partial(leanrl.evaluate, partial(evaluation_policy, dqn, args.eval_epsilon), eval_envs,
                       args.seed + 10_000)  # from the same start states every time
    update_out = None  # the last update's outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            action, epsilon = act(obs)  # epsilon from the schedule, in-graph (no autograd: a grad-free alias)
            out = envs.step(action)
            iteration, before, global_step = iteration + 1, global_step, global_step + args.num_envs
            learning = global_step - fill_start > args.learning_starts
            outputs = learner(leanrl.crossings(before, global_step, args.train_frequency) if learning else 0)(
                obs, action, out)
            update_out = outputs[0] if outputs else update_out
            if learning and leanrl.crossings(before, global_step, args.target_network_frequency):
                dqn.target.lerp_(dqn.online, args.tau)  # one lerp_ in place (tau = 1: an exact copy)
            obs = out["next_obs"]

            if args.eval_every and leanrl.crossings(before, global_step, args.eval_every) and \
                    iteration < num_iterations:
                logger.record({"charts/eval_return": evaluate()})
            logger.end_iteration(global_step)
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.record({"charts/epsilon": epsilon})
                if update_out is not None:
                    logger.record(dict(zip(UPDATE_METRICS, update_out.unbind())))
                logger.flush()  # the one device-to-host read of a log boundary
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
            if on_iteration is not None and on_iteration(iteration, global_step):
                break  # the caller ends the run here
        if eval_envs:  # the trained policy, also when a finished run is resumed only to evaluate or film it
            logger.record({"charts/eval_return": evaluate()})
            logger.flush()
            eval_envs.close()
        leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
    return SimpleNamespace(learner=dqn, replay=replay, global_step=global_step, iteration=iteration,
                           fill_start=fill_start, logged=logger.last, run_dir=run_dir)
