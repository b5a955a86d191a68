"""TD3 (Fujimoto et al., 2018) with CleanRL's implementation details.

Read top to bottom: arguments, networks, the twin critic (both Q networks in ONE stacked parameter
TensorDict, evaluated with one `torch.vmap` call; two calls in a CPU's one-graph steps), the targets, the
losses, the three functions `leanrl.accelerate` compiles and CUDA-graphs (`policy`, `update_critic`,
`update_actor`: the losses' gradient steps), the learner that builds them once, and `train`: CleanRL's loop,
with the policy delay. The file imports only leanrl, torch and tensordict. From
leanrl it uses its tools (`accelerate`, `make_adam`, `Logger`, checkpoints, `evaluate`) and `leanrl.offpolicy`
(argument checks, torchrl's replay buffer and its checkpoint). Environments are passed in: a vector env whose
step returns a TensorDict (`leanrl.envs`), or a gymnasium vector env through `leanrl.TorchVectorEnv`.

Bootstrapping: a transition stores the true next observation (the env's `final_obs`, which differs from
`next_obs` only where an episode ended and was auto-reset) and `terminated` apart from `truncated`.
The target cuts the bootstrap only on termination; a time-limit truncation bootstraps from `final_obs`.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import TensorDict, from_module, from_modules
from torch.func import functional_call

import leanrl
from leanrl.offpolicy import (burn_in, check_box_spaces, check_envs, check_replay_args, make_replay_buffer,
                              make_twin_q, open_eval_envs, start, store)


@dataclass
class Args(leanrl.RunArgs):
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
    eval_every: int = 0
    """run a deterministic evaluation (charts/eval_return) every this many env steps, and at the end (0: never)"""
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


# ------------------------------------------------------------------------------------------- the targets
def smoothed_target_actions(target_actions, noise, *, policy_noise, noise_clip, action_scale, low, high):
    """Target policy smoothing: clipped Gaussian noise (`noise` ~ N(0, 1)) on the target actor's actions."""
    clipped = (noise * policy_noise).clamp(-noise_clip, noise_clip) * action_scale
    return (target_actions + clipped).clamp(low, high)


def td3_target(next_q, rewards, terminated, gamma: float):
    """Clipped double-Q target: next_q (2, batch) from the two target critics; no bootstrap past a termination."""
    return rewards + gamma * (~terminated).float() * next_q.min(0).values


# ----------------------------------------------------------------------------------- the three functions
def make_policy(actor_inference, exploration_noise: float, low, high):
    def policy(obs):
        action = actor_inference(obs)
        noise = torch.randn_like(action) * actor_inference.action_scale * exploration_noise
        return (action + noise).clamp(low, high)

    return policy


CRITIC_METRICS = ("losses/qf_loss", "losses/qf1_loss", "losses/qf2_loss", "losses/qf1_values", "losses/qf2_values")
ACTOR_METRICS = ("losses/actor_loss",)


def make_critic_loss(actor_target, twin_q, q_target, args: Args, low, high):
    """`critic_loss(q_params, obs, actions, rewards, next_obs, terminated) -> (loss, CRITIC_METRICS)`."""

    def critic_loss(q_params, obs, actions, rewards, next_obs, terminated):
        with torch.no_grad():
            next_actions = smoothed_target_actions(
                actor_target(next_obs), torch.randn_like(actions), policy_noise=args.policy_noise,
                noise_clip=args.noise_clip, action_scale=actor_target.action_scale, low=low, high=high)
            target = td3_target(twin_q(q_target, next_obs, next_actions), rewards, terminated, args.gamma)
        q = twin_q(q_params, obs, actions)  # (2, batch)
        qf_losses = ((q - target) ** 2).mean(-1)
        loss = qf_losses.sum()
        q = q.detach().mean(-1)
        return loss, torch.stack([loss.detach(), qf_losses[0].detach(), qf_losses[1].detach(), q[0], q[1]])

    return critic_loss


def make_actor_loss(actor, q_value, q1_params):
    """`actor_loss(actor_params, obs) -> (loss, ACTOR_METRICS)`: the actor climbs the first critic."""

    def actor_loss(actor_params, obs):
        loss = -q_value(q1_params, obs, functional_call(actor, actor_params, (obs,))).mean()
        return loss, loss.detach()[None]

    return actor_loss


def make_update_actor(actor_step, targets, online, tau: float):
    """The delayed step: the actor's gradient step, then every target moves with ONE lerp_ in place."""

    def update_actor(obs):
        metrics = actor_step(obs)
        targets.lerp_(online, tau)  # target <- (1 - tau) target + tau online, at the same addresses
        return metrics

    return update_actor


