"""SAC (Haarnoja et al., 2018) with automatic entropy tuning and CleanRL's implementation details.

Read top to bottom: arguments, networks, the tanh-Gaussian policy written out (no torch.distributions, so no
validation check or host sync hides in it), the twin critic (both Q networks in ONE stacked parameter
TensorDict, evaluated with one `torch.vmap` call), the target, the three functions `leanrl.accelerate`
compiles and CUDA-graphs (`policy`, `update_critic`, `update_actor` with the temperature step), the learner
that builds them once, and `train`: CleanRL's loop (`policy_frequency` actor updates every `policy_frequency`
critic updates). The file imports only leanrl, torch and tensordict. From
leanrl it uses its tools (`accelerate`, `make_adam`, `Logger`, checkpoints, `evaluate`) and `leanrl.offpolicy`
(argument checks, torchrl's replay buffer and its checkpoint). Environments are passed in: a vector env whose
step returns a TensorDict (`leanrl.envs`), or a gymnasium vector env through `leanrl.TorchVectorEnv`.

Bootstrapping: a transition stores the true next observation (the env's `final_obs`) and `terminated` apart
from `truncated`; the target cuts the bootstrap only on termination, so a time limit bootstraps.
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import from_module, from_modules
from torch.func import functional_call

import leanrl
from leanrl.offpolicy import (burn_in, check_box_spaces, check_envs, check_replay_args, make_replay_buffer,
                              make_twin_q, open_eval_envs, start, store)


@dataclass
class Args(leanrl.RunArgs):
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
    eval_every: int = 0
    """run a deterministic evaluation (charts/eval_return; the action is the squashed mean) every this many env
    steps, and at the end (0: never)"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the evaluation env)"""
    capture_video: bool = False
    """record the evaluation episodes of the first evaluation env to `<run dir>/videos` (evaluates at the end
    even without --eval-every; resuming a finished run with it records the trained agent)"""
    log_every: int = 1000
    """read metrics to the host every this many iterations (vector env steps)"""
    checkpoint_every: int = 50_000
    """save a checkpoint every this many iterations (0: only at exit)"""


def check_args(args: Args) -> int:
    """Fail on settings that cannot work, before any environment is built or anything compiled.
    Returns the number of iterations (vector env steps)."""
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


# ------------------------------------------------------------------------------------------- the target
def sac_target(next_q, next_log_pi, rewards, terminated, alpha, gamma: float):
    """Soft clipped double-Q target: next_q (2, batch) from the target critics at a fresh next action, minus the
    entropy term alpha * log pi; no bootstrap past a termination."""
    return rewards + gamma * (~terminated).float() * (next_q.min(0).values - alpha * next_log_pi)


# ----------------------------------------------------------------------------------- the three functions
def make_policy(actor_inference):
    def policy(obs):
        return sample_action(actor_inference, obs)[0]

    return policy


CRITIC_METRICS = ("losses/qf_loss", "losses/qf1_loss", "losses/qf2_loss", "losses/qf1_values", "losses/qf2_values")
ACTOR_METRICS = ("losses/actor_loss", "losses/alpha_loss", "losses/alpha")


def make_critic_loss(actor, twin_q, q_target, log_alpha, args: Args):
    """`critic_loss(q_params, obs, actions, rewards, next_obs, terminated) -> (loss, CRITIC_METRICS)`."""

    def critic_loss(q_params, obs, actions, rewards, next_obs, terminated):
        alpha = log_alpha.detach().exp()
        with torch.no_grad():
            next_actions, next_log_pi = sample_action(actor, next_obs)
            target = sac_target(twin_q(q_target, next_obs, next_actions), next_log_pi, rewards, terminated, alpha,
                                args.gamma)
        q = twin_q(q_params, obs, actions)  # (2, batch)
        qf_losses = ((q - target) ** 2).mean(-1)
        loss = qf_losses.sum()
        q = q.detach().mean(-1)
        return loss, torch.stack([loss.detach(), qf_losses[0].detach(), qf_losses[1].detach(), q[0], q[1]])

    return critic_loss


def make_update_critic(critic_step, q_online, q_target, tau: float):
    """The critic's gradient step, then the target critic moves with ONE lerp_ in place (every step, as CleanRL)."""

    def update_critic(obs, actions, rewards, next_obs, terminated):
        metrics = critic_step(obs, actions, rewards, next_obs, terminated)
        q_target.lerp_(q_online, tau)  # target <- (1 - tau) target + tau online, at the same addresses
        return metrics

    return update_critic


