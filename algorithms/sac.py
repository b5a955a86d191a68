"""SAC (Haarnoja et al., 2018) with automatic entropy tuning and CleanRL's implementation details.

Read top to bottom: the arguments, the networks, the tanh-Gaussian policy written out (no torch.distributions, so no
validation check or host sync hides in it), the losses and their gradient steps as plain functions, `learn` (what
an env step does for learning, one call: store the transition, sample a batch, the critic's step and the target's,
the delayed actor's and temperature's), then `train`: CleanRL's loop, after one block that decides how each phase
runs.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, tensordict and leanrl.
`envs` is a `leanrl.VectorEnv` (leanrl/env.py). A transition stores the true next observation (the env's
`final_obs`) and `terminated` apart from `truncated`: the target cuts the bootstrap only on termination.
"""

import math
import os
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module, from_modules
from torch.func import functional_call

import leanrl
from leanrl.critics import check_box_spaces, twin_q
from leanrl.replay import burn_in, check_replay_args


@dataclass
class Args(leanrl.EvalArgs, leanrl.RunArgs):
    env_id: str = "HalfCheetah-v5"
    """the id of the environment (continuous actions)"""
    num_envs: int = 1
    """the number of parallel environments (one critic update per vector step, as CleanRL)"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient (the target critic moves after every critic update)"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    learning_starts: int = 5_000
    """env steps of uniformly random actions before learning starts"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer (and of the temperature's)"""
    policy_frequency: int = 2
    """every this many critic updates, this many actor (and temperature) updates (delayed, as CleanRL)"""
    alpha: float = 0.2
    """entropy regularization coefficient (the initial one is 1 when autotune is on, as CleanRL's log_alpha = 0)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient, towards an entropy of -action_dim"""
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
    num_iterations = check_replay_args(args, learning_rates=("policy_lr", "q_lr"))
    if args.policy_frequency < 1:
        raise leanrl.UsageError(f"policy_frequency = {args.policy_frequency} must be at least 1")
    if not args.autotune and args.alpha < 0:
        raise leanrl.UsageError(f"alpha = {args.alpha} must be >= 0")
    return num_iterations


# ---------------------------------------------------------------------------------------------- networks
class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim, action_dim, hidden_dim=256, device=None):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + action_dim, hidden_dim, device=device)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim, device=device)
        self.fc3 = nn.Linear(hidden_dim, 1, device=device)

    def forward(self, obs, action):
        x = torch.cat([obs, action], -1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(-1)


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    """Gaussian policy head: mean and a log-std squashed into [LOG_STD_MIN, LOG_STD_MAX] (SpinUp / Yarats)."""

    def __init__(self, obs_dim, action_space, hidden_dim=256, device=None):
        super().__init__()
        action_dim = action_space.shape[0]
        self.fc1 = nn.Linear(obs_dim, hidden_dim, device=device)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim, device=device)
        self.fc_mean = nn.Linear(hidden_dim, action_dim, device=device)
        self.fc_logstd = nn.Linear(hidden_dim, action_dim, device=device)
        low, high = torch.as_tensor(action_space.low), torch.as_tensor(action_space.high)
        self.register_buffer("action_scale", ((high - low) / 2).float().to(device))
        self.register_buffer("action_bias", ((high + low) / 2).float().to(device))

    def forward(self, obs):
        x = F.relu(self.fc2(F.relu(self.fc1(obs))))
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return self.fc_mean(x), log_std


def sample_action(actor, obs, actor_params=None):
    """A reparameterized tanh-Gaussian action in the env's bounds and its log-probability (with the change of
    variables of tanh and of the rescaling, as CleanRL). `actor_params`: the weights to use, by name, when a
    gradient step passes them (else the actor's own)."""
    mean, log_std = actor(obs) if actor_params is None else functional_call(actor, actor_params, (obs,))
    eps = torch.randn_like(mean)
    x_t = mean + log_std.exp() * eps
    y_t = torch.tanh(x_t)
    action = y_t * actor.action_scale + actor.action_bias
    log_prob = -0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)  # Normal(mean, std).log_prob(x_t)
    log_prob = log_prob - torch.log(actor.action_scale * (1 - y_t.pow(2)) + 1e-6)
    return action, log_prob.sum(-1)


def deterministic_action(actor, obs):
    mean, _ = actor(obs)
    return torch.tanh(mean) * actor.action_scale + actor.action_bias


