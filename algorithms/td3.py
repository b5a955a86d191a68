"""TD3 (Fujimoto et al., 2018) with CleanRL's implementation details.

Read top to bottom: the arguments, the networks, the losses and their gradient steps as plain functions, `learn`
(what an env step does for learning, one call: store the transition, sample a batch, the critic's step, the delayed
actor's and targets'), then `train`: CleanRL's loop, after one block that decides how each phase runs.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, tensordict and leanrl.
`envs` is a `leanrl.VectorEnv` (leanrl/env.py). A transition stores the true next observation (the env's
`final_obs`, which differs from `next_obs` only where an episode ended) and `terminated` apart from `truncated`:
the target cuts the bootstrap only on termination, so a time limit bootstraps.
"""

import os
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import TensorDict, from_module, from_modules
from torch.func import functional_call

import leanrl
from leanrl.critics import check_box_spaces, q_value, twin_q
from leanrl.replay import burn_in, check_replay_args


@dataclass
class Args(leanrl.EvalArgs, leanrl.RunArgs):
    env_id: str = "HalfCheetah-v5"
    """the id of the environment (continuous actions)"""
    num_envs: int = 1
    """the number of parallel environments (one update per vector step, as CleanRL)"""
    learning_rate: float = 3e-4
    """the learning rate of both optimizers"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise (times the action scale)"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise (times the action scale)"""
    learning_starts: int = 25_000
    """env steps of uniformly random actions before learning starts"""
    policy_frequency: int = 2
    """delay of the actor and target updates, in critic updates"""
    noise_clip: float = 0.5
    """noise clip parameter of the target policy smoothing"""
    hidden_dim: int = 256
    """width of the two hidden layers of the actor and of each critic"""
    save_buffer: bool = False
    """include the replay buffer in checkpoints (all of its storage: about 160 MB for HalfCheetah at 1e6). Off by
    default, so that a checkpoint stays small and quick to write; a run resumed without it refills the buffer with
    the restored policy and updates again after learning_starts new steps"""
    log_every: int = 1000
    """read metrics to the host every this many iterations (vector env steps)"""
    checkpoint_every: int = 50_000
    """save a checkpoint every this many iterations (0: only at exit)"""


def check_args(args: Args) -> int:
    """Fail on settings that cannot work, before any environment is built or anything compiled. Returns the number
    of iterations (vector env steps)."""
    num_iterations = check_replay_args(args)
    if args.policy_frequency < 1:
        raise leanrl.UsageError(f"policy_frequency = {args.policy_frequency} must be at least 1")
    return num_iterations


# ---------------------------------------------------------------------------------------------- networks
class QNetwork(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden_dim=256, device=None):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + action_dim, hidden_dim, device=device)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim, device=device)
        self.fc3 = nn.Linear(hidden_dim, 1, device=device)

    def forward(self, obs, action):
        x = torch.cat([obs, action], -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(-1)


class Actor(nn.Module):
    """Deterministic policy: tanh, rescaled to the action bounds."""

    def __init__(self, obs_dim, action_space, hidden_dim=256, device=None):
        super().__init__()
        action_dim = action_space.shape[0]
        self.fc1 = nn.Linear(obs_dim, hidden_dim, device=device)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim, device=device)
        self.fc_mu = nn.Linear(hidden_dim, action_dim, device=device)
        low, high = torch.as_tensor(action_space.low), torch.as_tensor(action_space.high)
        self.register_buffer("action_scale", ((high - low) / 2).float().to(device))
        self.register_buffer("action_bias", ((high + low) / 2).float().to(device))

    def forward(self, obs):
        x = F.relu(self.fc2(F.relu(self.fc1(obs))))
        return self.fc_mu(x).tanh() * self.action_scale + self.action_bias