# ------------------------------------------------------------------------------------------- training
class TD3:
    """Actor, twin critic, targets, optimizers and the accelerated functions, built once."""

    def __init__(self, args: Args, envs, device):
        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        check_box_spaces("TD3", obs_space, act_space)
        obs_dim, H = obs_space.shape[0], args.hidden_dim
        self.obs_dim, self.action_dim = obs_dim, act_space.shape[0]
        self.low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        self.high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)

        self.actor = Actor(obs_dim, act_space, H, device)
        # The acting copy shares the learner's storage without its autograd history (a grad-free alias).
        self.actor_inference = Actor(obs_dim, act_space, H, "meta")
        from_module(self.actor).data.to_module(self.actor_inference)
        # Twin critic: the weights of both networks stacked in one TensorDict (leading dim 2).
        self.q_params = from_modules(*(QNetwork(obs_dim, self.action_dim, H, device) for _ in range(2)), as_module=True)
        self.qnet = QNetwork(obs_dim, self.action_dim, H, "meta")
        # Targets: one TensorDict holding copies of both, moved by one lerp_ (see make_update_actor).
        self.online = TensorDict(actor=from_module(self.actor).data, q=self.q_params.data)
        self.targets = self.online.clone()
        self.actor_target = Actor(obs_dim, act_space, H, "meta")
        self.targets["actor"].to_module(self.actor_target)

        wrap = leanrl.wrap_flags(args, device)
        # On a CPU, --compile makes each gradient step ONE compiled graph (`leanrl.gradient_step`); the policy, one
        # observation at a time, stays eager there.
        one_graph = leanrl.compiling_on_cpu(wrap)
        policy_wrap = leanrl.wrap_flags(args, device, eager_on_cpu="TD3's policy: compiled, it measured 0.58x eager "
                                        "at batch 1 on a 2-core CPU")
        q_named, actor_named = dict(self.q_params.named_parameters()), dict(self.actor.named_parameters())
        self.q_optimizer = leanrl.make_adam(list(q_named.values()), args.learning_rate, **wrap)
        self.actor_optimizer = leanrl.make_adam(list(actor_named.values()), args.learning_rate, **wrap)
        self.q_value, self.twin_q = make_twin_q(self.qnet, looped=one_graph)

        self.policy = leanrl.accelerate(make_policy(self.actor_inference, args.exploration_noise, self.low, self.high),
                                        name="policy", **policy_wrap)
        critic_step = leanrl.gradient_step(
            make_critic_loss(self.actor_target, self.twin_q, self.targets["q"], args, self.low, self.high), q_named,
            self.q_optimizer, one_graph=one_graph, name="update_critic")
        actor_step = leanrl.gradient_step(make_actor_loss(self.actor, self.q_value, self.q_params.data[0]),
                                          actor_named, self.actor_optimizer, one_graph=one_graph, name="update_actor")
        wrap["compile"] &= not one_graph  # one graph per step is compiled already
        self.update_critic = leanrl.accelerate(critic_step, name="update_critic", **wrap)
        self.update_actor = leanrl.accelerate(make_update_actor(actor_step, self.targets, self.online, args.tau),
                                              name="update_actor", **wrap)

    def random_actions(self, n: int):
        """Uniform in the action bounds, drawn with torch on the run's device."""
        return self.low + (self.high - self.low) * torch.rand(n, self.action_dim, device=self.low.device)

    def eval_policy(self, obs):
        return self.actor_inference(obs)

    def state_dict(self):
        return dict(actor=self.actor.state_dict(), q_params=self.q_params.data.to_dict(),
                    targets=self.targets.to_dict(), q_optimizer=self.q_optimizer.state_dict(),
                    actor_optimizer=self.actor_optimizer.state_dict())

    def load_state_dict(self, state):
        # In place, so every address a captured graph holds stays valid.
        self.actor.load_state_dict(state["actor"])
        self.q_params.data.update_(state["q_params"])
        self.targets.update_(state["targets"])
        leanrl.load_optimizer_state(self.q_optimizer, state["q_optimizer"])
        leanrl.load_optimizer_state(self.actor_optimizer, state["actor_optimizer"])


def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None):
    """Run TD3 to `args.total_timesteps`, from a checkpoint when `args.resume` names one. Returns the
    `leanrl.offpolicy.Run` (learner, buffer, counters). `make_eval_envs(video_folder=...)` builds the
    `args.eval_episodes` envs that evaluations run in (`video_folder`: where the first one records its episodes, with
    --capture-video; else None). `on_iteration(iteration, global_step)`, when given, is called after every iteration
    (the benchmarks time the loop with it)."""
    num_iterations = check_args(args)
    check_envs("TD3", args, envs, make_eval_envs)
    device = torch.device(device or leanrl.resolve_device(args.device))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    td3 = TD3(args, envs, device)
    leanrl.set_threads(args.threads, td3.actor, td3.q_params)  # before the first compiled call
    # No schedule depends on the horizon: a resumed run may go on longer.
    run, ckpt_path = start(td3, make_replay_buffer(args.buffer_size, args.batch_size, device), args, envs,
                           may_change=("learning_starts", "total_timesteps"))
    eval_envs = open_eval_envs(args, make_eval_envs, os.path.dirname(ckpt_path))

    def evaluate():  # from the same start states every time
        return leanrl.evaluate(td3.eval_policy, eval_envs, args.seed + 10_000)

    # The SPS clock starts once every function has been compiled and captured: the actor's WARMUP + 1 calls.
    logger = leanrl.Logger.from_args(args, os.path.dirname(ckpt_path), args.total_timesteps,
                                     start_step=run.global_step, checkpoint=ckpt_path,
                                     burn_in=burn_in(args, run, (leanrl.WARMUP + 1) * args.policy_frequency + 1))
    critic_out = actor_out = None  # the last update outputs, read at log boundaries
    with logger, leanrl.save_on_interrupt(ckpt_path, lambda: run.state_dict(envs, args.save_buffer), args):
        for iteration in range(run.iteration + 1, num_iterations + 1):
            with torch.no_grad():
                action = (td3.random_actions(args.num_envs) if run.global_step < args.learning_starts
                          else td3.policy(run.obs))
            out = envs.step(action)
            store(run.rb, run.obs, action, out, out["final_obs"])  # final_obs: bootstrap through a time limit
            run.obs = out["next_obs"]
            before, run.global_step, run.iteration = run.global_step, run.global_step + args.num_envs, iteration

            if run.global_step - run.fill_start > args.learning_starts:
                run.updates += 1
                data = run.rb.sample()
                critic_out = td3.update_critic(data["obs"], data["action"], data["reward"], data["next_obs"],
                                               data["terminated"])
                if iteration % args.policy_frequency == 0:  # the delay: actor and targets move less often
                    actor_out = td3.update_actor(data["obs"])

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