def make_actor_loss(actor, twin_q, q_online, log_alpha):
    """`actor_loss(actor_params, obs) -> (loss, loss)`: the actor against the smaller of the two critics."""

    def actor_loss(actor_params, obs):
        alpha = log_alpha.detach().exp()
        pi, log_pi = sample_action(actor, obs, actor_params)
        min_q = twin_q(q_online, obs, pi).min(0).values
        loss = (alpha * log_pi - min_q).mean()
        return loss, loss.detach()

    return actor_loss


def make_alpha_loss(actor, target_entropy: float):
    """`alpha_loss({"log_alpha": log_alpha}, obs) -> (loss, loss)`: the temperature step of autotune, at a fresh
    action of the actor just updated."""

    def alpha_loss(alpha_params, obs):
        with torch.no_grad():
            _, log_pi = sample_action(actor, obs)
        loss = (-alpha_params["log_alpha"].exp() * (log_pi + target_entropy)).mean()
        return loss, loss.detach()

    return alpha_loss


def make_update_actor(actor_step, alpha_step, log_alpha):
    """The actor's gradient step; with autotune, then the temperature's (`alpha_step`, else False)."""

    def update_actor(obs):
        actor_loss = actor_step(obs)
        alpha_loss = alpha_step(obs) if alpha_step else torch.zeros_like(actor_loss)
        return torch.stack([actor_loss, alpha_loss, log_alpha.detach().exp()])

    return update_actor


# ------------------------------------------------------------------------------------------- training
class SAC:
    """Actor, twin critic, target critic, temperature, optimizers and the accelerated functions, built once."""

    def __init__(self, args: Args, envs, device):
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        check_box_spaces("SAC", obs_space, act_space)
        self.obs_dim, self.action_dim, H = obs_space.shape[0], act_space.shape[0], args.hidden_dim
        self.low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        self.high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)

        self.actor = Actor(self.obs_dim, act_space, H, device)
        # The acting copy shares the learner's storage without its autograd history (a grad-free alias).
        self.actor_inference = Actor(self.obs_dim, act_space, H, "meta")
        from_module(self.actor).data.to_module(self.actor_inference)
        # Twin critic: the weights of both networks stacked in one TensorDict (leading dim 2).
        self.q_params = from_modules(*(SoftQNetwork(self.obs_dim, self.action_dim, H, device) for _ in range(2)),
                                     as_module=True)
        self.q_online = self.q_params.data  # the same storage, without autograd
        self.q_target = self.q_online.clone()

        wrap = leanrl.wrap_flags(args, device)
        # On a CPU, --compile makes each gradient step ONE compiled graph (`leanrl.gradient_step`); the policy, one
        # observation at a time, stays eager there.
        one_graph = leanrl.compiling_on_cpu(wrap)
        policy_wrap = leanrl.wrap_flags(args, device, eager_on_cpu="SAC's policy: compiled, it measured 0.93x eager "
                                        "at batch 1 on a 2-core CPU")
        _, self.twin_q = make_twin_q(SoftQNetwork(self.obs_dim, self.action_dim, H, "meta"), looped=one_graph)
        # Temperature: log_alpha is learned (autotune) or a constant.
        self.target_entropy = -float(self.action_dim)
        if args.autotune:
            self.log_alpha = torch.zeros((), device=device, requires_grad=True)
            self.alpha_optimizer = leanrl.make_adam([self.log_alpha], args.q_lr, **wrap)
        else:
            self.log_alpha = torch.tensor(math.log(args.alpha) if args.alpha > 0 else -math.inf, device=device)
            self.alpha_optimizer = None
        q_named, actor_named = dict(self.q_params.named_parameters()), dict(self.actor.named_parameters())
        self.q_optimizer = leanrl.make_adam(list(q_named.values()), args.q_lr, **wrap)
        self.actor_optimizer = leanrl.make_adam(list(actor_named.values()), args.policy_lr, **wrap)

        self.policy = leanrl.accelerate(make_policy(self.actor_inference), name="policy", **policy_wrap)
        step = functools.partial(leanrl.gradient_step, one_graph=one_graph)
        critic_step = step(make_critic_loss(self.actor, self.twin_q, self.q_target, self.log_alpha, args), q_named,
                           self.q_optimizer, name="critic_step")
        actor_step = step(make_actor_loss(self.actor, self.twin_q, self.q_online, self.log_alpha), actor_named,
                          self.actor_optimizer, name="actor_step")
        alpha_step = args.autotune and step(make_alpha_loss(self.actor, self.target_entropy),
                                            {"log_alpha": self.log_alpha}, self.alpha_optimizer, name="alpha_step")
        wrap["compile"] &= not one_graph  # one graph per step is compiled already
        self.update_critic = leanrl.accelerate(make_update_critic(critic_step, self.q_online, self.q_target, args.tau),
                                               name="update_critic", **wrap)
        self.update_actor = leanrl.accelerate(make_update_actor(actor_step, alpha_step, self.log_alpha),
                                              name="update_actor", **wrap)

    def random_actions(self, n: int):
        """Uniform in the action bounds, drawn with torch on the run's device."""
        return self.low + (self.high - self.low) * torch.rand(n, self.action_dim, device=self.low.device)

    def eval_policy(self, obs):
        return deterministic_action(self.actor_inference, obs)

    def state_dict(self):
        return dict(actor=self.actor.state_dict(), q_params=self.q_online.to_dict(), q_target=self.q_target.to_dict(),
                    log_alpha=self.log_alpha.detach(), q_optimizer=self.q_optimizer.state_dict(),
                    actor_optimizer=self.actor_optimizer.state_dict(),
                    alpha_optimizer=self.alpha_optimizer.state_dict() if self.alpha_optimizer else None)

    def load_state_dict(self, state):
        # In place, so every address a captured graph holds stays valid.
        self.actor.load_state_dict(state["actor"])
        self.q_online.update_(state["q_params"])
        self.q_target.update_(state["q_target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        leanrl.load_optimizer_state(self.q_optimizer, state["q_optimizer"])
        leanrl.load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])
        if self.alpha_optimizer is not None:
            leanrl.load_optimizer_state(self.alpha_optimizer, state["alpha_optimizer"])