class TD3:
    """The actor, the twin critic (both networks' weights stacked in one TensorDict), their targets (one TensorDict,
    moved by one foreach lerp) and the optimizers. `*_inference` and `actor_target` are weightless copies that read
    them: aliases without autograd history."""

    def __init__(self, obs_space, act_space, args: Args, device):
        obs_dim, action_dim, H = obs_space.shape[0], act_space.shape[0], args.hidden_dim
        self.low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        self.high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)
        self.actor = Actor(obs_dim, act_space, H, device)
        self.actor_inference = Actor(obs_dim, act_space, H, "meta")
        from_module(self.actor).data.to_module(self.actor_inference)
        self.actor_inference.requires_grad_(False)  # to_module made its slots Parameters again
        self.q_params = from_modules(*(QNetwork(obs_dim, action_dim, H, device) for _ in range(2)), as_module=True)
        self.qnet = QNetwork(obs_dim, action_dim, H, "meta")
        self.online = TensorDict(actor=from_module(self.actor).data, q=self.q_params.data)
        self.targets = self.online.clone()
        self.actor_target = Actor(obs_dim, act_space, H, "meta")
        self.targets["actor"].to_module(self.actor_target)
        self.q_named, self.actor_named = dict(self.q_params.named_parameters()), dict(self.actor.named_parameters())
        # what the losses read, by name (the same storage): what a compiled graph reads fastest
        self.q_online, self.q_target = (dict(td.flatten_keys(".").items()) for td in (self.online["q"],
                                                                                       self.targets["q"]))
        self.target_tensors, self.online_tensors = (list(td.values(True, True)) for td in (self.targets, self.online))
        accel = leanrl.Acceleration.of(args, device)
        self.q_optimizer = leanrl.make_adam(list(self.q_named.values()), args.learning_rate, **accel.flags)
        self.actor_optimizer = leanrl.make_adam(list(self.actor_named.values()), args.learning_rate, **accel.flags)

    def parts(self) -> dict:  # what a checkpoint keeps (leanrl.state_of), loaded in place (leanrl.load_in_place)
        return dict(actor=self.actor, q_params=self.q_params.data, targets=self.targets, q_optimizer=self.q_optimizer,
                    actor_optimizer=self.actor_optimizer)


# ------------------------------------------------------------------------------ acting and learning
def explore(td3: TD3, exploration_noise: float, obs):
    """The behaviour policy: the actor's action with Gaussian noise (times the action scale), in the bounds."""
    action = td3.actor_inference(obs)
    noise = torch.randn_like(action) * td3.actor_inference.action_scale * exploration_noise
    return (action + noise).clamp(td3.low, td3.high)


def random_actions(td3: TD3, n: int):
    """Uniform in the action bounds (before learning starts), drawn with torch on the run's device."""
    return td3.low + (td3.high - td3.low) * torch.rand(n, td3.low.shape[0], device=td3.low.device)


CRITIC_METRICS = ("losses/qf_loss", "losses/qf1_loss", "losses/qf2_loss", "losses/qf1_values", "losses/qf2_values")
ACTOR_METRICS = ("losses/actor_loss",)


