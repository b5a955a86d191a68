"""DQN (Mnih et al., 2015) with CleanRL's implementation details.

Read top to bottom: arguments, networks (an MLP, or the Nature CNN for Atari frame stacks), the epsilon schedule,
the two functions `leanrl.accelerate` compiles and CUDA-graphs (`policy`: epsilon-greedy with the schedule computed
in-graph from a step counter it advances itself; `update`: the TD loss's gradient step), the learner that builds
them once, and `train`: CleanRL's loop (an update every `train_frequency` steps, the target copy every
`target_network_frequency`). The file imports only leanrl, torch and tensordict. From leanrl it uses its tools
(`accelerate`, `make_adam`, `Logger`, checkpoints, `evaluate`) and `leanrl.offpolicy` (argument checks, torchrl's
replay buffer and its checkpoint). Environments are passed in: a vector env whose step returns a TensorDict
(`leanrl.envs`), or a gymnasium vector env through `leanrl.TorchVectorEnv`.

Bootstrapping: a transition stores the true next observation (the env's `final_obs`) and `terminated` apart
from `truncated`; the target cuts the bootstrap only on termination, so a time limit bootstraps. For Atari
frame stacks the buffer keeps only the newest frame of the next observation (the rest of its stack is the
observation's last three frames), which saves 3/8 of the memory at no cost in exactness.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module
from torch.func import functional_call

import leanrl
from leanrl.offpolicy import (burn_in, check_envs, check_replay_args, make_replay_buffer, open_eval_envs, start,
                              store)


@dataclass
class Args(leanrl.RunArgs):
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
    eval_every: int = 0
    """run an evaluation (charts/eval_return) every this many env steps, and at the end (0: never)"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the evaluation env)"""
    capture_video: bool = False
    """record the evaluation episodes of the first evaluation env to `<run dir>/videos` (evaluates at the end
    even without --eval-every; resuming a finished run with it records the trained agent)"""
    eval_epsilon: float = 0.0
    """epsilon of the evaluation policy (0: greedy, deterministic; CleanRL's Atari evaluation uses 0.05)"""
    log_every: int = 1000
    """read metrics to the host every this many iterations (vector env steps)"""
    checkpoint_every: int = 50_000
    """save a checkpoint every this many iterations (0: only at exit)"""


def check_args(args: Args) -> int:
    """Fail on settings that cannot work, before any environment is built or anything compiled.
    Returns the number of iterations (vector env steps)."""
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


# ----------------------------------------------------------------------------------- the two functions
def linear_schedule(start_e: float, end_e: float, duration: float, t):
    """Epsilon at step `t` (a tensor): from start_e to end_e over `duration` steps, then end_e."""
    frac = (t / duration).clamp(max=1.0) if duration > 0 else torch.ones_like(t, dtype=torch.float32)
    return start_e + (end_e - start_e) * frac


def make_policy(q_inference, step, num_actions: int, start_e: float, end_e: float, duration: float):
    """Epsilon-greedy with epsilon read from the schedule at `step` (a device tensor holding the global step),
    which the policy advances itself: the schedule decays in-graph, with no host value to pass in."""

    def policy(obs):
        epsilon = linear_schedule(start_e, end_e, duration, step)
        greedy = q_inference(obs).argmax(-1)
        random_actions = torch.randint_like(greedy, num_actions)
        explore = torch.rand(greedy.shape, device=greedy.device) < epsilon
        step.add_(obs.shape[0])
        return torch.where(explore, random_actions, greedy), epsilon

    return policy


UPDATE_METRICS = ("losses/td_loss", "losses/q_values")


def make_td_loss(q_network, q_target, args: Args, frame_stack: bool):
    """`td_loss(q_params, obs, actions, rewards, next_obs, terminated) -> (loss, UPDATE_METRICS)`."""

    def td_loss(q_params, obs, actions, rewards, next_obs, terminated):
        if frame_stack:  # the buffer holds the newest frame of next_obs; the rest of its stack is obs[:, 1:]
            next_obs = torch.cat([obs[:, 1:], next_obs], 1)
        if args.clip_reward:
            rewards = rewards.sign()
        with torch.no_grad():
            target_max = q_target(next_obs).max(-1).values
            td_target = rewards + args.gamma * target_max * (~terminated).float()
        old_val = functional_call(q_network, q_params, (obs,)).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(old_val, td_target)
        return loss, torch.stack([loss.detach(), old_val.detach().mean()])

    return td_loss