class SAC:
    """The actor, the twin critic (both networks' weights stacked in one TensorDict), its target, the temperature
    (learned with autotune, else a constant) and the optimizers. `actor_inference` is a weightless copy that reads
    the actor's weights: an alias without autograd history."""

    def __init__(self, obs_space, act_space, args: Args, device):
        obs_dim, action_dim, H = obs_space.shape[0], act_space.shape[0], args.hidden_dim
        self.low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        self.high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)
        self.actor = Actor(obs_dim, act_space, H, device)
        self.actor_inference = Actor(obs_dim, act_space, H, "meta")
        from_module(self.actor).data.to_module(self.actor_inference)
        self.actor_inference.requires_grad_(False)  # to_module made its slots Parameters again
        self.q_params = from_modules(*(SoftQNetwork(obs_dim, action_dim, H, device) for _ in range(2)),
                                     as_module=True)
        self.qnet = SoftQNetwork(obs_dim, action_dim, H, "meta")
        self.q_online = self.q_params.data  # the same storage, without autograd
        self.q_target = self.q_online.clone()
        # what the losses read, by name (the same storage): what a compiled graph reads fastest
        self.q_online_named, self.q_target_named = (dict(td.flatten_keys(".").items())
                                                    for td in (self.q_online, self.q_target))
        self.target_entropy = -float(action_dim)
        accel = leanrl.Acceleration.of(args, device)
        if args.autotune:
            self.log_alpha = torch.zeros((), device=device, requires_grad=True)
            self.alpha_optimizer = leanrl.make_adam([self.log_alpha], args.q_lr, **accel.flags)
        else:
            self.log_alpha = torch.tensor(math.log(args.alpha) if args.alpha > 0 else -math.inf, device=device)
            self.alpha_optimizer = None
        self.q_named, self.actor_named = dict(self.q_params.named_parameters()), dict(self.actor.named_parameters())
        self.q_optimizer = leanrl.make_adam(list(self.q_named.values()), args.q_lr, **accel.flags)
        self.actor_optimizer = leanrl.make_adam(list(self.actor_named.values()), args.policy_lr, **accel.flags)

    def parts(self) -> dict:  # what a checkpoint keeps (leanrl.state_of), loaded in place (leanrl.load_in_place)
        return dict(actor=self.actor, q_params=self.q_online, q_target=self.q_target, log_alpha=self.log_alpha,
                    q_optimizer=self.q_optimizer, actor_optimizer=self.actor_optimizer,
                    alpha_optimizer=self.alpha_optimizer)


# ------------------------------------------------------------------------------ acting and learning
def random_actions(sac: SAC, n: int):
    """Uniform in the action bounds (before learning starts), drawn with torch on the run's device."""
    return sac.low + (sac.high - sac.low) * torch.rand(n, sac.low.shape[0], device=sac.low.device)


CRITIC_METRICS = ("losses/qf_loss", "losses/qf1_loss", "losses/qf2_loss", "losses/qf1_values", "losses/qf2_values")
ACTOR_METRICS = ("losses/actor_loss", "losses/alpha_loss", "losses/alpha")


def critic_loss(sac: SAC, gamma: float, looped: bool, q_params, data):
    """The soft clipped double-Q target (the target critics at a fresh next action, minus the entropy term alpha *
    log pi): the loss of both critics and CRITIC_METRICS. `looped`: as `leanrl.critics.twin_q`."""
    alpha = sac.log_alpha.detach().exp()
    with torch.no_grad():
        next_actions, next_log_pi = sample_action(sac.actor, data["next_obs"])
        next_q = twin_q(sac.qnet, sac.q_target_named, data["next_obs"], next_actions, looped).min(0).values
        target = data["reward"] + gamma * (~data["terminated"]).float() * (next_q - alpha * next_log_pi)
    q = twin_q(sac.qnet, q_params, data["obs"], data["action"], looped)  # (2, batch)
    qf_losses = ((q - target) ** 2).mean(-1)
    loss = qf_losses.sum()
    q = q.detach().mean(-1)
    return loss, torch.stack([loss.detach(), qf_losses[0].detach(), qf_losses[1].detach(), q[0], q[1]])


def actor_loss(sac: SAC, looped: bool, actor_params, data):
    """The actor against the smaller of the two critics."""
    alpha = sac.log_alpha.detach().exp()
    pi, log_pi = sample_action(sac.actor, data["obs"], actor_params)
    min_q = twin_q(sac.qnet, sac.q_online_named, data["obs"], pi, looped).min(0).values
    loss = (alpha * log_pi - min_q).mean()
    return loss, loss.detach()


def alpha_loss(sac: SAC, alpha_params, data):
    """The temperature's step of autotune, at a fresh action of the actor just updated."""
    with torch.no_grad():
        _, log_pi = sample_action(sac.actor, data["obs"])
    loss = (-alpha_params["log_alpha"].exp() * (log_pi + sac.target_entropy)).mean()
    return loss, loss.detach()


def gradient_step(loss_fn, params: dict, optimizer, data):
    """`loss_fn(params, data)`'s step: zero_grad, backward, step."""
    loss, metrics = loss_fn(params, data)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return metrics


