"""DQN (Mnih et al., 2015) with CleanRL's implementation details.

Read top to bottom: arguments, networks (an MLP, or the Nature CNN for Atari frame stacks), the epsilon
schedule, the two functions `leanrl.accelerate` compiles and CUDA-graphs (`policy`: epsilon-greedy with the
schedule computed in-graph from a step counter it advances itself; `update`), then the training loop.
Depends only on leanrl, torch and tensordict (torchrl's replay buffer through `leanrl.offpolicy`);
environments are passed in (see `envs/`).

Bootstrapping: a transition stores the true next observation (the env's `final_obs`) and `terminated` apart
from `truncated`; the target cuts the bootstrap only on termination, so a time limit bootstraps. For Atari
frame stacks the buffer keeps only the newest frame of the next observation (the rest of its stack is the
observation's last three frames), which saves 3/8 of the memory at no cost in exactness.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module

import leanrl
from leanrl.offpolicy import (check_envs, check_replay_args, crossings, load_loop_state, log_step, loop_state,
                              make_replay_buffer, store)


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
    """run an evaluation (charts/eval_return) every this many env steps (0: never)"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the evaluation env)"""
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
        raise ValueError(f"train_frequency = {args.train_frequency} and target_network_frequency = "
                         f"{args.target_network_frequency} must be at least 1")
    for name in ("start_e", "end_e", "exploration_fraction", "eval_epsilon"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"{name} = {getattr(args, name)} must be in [0, 1]")
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
        return self.network(obs / 255.0)


def make_q_network(observation_space, action_space, device=None):
    if not hasattr(action_space, "n"):
        raise ValueError(f"DQN needs a discrete action space; got {action_space} "
                         "(use TD3 or SAC for continuous actions)")
    shape = observation_space.shape
    if len(shape) == 3:
        if tuple(shape) != (4, 84, 84):
            raise ValueError(f"DQN's CNN reads (4, 84, 84) frame stacks; got {shape}")
        return AtariQNetwork(int(action_space.n), device).to(memory_format=torch.channels_last)  # see ppo.make_agent
    if len(shape) != 1:
        raise ValueError(f"DQN reads flat observations or (4, 84, 84) frame stacks; got shape {shape}")
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