# ------------------------------------------------------------------------------------------- training
class DQN:
    """Q-network, target network, optimizer, step counter and the accelerated functions, built once."""

    def __init__(self, args: Args, envs, device):
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        self.q_network = make_q_network(obs_space, act_space, device)
        self.num_actions, self.frame_stack = int(act_space.n), len(obs_space.shape) == 3
        self.eval_epsilon = args.eval_epsilon
        # The acting copy shares the learner's storage without its autograd history (a grad-free alias).
        self.q_inference = make_q_network(obs_space, act_space, "meta")
        from_module(self.q_network).data.to_module(self.q_inference)
        self.q_target = make_q_network(obs_space, act_space, device).requires_grad_(False)
        self.online, self.target = from_module(self.q_network).data, from_module(self.q_target).data
        self.target.update_(self.online)
        wrap = leanrl.wrap_flags(args, device)
        # On a CPU, --compile makes the MLP's gradient step ONE compiled graph (`leanrl.gradient_step`; at batch 128
        # 0.62 ms against 0.98 eager, cpu-2core-intel-xeon). The policy, one observation at a time, and the Atari
        # CNN's step (21 ms eager, 28.5 as one graph at batch 32) stay eager there.
        kept_eager = "DQN's policy and its CNN's update" if self.frame_stack else "DQN's policy"
        eager_on_cpu = leanrl.wrap_flags(args, device, eager_on_cpu=f"{kept_eager}: compiled, slower than eager on a "
                                         "2-core CPU")
        update_wrap = eager_on_cpu if self.frame_stack else wrap
        one_graph = leanrl.compiling_on_cpu(update_wrap) and not self.frame_stack
        q_named = dict(self.q_network.named_parameters())
        self.optimizer = leanrl.make_adam(list(q_named.values()), args.learning_rate, **update_wrap)

        self.step = torch.zeros((), dtype=torch.int64, device=device)  # the global step, advanced by the policy
        self.policy = leanrl.accelerate(
            make_policy(self.q_inference, self.step, self.num_actions, args.start_e, args.end_e,
                        args.exploration_fraction * args.total_timesteps), name="policy", **eager_on_cpu)
        update = leanrl.gradient_step(make_td_loss(self.q_network, self.q_target, args, self.frame_stack), q_named,
                                      self.optimizer, one_graph=one_graph, name="update")
        update_wrap["compile"] &= not one_graph  # one graph per step is compiled already
        self.update = leanrl.accelerate(update, name="update", **update_wrap)

    @torch.no_grad()
    def eval_policy(self, obs):
        greedy = self.q_inference(obs).argmax(-1)
        if self.eval_epsilon == 0:
            return greedy
        explore = torch.rand(greedy.shape, device=greedy.device) < self.eval_epsilon
        return torch.where(explore, torch.randint_like(greedy, self.num_actions), greedy)

    def benchmark_calls(self, args: Args, obs_shape, device) -> dict:
        """The accelerated functions with inputs of this run's shapes, for per-call timing (benchmarks). Calling
        the policy advances its step counter (and so epsilon), as acting would."""
        B = args.batch_size

        def observations(n):
            if self.frame_stack:
                return torch.randint(0, 256, (n, *obs_shape), dtype=torch.uint8, device=device)
            return torch.randn(n, *obs_shape, device=device)

        obs, next_obs = observations(B), observations(B)
        if self.frame_stack:
            next_obs = next_obs[:, -1:].contiguous()
        actions = torch.randint(0, self.num_actions, (B,), device=device)
        rewards, terminated = torch.randn(B, device=device), torch.zeros(B, dtype=torch.bool, device=device)
        return {"policy": (self.policy, (observations(args.num_envs),)),
                "update": (self.update, (obs, actions, rewards, next_obs, terminated))}

    def state_dict(self):
        return dict(q_network=self.q_network.state_dict(), q_target=self.q_target.state_dict(),
                    optimizer=self.optimizer.state_dict())

    def load_state_dict(self, state):
        # In place, so every address a captured graph holds stays valid.
        self.q_network.load_state_dict(state["q_network"])
        self.q_target.load_state_dict(state["q_target"])
        leanrl.load_optimizer_state(self.optimizer, state["optimizer"])
        self.step.fill_(state["global_step"])