def learn(sac: SAC, replay, logger, steps, args: Args, obs, action, out, *, update: bool, delayed: bool):
    """What an env step does for learning, in one call: store its transitions (next_obs: the true `final_obs`), count
    the episodes that ended and, once learning has started (`update`), sample a batch for the critic's step, then
    move the target critic (one lerp in place); every policy_frequency steps (`delayed`) also policy_frequency actor
    and temperature steps, as CleanRL compensates the delay. `steps`: the critic's, actor's and temperature's
    gradient steps (the last None without autotune). Returns their metrics."""
    replay.extend(dict(obs=obs, action=action, reward=out["reward"], next_obs=out["final_obs"],
                       terminated=out["terminated"]))
    logger.record_episodes(out["episode_return"], out["episode_length"])
    if not update:
        return ()
    critic_step, actor_step, alpha_step = steps
    data = replay.sample()
    critic = critic_step(data)
    torch._foreach_lerp_(list(sac.q_target_named.values()), list(sac.q_online_named.values()), args.tau)
    if not delayed:
        return (critic,)
    for _ in range(args.policy_frequency):
        actor = actor_step(data)
        alpha = alpha_step(data) if alpha_step else torch.zeros_like(actor)
    return critic, torch.stack([actor, alpha, sac.log_alpha.detach().exp()])


# ------------------------------------------------------------------------------------------- training
def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace:
    """Run SAC to `args.total_timesteps`, from a checkpoint when `args.resume` names one; arguments and result as
    `td3.train`'s."""
    num_iterations = check_args(args)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    check_box_spaces("SAC", obs_space, act_space)
    # No schedule depends on the horizon: a resumed run may go on longer.
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, ("learning_starts", "total_timesteps"))
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    run_dir = leanrl.make_run_dir(args, args.env_id)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")
    sac = SAC(obs_space, act_space, args, device)
    leanrl.set_threads(args.threads, sac.actor, sac.q_params)  # before the first compiled call
    replay = leanrl.Replay.of_transitions(args, obs_space, act_space, device)
    global_step = iteration = fill_start = 0
    if resumed:
        leanrl.restore_rng(resumed)
        leanrl.load_in_place(sac.parts(), resumed)
        global_step, iteration = resumed["global_step"], resumed["iteration"]
        obs = leanrl.restore_envs(envs, resumed["envs"], resumed["obs"], seed=args.seed + global_step)
        fill_start = leanrl.restore_replay(replay, resumed)
    else:
        obs = envs.reset(seed=args.seed)
    logger = leanrl.Logger.from_args(args, run_dir, args.total_timesteps, start_step=global_step, checkpoint=ckpt_path,
                                     device=device, burn_in=burn_in(args, global_step, fill_start,
                                                                    (leanrl.WARMUP + 1) * args.policy_frequency + 1))

    # ---- how each phase runs: every decision of the execution mode, here and nowhere else ----
    accel = leanrl.Acceleration.of(args, device)
    policy = accel.eager_on_cpu("SAC's policy", "one observation at a time, compiling costs more than it saves")(
        lambda obs: sample_action(sac.actor_inference, obs)[0], name="policy")
    looped = accel.cpu_compile  # (see leanrl.critics.twin_q)
    losses = [(partial(critic_loss, sac, args.gamma, looped), sac.q_named, sac.q_optimizer),
              (partial(actor_loss, sac, looped), sac.actor_named, sac.actor_optimizer)]
    if args.autotune:
        losses.append((partial(alpha_loss, sac), {"log_alpha": sac.log_alpha}, sac.alpha_optimizer))
    if accel.cpu_compile:  # a CPU has no graphs: the learner's step one compiled graph, its gradient steps functions
        steps, graph = [leanrl.functional_step(*loss) for loss in losses], dict(compile_kwargs=leanrl.ONE_GRAPH)
    else:  # zero_grad, backward, step: compiled and CUDA-graphed as a whole on a GPU
        steps, graph = [partial(gradient_step, loss, params, optimizer) for loss, params, optimizer in losses], {}
    step = partial(learn, sac, replay, logger, (*steps, None)[:3], args)
    variants = (("fill", False, False), ("learn_critic", True, False), ("learn", True, True))
    fill, learn_critic, learn_all = (accel(partial(step, update=update, delayed=delayed), name=name, **graph)
                                     for name, update, delayed in variants)
    # ----

    def checkpoint_state():
        return dict(leanrl.state_of(sac.parts()), envs=envs.state_dict(), obs=obs, global_step=global_step,
                    iteration=iteration, fill_start=fill_start,
                    replay_buffer=replay.state_dict() if args.save_buffer else None)

    eval_envs = leanrl.open_eval_envs(args, make_eval_envs, run_dir)
    evaluate = partial(leanrl.evaluate, partial(deterministic_action, sac.actor_inference), eval_envs,
                       args.seed + 10_000)  # the squashed mean, from the same start states every time
    critic_out = actor_out = None  # the last update outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            # (no autograd: the policy reads a grad-free alias)
            action = random_actions(sac, args.num_envs) if global_step < args.learning_starts else policy(obs)
            out = envs.step(action)
            iteration, before, global_step = iteration + 1, global_step, global_step + args.num_envs
            if global_step - fill_start <= args.learning_starts:
                fill(obs, action, out)
            elif iteration % args.policy_frequency:
                (critic_out,) = learn_critic(obs, action, out)
            else:
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
    return SimpleNamespace(learner=sac, replay=replay, global_step=global_step, iteration=iteration,
                           fill_start=fill_start, logged=logger.last, run_dir=run_dir)