def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None):
    """Run SAC to `args.total_timesteps`, from a checkpoint when `args.resume` names one. Returns the
    `leanrl.offpolicy.Run` (learner, buffer, counters). `make_eval_envs(video_folder=...)` builds the
    `args.eval_episodes` envs that evaluations run in (`video_folder`: where the first one records its episodes, with
    --capture-video; else None). `on_iteration(iteration, global_step)`, when given, is called after every iteration
    (the benchmarks time the loop with it)."""
    num_iterations = check_args(args)
    check_envs("SAC", args, envs, make_eval_envs)
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    sac = SAC(args, envs, device)
    leanrl.set_threads(args.threads, sac.actor, sac.q_params)  # before the first compiled call
    # No schedule depends on the horizon: a resumed run may go on longer.
    run, ckpt_path = start(sac, make_replay_buffer(args.buffer_size, args.batch_size, device), args, envs,
                           may_change=("learning_starts", "total_timesteps"))
    eval_envs = open_eval_envs(args, make_eval_envs, os.path.dirname(ckpt_path))

    def evaluate():  # from the same start states every time
        return leanrl.evaluate(sac.eval_policy, eval_envs, args.seed + 10_000)

    # The SPS clock starts once every function has been compiled and captured: the actor's WARMUP + 1 calls.
    logger = leanrl.Logger.from_args(args, os.path.dirname(ckpt_path), args.total_timesteps,
                                     start_step=run.global_step, checkpoint=ckpt_path,
                                     burn_in=burn_in(args, run, (leanrl.WARMUP + 1) * args.policy_frequency + 1))
    critic_out = actor_out = None  # the last update outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, lambda: run.state_dict(envs, args.save_buffer), args):
        for iteration in range(run.iteration + 1, num_iterations + 1):
            with torch.no_grad():
                action = (sac.random_actions(args.num_envs) if run.global_step < args.learning_starts
                          else sac.policy(run.obs))
            out = envs.step(action)
            store(run.rb, run.obs, action, out, out["final_obs"])  # final_obs: bootstrap through a time limit
            run.obs = out["next_obs"]
            before, run.global_step, run.iteration = run.global_step, run.global_step + args.num_envs, iteration

            if run.global_step - run.fill_start > args.learning_starts:
                run.updates += 1
                data = run.rb.sample()
                critic_out = sac.update_critic(data["obs"], data["action"], data["reward"], data["next_obs"],
                                               data["terminated"])
                if iteration % args.policy_frequency == 0:
                    for _ in range(args.policy_frequency):  # compensate for the delay, as CleanRL
                        actor_out = sac.update_actor(data["obs"])

            if (args.eval_every and leanrl.crossings(before, run.global_step, args.eval_every)
                    and iteration < num_iterations):
                logger.record({"charts/eval_return": evaluate()})
            logger.record_episodes(out["episode_return"], out["episode_length"])
            logger.end_iteration(run.global_step)
            if iteration % args.log_every == 0 or iteration == num_iterations:
                for names, values in ((CRITIC_METRICS, critic_out), (ACTOR_METRICS, actor_out)):
                    if values is not None:
                        logger.record(dict(zip(names, values.unbind())))
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