def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None):
    """Run DQN to `args.total_timesteps`, from a checkpoint when `args.resume` names one. Returns the
    `leanrl.offpolicy.Run` (learner, buffer, counters). `make_eval_envs(video_folder=...)` builds the
    `args.eval_episodes` envs that evaluations run in (`video_folder`: where the first one records its episodes, with
    --capture-video; else None). `on_iteration(iteration, global_step)`, when given, is called after every iteration
    (the benchmarks time the loop with it)."""
    num_iterations = check_args(args)
    check_envs("DQN", args, envs, make_eval_envs)
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    dqn = DQN(args, envs, device)
    leanrl.set_threads(args.threads, dqn.q_network)  # before the first compiled call
    rb = make_replay_buffer(args.buffer_size, args.batch_size, args.buffer_device or device)
    run, ckpt_path = start(dqn, rb, args, envs)
    eval_envs = open_eval_envs(args, make_eval_envs, os.path.dirname(ckpt_path))

    def evaluate():  # from the same start states every time
        return leanrl.evaluate(dqn.eval_policy, eval_envs, args.seed + 10_000)

    # The SPS clock starts once both functions have been compiled and captured: WARMUP + 1 updates.
    logger = leanrl.Logger.from_args(
        args, os.path.dirname(ckpt_path), args.total_timesteps, checkpoint=ckpt_path, start_step=run.global_step,
        burn_in=burn_in(args, run, leanrl.WARMUP + 1, lambda a, b: leanrl.crossings(a, b, args.train_frequency)))
    update_out = None  # the last update's outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, lambda: run.state_dict(envs, args.save_buffer), args):
        for iteration in range(run.iteration + 1, num_iterations + 1):
            with torch.no_grad():
                action, epsilon = dqn.policy(run.obs)  # epsilon from the schedule, in-graph
            out = envs.step(action)
            # final_obs: bootstrap through a time limit; of a frame stack, only its newest frame is new
            store(run.rb, run.obs, action, out, out["final_obs"][:, -1:] if dqn.frame_stack else out["final_obs"])
            run.obs = out["next_obs"]
            before, run.global_step, run.iteration = run.global_step, run.global_step + args.num_envs, iteration

            if run.global_step - run.fill_start > args.learning_starts:
                for _ in range(leanrl.crossings(before, run.global_step, args.train_frequency)):
                    run.updates += 1
                    data = run.rb.sample().to(device)
                    update_out = dqn.update(data["obs"], data["action"], data["reward"], data["next_obs"],
                                            data["terminated"])
                if leanrl.crossings(before, run.global_step, args.target_network_frequency):
                    dqn.target.lerp_(dqn.online, args.tau)  # one lerp_ in place (tau = 1: an exact copy)

            if (args.eval_every and leanrl.crossings(before, run.global_step, args.eval_every)
                    and iteration < num_iterations):
                logger.record({"charts/eval_return": evaluate()})
            logger.record_episodes(out["episode_return"], out["episode_length"])
            logger.end_iteration(run.global_step)
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.record({"charts/epsilon": epsilon})
                if update_out is not None:
                    logger.record(dict(zip(UPDATE_METRICS, update_out.unbind())))
                logger.flush()  # the one device-to-host read of a log boundary
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(ckpt_path, run.state_dict(envs, args.save_buffer), args)
            if on_iteration is not None:
                on_iteration(iteration, run.global_step)
        if eval_envs is not None:  # the trained policy, also when a finished run is resumed only to evaluate or film it
            logger.record({"charts/eval_return": evaluate()})
            logger.flush()
            eval_envs.close()
        leanrl.save_checkpoint(ckpt_path, run.state_dict(envs, args.save_buffer), args)
        run.logged = logger.last
    return run