def critic_loss(td3: TD3, args: Args, looped: bool, q_params, data):
    """Clipped double-Q learning with target policy smoothing: the loss of both critics and CRITIC_METRICS.
    `looped`: as `leanrl.critics.twin_q`."""
    with torch.no_grad():
        noise = (torch.randn_like(data["action"]) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
        next_actions = (td3.actor_target(data["next_obs"]) + noise * td3.actor_target.action_scale).clamp(
            td3.low, td3.high)
        next_q = twin_q(td3.qnet, td3.q_target, data["next_obs"], next_actions, looped).min(0).values
        target = data["reward"] + args.gamma * (~data["terminated"]).float() * next_q
    q = twin_q(td3.qnet, q_params, data["obs"], data["action"], looped)  # (2, batch)
    qf_losses = ((q - target) ** 2).mean(-1)
    loss = qf_losses.sum()
    q = q.detach().mean(-1)
    return loss, torch.stack([loss.detach(), qf_losses[0].detach(), qf_losses[1].detach(), q[0], q[1]])


def actor_loss(td3: TD3, actor_params, data):
    """The actor climbs the first critic: its loss and ACTOR_METRICS."""
    actions = functional_call(td3.actor, actor_params, (data["obs"],))
    loss = -q_value(td3.qnet, {name: p[0] for name, p in td3.q_online.items()}, data["obs"], actions).mean()
    return loss, loss.detach()[None]


def gradient_step(loss_fn, params: dict, optimizer, data):
    """`loss_fn(params, data)`'s step: zero_grad, backward, step."""
    loss, metrics = loss_fn(params, data)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def learn(td3: TD3, replay, logger, steps, tau: float, obs, action, out, *, update: bool, delayed: bool):
    """What an env step does for learning, in one call: store its transitions (next_obs: the true next observation,
    `final_obs`), count the episodes that ended, and, once learning has started (`update`), sample a batch for the
    critic's step; every policy_frequency steps (`delayed`) also the actor's, and the targets move (one lerp in place:
    target <- (1 - tau) target + tau online). `steps`: the critic's and the actor's gradient steps. Returns their
    metrics."""
    replay.extend(dict(obs=obs, action=action, reward=out["reward"], next_obs=out["final_obs"],
                       terminated=out["terminated"]))
    logger.record_episodes(out["episode_return"], out["episode_length"])
    if not update:
        return ()
    critic_step, actor_step = steps
    data = replay.sample()
    critic = critic_step(data)
    if not delayed:
        return (critic,)
    actor = actor_step(data)
    torch._foreach_lerp_(td3.target_tensors, td3.online_tensors, tau)
    return critic, actor


# ------------------------------------------------------------------------------------------- training
def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace:
    """Run TD3 to `args.total_timesteps`, from a checkpoint when `args.resume` names one. `make_eval_envs(
    video_folder=...)` builds the `args.eval_episodes` envs that evaluations run in (`video_folder`: where the first
    one records its episodes, with --capture-video; else None). `on_iteration(iteration, global_step)`, when given,
    is called after every iteration, and a true return ends the run there (benchmarks time the loop with it).
    Returns the learner, its replay buffer, the counters and the last logged values."""
    num_iterations = check_args(args)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    check_box_spaces("TD3", obs_space, act_space)
    # No schedule depends on the horizon: a resumed run may go on longer.
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, ("learning_starts", "total_timesteps"))
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    run_dir = leanrl.make_run_dir(args, args.env_id)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    td3 = TD3(obs_space, act_space, args, device)
    leanrl.set_threads(args.threads, td3.actor, td3.q_params)  # before the first compiled call
    replay = leanrl.Replay.of_transitions(args, obs_space, act_space, device)
    global_step = iteration = fill_start = 0
    if resumed:
        leanrl.restore_rng(resumed)
        leanrl.load_in_place(td3.parts(), resumed)
        global_step, iteration = resumed["global_step"], resumed["iteration"]
        obs = leanrl.restore_envs(envs, resumed["envs"], resumed["obs"], seed=args.seed + global_step)
        fill_start = leanrl.restore_replay(replay, resumed)
    else:
        obs = envs.reset(seed=args.seed)
    # The SPS clock starts once every function has been compiled and captured: the actor's WARMUP + 1 calls.
    logger = leanrl.Logger.from_args(args, run_dir, args.total_timesteps, start_step=global_step, checkpoint=ckpt_path,
                                     device=device, burn_in=burn_in(args, global_step, fill_start,
                                                                    (leanrl.WARMUP + 1) * args.policy_frequency + 1))

    # ---- how each phase runs: every decision of the execution mode, here and nowhere else ----
    accel = leanrl.Acceleration.of(args, device)
    policy = accel.eager_on_cpu("TD3's policy", "one observation at a time, compiling costs more than it saves")(
        partial(explore, td3, args.exploration_noise), name="policy")
    losses = [(partial(critic_loss, td3, args, accel.cpu_compile), td3.q_named, td3.q_optimizer),  # (twin_q's looped)
              (partial(actor_loss, td3), td3.actor_named, td3.actor_optimizer)]
    if accel.cpu_compile:  # a CPU has no graphs: the learner's step one compiled graph, its gradient steps functions
        steps, graph = [leanrl.functional_step(*loss) for loss in losses], dict(compile_kwargs=leanrl.ONE_GRAPH)
    else:  # zero_grad, backward, step: compiled and CUDA-graphed as a whole on a GPU
        steps, graph = [partial(gradient_step, loss, params, optimizer) for loss, params, optimizer in losses], {}
    step = partial(learn, td3, replay, logger, steps, args.tau)
    variants = (("fill", False, False), ("learn_critic", True, False), ("learn", True, True))
    fill, learn_critic, learn_all = (accel(partial(step, update=update, delayed=delayed), name=name, **graph)
                                     for name, update, delayed in variants)
    # ----

    def checkpoint_state():
        return dict(leanrl.state_of(td3.parts()), envs=envs.state_dict(), obs=obs, global_step=global_step,
                    iteration=iteration, fill_start=fill_start,
                    replay_buffer=replay.state_dict() if args.save_buffer else None)

    eval_envs = leanrl.open_eval_envs(args, make_eval_envs, run_dir)
    evaluate = partial(leanrl.evaluate, td3.actor_inference, eval_envs, args.seed + 10_000)  # same start states
    critic_out = actor_out = None  # the last update outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            # (no autograd: the policy reads a grad-free alias)
            action = random_actions(td3, args.num_envs) if global_step < args.learning_starts else policy(obs)
            out = envs.step(action)
            iteration, before, global_step = iteration + 1, global_step, global_step + args.num_envs
            if global_step - fill_start <= args.learning_starts:
                fill(obs, action, out)
            elif iteration % args.policy_frequency:
                (critic_out,) = learn_critic(obs, action, out)
            else:  # the delay: actor and targets move less often
                critic_out, actor_out = learn_all(obs, action, out)
            obs = out["next_obs"]

            if args.eval_every and leanrl.crossings(before, global_step, args.eval_every) and \
                    iteration < num_iterations:
                logger.record({"charts/eval_return": evaluate()})
            logger.end_iteration(global_step)
            if iteration % args.log_every == 0 or iteration == num_iterations:
                for names, values in ((CRITIC_METRICS, critic_out), (ACTOR_METRICS, actor_out)):
                    if values is not None:
                        logger.record(dict(zip(names, values.unbind())))
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
    return SimpleNamespace(learner=td3, replay=replay, global_step=global_step, iteration=iteration,
                           fill_start=fill_start, logged=logger.last, run_dir=run_dir)