def make_update(q_network, q_target, optimizer, args: Args, frame_stack: bool):
    def update(obs, actions, rewards, next_obs, terminated):
        if frame_stack:  # the buffer holds the newest frame of next_obs; the rest of its stack is obs[:, 1:]
            next_obs = torch.cat([obs[:, 1:], next_obs], 1)
        if args.clip_reward:
            rewards = rewards.sign()
        with torch.no_grad():
            target_max = q_target(next_obs).max(-1).values
            td_target = rewards + args.gamma * target_max * (~terminated).float()
        old_val = q_network(obs).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(old_val, td_target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return torch.stack([loss.detach(), old_val.detach().mean()])

    return update


# ------------------------------------------------------------------------------------------- training
class DQN:
    """Q-network, target network, optimizer, replay buffer, step counter and the accelerated functions."""

    def __init__(self, args: Args, envs, device, eval_envs=None):
        self.args, self.envs, self.eval_envs, self.device = args, envs, eval_envs, torch.device(device)
        self.num_iterations = check_args(args)
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        self.q_network = make_q_network(obs_space, act_space, device)
        check_envs("DQN", args, envs, eval_envs)
        self.num_actions, self.frame_stack = int(act_space.n), len(obs_space.shape) == 3
        # The acting copy shares the learner's storage without its autograd history (a grad-free alias).
        self.q_inference = make_q_network(obs_space, act_space, "meta")
        from_module(self.q_network).data.to_module(self.q_inference)
        self.q_target = make_q_network(obs_space, act_space, device).requires_grad_(False)
        self.online, self.target = from_module(self.q_network).data, from_module(self.q_target).data
        self.target.update_(self.online)
        wrap = dict(compile=args.compile, cudagraphs=args.cudagraphs, device=device)  # make_adam and accelerate
        self.optimizer = leanrl.make_adam(list(self.q_network.parameters()), args.learning_rate, **wrap)

        self.step = torch.zeros((), dtype=torch.int64, device=device)  # the global step, advanced by the policy
        self.policy = leanrl.accelerate(
            make_policy(self.q_inference, self.step, self.num_actions, args.start_e, args.end_e,
                        args.exploration_fraction * args.total_timesteps), name="policy", **wrap)
        self.update = leanrl.accelerate(make_update(self.q_network, self.q_target, self.optimizer, args,
                                                    self.frame_stack), name="update", **wrap)

        self.rb = make_replay_buffer(args.buffer_size, args.batch_size, args.buffer_device or device)
        self.obs = None
        self.update_out = self.epsilon = None  # the last outputs, read at log boundaries
        self.logged = {}  # the last values written to the log (set by leanrl.run)
        self.global_step = self.iteration = 0
        self.updates = 0  # updates by this process (compile and capture happen in the first few)
        self.fill_start = 0  # global step at which the buffer started filling (moves when resumed without it)

    @torch.no_grad()
    def eval_policy(self, obs):
        greedy = self.q_inference(obs).argmax(-1)
        if self.args.eval_epsilon == 0:
            return greedy
        explore = torch.rand(greedy.shape, device=greedy.device) < self.args.eval_epsilon
        return torch.where(explore, torch.randint_like(greedy, self.num_actions), greedy)

    def reset(self, seed):
        self.obs = self.envs.reset(seed=seed)

    def train_iteration(self, logger):
        args, n = self.args, self.args.num_envs
        with torch.no_grad():
            action, self.epsilon = self.policy(self.obs)
        out = self.envs.step(action)
        next_obs = out["final_obs"][:, -1:] if self.frame_stack else out["final_obs"]
        store(self.rb, self.obs, action, out, next_obs)
        self.obs = out["next_obs"]
        before, self.global_step = self.global_step, self.global_step + n
        self.iteration += 1
        if self.global_step - self.fill_start > args.learning_starts:
            for _ in range(crossings(before, self.global_step, args.train_frequency)):
                self.updates += 1
                data = self.rb.sample().to(self.device)
                self.update_out = self.update(data["obs"], data["action"], data["reward"], data["next_obs"],
                                              data["terminated"])
                if self.updates == 3:
                    # Both functions have now been compiled and captured (CUDA graphs capture within the first
                    # calls): restart the logger's SPS clock at the end of this iteration, so compile time does not
                    # dilute SPS.
                    logger.burn_in = logger.iterations + 1
            if crossings(before, self.global_step, args.target_network_frequency):
                self.target.lerp_(self.online, args.tau)  # one lerp_ in place (tau = 1: an exact copy)
        log_step(self, logger, out, before, (("charts/epsilon",), self.epsilon.reshape(1)),
                 (UPDATE_METRICS, self.update_out))

    def benchmark_calls(self):
        """The accelerated functions with inputs of this run's shapes, for `benchmarks/run.py`. Calling the policy
        advances its step counter (and so epsilon), as acting would."""
        B, device, shape = self.args.batch_size, self.device, self.envs.single_observation_space.shape

        def observations(n):
            if self.frame_stack:
                return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, device=device)
            return torch.randn(n, *shape, device=device)

        obs, next_obs = observations(B), observations(B)
        if self.frame_stack:
            next_obs = next_obs[:, -1:].contiguous()
        actions = torch.randint(0, self.num_actions, (B,), device=device)
        rewards, terminated = torch.randn(B, device=device), torch.zeros(B, dtype=torch.bool, device=device)
        return {"policy": (self.policy, (observations(self.args.num_envs),)),
                "update": (self.update, (obs, actions, rewards, next_obs, terminated))}

    def state_dict(self):
        return dict(q_network=self.q_network.state_dict(), q_target=self.q_target.state_dict(),
                    optimizer=self.optimizer.state_dict(), **loop_state(self))

    def load_state_dict(self, state):
        # In place, so every address a captured graph holds stays valid.
        self.q_network.load_state_dict(state["q_network"])
        self.q_target.load_state_dict(state["q_target"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_loop_state(self, state)
        self.step.fill_(self.global_step)


def train(args: Args, envs, device=None, eval_envs=None) -> DQN:
    """Run DQN to `args.total_timesteps` (logging, checkpoints, resume: see `leanrl.run`)."""
    device = device or leanrl.resolve_device(args.device)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    return leanrl.run(DQN(args, envs, device, eval_envs), args)
