"""PPO (Schulman et al., 2017) with CleanRL's implementation details.

Read top to bottom: arguments, networks, the three phases lifted into functions (`policy`, `gae`,
`update`) so `leanrl.accelerate` can compile and CUDA-graph them, then the training loop.
Depends only on leanrl, torch and tensordict; environments are passed in (see `envs/`).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict, from_module

import leanrl
from leanrl.pipeline import AsyncArgs


@dataclass
class Args(leanrl.RunArgs, AsyncArgs):
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    clip_reward: bool = False
    """clip rewards to their sign before learning (Atari; scores are still logged raw)"""
    bootstrap_truncated: bool = True
    """bootstrap truncated episodes from the value of their final observation (one extra critic pass per step)"""
    graph_iteration: bool = False
    """with an on-device env, capture a whole iteration (rollout, GAE, every update epoch) as one CUDA graph"""


def check_args(args: Args) -> tuple[int, int, int]:
    """Fail on settings that cannot work, before any environment is built or anything compiled."""
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise ValueError(f"num_envs * num_steps = {batch_size} is not divisible by num_minibatches = "
                         f"{args.num_minibatches}")
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise ValueError(f"total_timesteps = {args.total_timesteps} is less than one batch ({batch_size} steps)")
    if args.async_:
        leanrl.pipeline.check_settings(args.transport, args.num_collectors, args.max_lag, args.deterministic,
                                       args.publish_every)
    return batch_size, batch_size // args.num_minibatches, num_iterations


# ---------------------------------------------------------------------------------------------- networks
def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class AtariAgent(nn.Module):
    """Nature-CNN trunk shared by actor and critic."""

    def __init__(self, num_actions, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def forward(self, obs):
        """Distribution parameters (logits) and value."""
        hidden = self.network(obs / 255.0)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def get_value(self, obs):
        return self.critic(self.network(obs / 255.0)).squeeze(-1)


def mlp(obs_dim, out_dim, out_std, device):
    return nn.Sequential(
        layer_init(nn.Linear(obs_dim, 64, device=device)), nn.Tanh(),
        layer_init(nn.Linear(64, 64, device=device)), nn.Tanh(),
        layer_init(nn.Linear(64, out_dim, device=device), std=out_std),
    )


class MLPAgent(nn.Module):
    """Separate actor and critic MLPs; discrete logits or a Gaussian mean with a state-free log-std."""

    def __init__(self, obs_dim, action_dim, continuous, device=None):
        super().__init__()
        self.critic = mlp(obs_dim, 1, 1.0, device)
        self.actor = mlp(obs_dim, action_dim, 0.01, device)
        if continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim, device=device))

    def forward(self, obs):
        return self.actor(obs), self.critic(obs).squeeze(-1)

    def get_value(self, obs):
        return self.critic(obs).squeeze(-1)


def make_agent(observation_space, action_space, device=None):
    continuous = action_space.shape != ()
    if len(observation_space.shape) == 3:
        # channels_last is the conv layout oneDNN and cuDNN prefer: at the Atari minibatch on CPU the update is
        # 1.36x faster eager and 1.14x faster compiled than with contiguous weights.
        return AtariAgent(action_space.n, device).to(memory_format=torch.channels_last)
    action_dim = action_space.shape[0] if continuous else action_space.n
    return MLPAgent(int(np.prod(observation_space.shape)), action_dim, continuous, device)


# ---------------------------------------------------------------------------- distributions, sync-free
def sample_and_logprob(agent, dist_params, action=None):
    """Sample (when `action` is None), log-probability and entropy, written out so no validation
    check or host sync hides inside torch.distributions."""
    if hasattr(agent, "actor_logstd"):  # Gaussian
        logstd = agent.actor_logstd.expand_as(dist_params)
        if action is None:
            action = dist_params + logstd.exp() * torch.randn_like(dist_params)
        logprob = -((action - dist_params) ** 2) / (2 * (2 * logstd).exp()) - logstd - 0.5 * math.log(2 * math.pi)
        entropy = 0.5 + 0.5 * math.log(2 * math.pi) + logstd
        return action, logprob.sum(-1), entropy.sum(-1)
    logits = dist_params.log_softmax(-1)
    if action is None:  # Gumbel-max: an exact categorical sample drawn in-graph
        gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp_min(1e-20)))
        action = (logits + gumbel).argmax(-1)
    logprob = logits.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.exp() * logits).sum(-1)
    return action, logprob, entropy


# ----------------------------------------------------------------------------------- the three phases
def make_policy(agent_inference):
    def policy(obs):
        dist_params, value = agent_inference(obs)
        action, logprob, _ = sample_and_logprob(agent_inference, dist_params)
        return action, logprob, value

    return policy


def gae(rewards, values, next_values, terminated, dones, gamma: float, gae_lambda: float):
    """Generalized advantage estimation over a (num_steps, num_envs) rollout.

    `next_values[t]` is the value of the true next state of transition t (for a truncated episode, its
    final observation); termination cuts the bootstrap, any episode end cuts the recursion.
    """
    deltas = rewards + gamma * next_values * (~terminated) - values
    not_done = (~dones).float()
    advantages = []
    lastgaelam = torch.zeros_like(deltas[0])
    for t in reversed(range(rewards.shape[0])):
        lastgaelam = deltas[t] + gamma * gae_lambda * not_done[t] * lastgaelam
        advantages.append(lastgaelam)
    advantages = torch.stack(advantages[::-1])
    return advantages, advantages + values


def ppo_loss(agent, obs, actions, logprobs, advantages, returns, values, *, clip_coef, clip_vloss, norm_adv,
             ent_coef, vf_coef):
    dist_params, newvalue = agent(obs)
    _, newlogprob, entropy = sample_and_logprob(agent, dist_params, actions)
    logratio = newlogprob - logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        old_approx_kl = (-logratio).mean()
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()

    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    v_loss_unclipped = (newvalue - returns) ** 2
    if clip_vloss:
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * v_loss_unclipped.mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    metrics = dict(pg_loss=pg_loss, v_loss=v_loss, entropy=entropy_loss, old_approx_kl=old_approx_kl,
                   approx_kl=approx_kl, clipfrac=clipfrac)
    return loss, metrics


def make_update(agent, optimizer, args: Args):
    def update(obs, actions, logprobs, advantages, returns, values):
        optimizer.zero_grad()
        loss, m = ppo_loss(agent, obs, actions, logprobs, advantages, returns, values, clip_coef=args.clip_coef,
                           clip_vloss=args.clip_vloss, norm_adv=args.norm_adv, ent_coef=args.ent_coef,
                           vf_coef=args.vf_coef)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return (m["pg_loss"].detach(), m["v_loss"].detach(), m["entropy"].detach(), m["old_approx_kl"],
                m["approx_kl"], m["clipfrac"], grad_norm.detach())

    return update



# ------------------------------------------------------------------------- stale data (async PPO, --async)
def truncated_is_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values, *, is_clip, clip_coef,
                      clip_vloss, norm_adv, ent_coef, vf_coef):
    """PipelineRL's off-policy policy gradient: -A * min(pi/mu, is_clip) * log pi, the importance weight to the
    behaviour policy mu truncated and detached (its gradient is pi/mu * A * grad log pi below the clip);
    value and entropy terms as in `ppo_loss`."""
    dist_params, newvalue = agent(obs)
    _, newlogprob, entropy = sample_and_logprob(agent, dist_params, actions)
    logratio = newlogprob - behaviour_logprobs
    weight = logratio.detach().exp().clamp(max=is_clip)
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = -(weight * advantages * newlogprob).mean()
    v_loss_unclipped = (newvalue - returns) ** 2
    if clip_vloss:
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * v_loss_unclipped.mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    with torch.no_grad():
        ratio = logratio.exp()
        metrics = dict(pg_loss=pg_loss, v_loss=v_loss, entropy=entropy_loss, old_approx_kl=(-logratio).mean(),
                       approx_kl=((ratio - 1) - logratio).mean(), clipfrac=(ratio > is_clip).float().mean())
    return loss, metrics


def decoupled_ppo_loss(agent, obs, actions, behaviour_logprobs, proximal_logprobs, advantages, returns, values, *,
                       is_clip, clip_coef, clip_vloss, norm_adv, ent_coef, vf_coef):
    """AReaL's decoupled PPO: the clipped trust region around the proximal policy (the trainer's weights when the
    batch is consumed), each sample reweighted by proximal/behaviour (truncated at is_clip). The weight is
    positive, so w * max(-A r, -A clip(r)) = max(-wA r, -wA clip(r)): `ppo_loss` with advantages w * A."""
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    weight = (proximal_logprobs - behaviour_logprobs).exp().clamp(max=is_clip)
    return ppo_loss(agent, obs, actions, proximal_logprobs, weight * advantages, returns, values,
                    clip_coef=clip_coef, clip_vloss=clip_vloss, norm_adv=False, ent_coef=ent_coef, vf_coef=vf_coef)


def effective_sample_size(logw):
    """(sum w)^2 / (n sum w^2) of the importance weights w = exp(logw): 1 on-policy, 1/n at worst."""
    w = (logw - logw.max()).exp()
    return w.sum() ** 2 / (w.numel() * (w**2).sum())


def make_async_update(agent, optimizer, args: Args):
    def update(obs, actions, behaviour_logprobs, proximal_logprobs, advantages, returns, values):
        optimizer.zero_grad()
        kw = dict(clip_coef=args.clip_coef, clip_vloss=args.clip_vloss, norm_adv=args.norm_adv,
                  ent_coef=args.ent_coef, vf_coef=args.vf_coef)
        if args.correction == "decoupled":
            loss, m = decoupled_ppo_loss(agent, obs, actions, behaviour_logprobs, proximal_logprobs, advantages,
                                         returns, values, is_clip=args.is_clip, **kw)
        elif args.correction == "truncated_is":
            loss, m = truncated_is_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values,
                                        is_clip=args.is_clip, **kw)
        else:  # naive PPO on stale data: the behaviour policy taken as the old policy
            loss, m = ppo_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values, **kw)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return (m["pg_loss"].detach(), m["v_loss"].detach(), m["entropy"].detach(), m["old_approx_kl"],
                m["approx_kl"], m["clipfrac"], grad_norm.detach())

    return update


MAX_COMPILED_GAE_STEPS = 256  # longer rollouts run GAE uncompiled (still inside the CUDA graph with --cudagraphs)

UPDATE_METRICS = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/old_approx_kl",
                  "losses/approx_kl", "losses/clipfrac", "losses/grad_norm", "losses/explained_variance")


# ------------------------------------------------------------------------------------------- training
class PPO:
    """Agent, optimizer, rollout storage and the accelerated phases, built once from `args` and `envs`."""

    def __init__(self, args: Args, envs, device):
        self.args, self.envs, self.device = args, envs, device
        self.batch_size, self.minibatch_size, self.num_iterations = check_args(args)
        self.agent = make_agent(envs.single_observation_space, envs.single_action_space, device)
        # The acting copy shares the learner's storage without its autograd history (a grad-free alias).
        self.agent_inference = make_agent(envs.single_observation_space, envs.single_action_space, "meta")
        from_module(self.agent).data.to_module(self.agent_inference)

        # eps as CleanRL; a tensor lr, annealed in place (see leanrl.make_adam)
        self.optimizer = leanrl.make_adam(self.agent.parameters(), args.learning_rate, eps=1e-5, compile=args.compile,
                                          cudagraphs=args.cudagraphs, device=device)

        on_device = getattr(envs, "on_device", False)
        if args.graph_iteration and not on_device:
            raise ValueError("--graph-iteration needs an on-device env (torch/CartPole-v1, torch/Pendulum-v1)")
        # With --graph-iteration the phases are only compiled: one outer graph captures them all.
        wrap = dict(compile=args.compile, cudagraphs=args.cudagraphs and not args.graph_iteration, device=device)
        self.policy = leanrl.accelerate(make_policy(self.agent_inference), name="policy", **wrap)
        self.get_value = leanrl.accelerate(self.agent_inference.get_value, name="get_value", **wrap)
        # torch.compile unrolls the GAE loop: fine at Atari's 128 steps, but a 2048-step rollout (MuJoCo) takes
        # about 10 minutes and 800 MB to compile on CPU, for a loop that costs milliseconds eager.
        compile_gae = args.compile and args.num_steps <= MAX_COMPILED_GAE_STEPS
        self.gae = leanrl.accelerate(gae, name="gae", **{**wrap, "compile": compile_gae})
        self.update = leanrl.accelerate(make_update(self.agent, self.optimizer, args), name="update", **wrap)
        self.env_step = leanrl.accelerate(envs.step, name="env_step", **wrap) if on_device else envs.step
        self.iterate = self._iterate
        if args.graph_iteration:
            self.iterate = leanrl.accelerate(self._iterate, cudagraphs=args.cudagraphs, device=device,
                                             name="iteration")

        obs_space, act_space = envs.single_observation_space, envs.single_action_space
        T, N = args.num_steps, args.num_envs
        self.storage = TensorDict(
            obs=torch.zeros(T, N, *obs_space.shape, dtype=envs.obs_dtype, device=device),
            actions=torch.zeros(T, N, *act_space.shape, device=device,
                                dtype=torch.float32 if act_space.shape else torch.long),
            logprobs=torch.zeros(T, N, device=device),
            values=torch.zeros(T, N, device=device),
            rewards=torch.zeros(T, N, device=device),
            final_values=torch.zeros(T, N, device=device),
            terminated=torch.zeros(T, N, dtype=torch.bool, device=device),
            truncated=torch.zeros(T, N, dtype=torch.bool, device=device),
            episode_return=torch.zeros(T, N, device=device),
            episode_length=torch.zeros(T, N, device=device),
            batch_size=[T, N], device=device)
        self.next_obs = None
        self.logged = {}  # the last values written to the log (set by leanrl.run)
        self.global_step = 0
        self.iteration = 0

    @torch.no_grad()
    def rollout(self):
        args, s = self.args, self.storage
        for step in range(args.num_steps):
            action, logprob, value = self.policy(self.next_obs)
            out = self.env_step(action)
            reward = out["reward"].sign() if args.clip_reward else out["reward"]
            s[step] = TensorDict(obs=self.next_obs, actions=action, logprobs=logprob, values=value, rewards=reward,
                                 terminated=out["terminated"], truncated=out["truncated"],
                                 episode_return=out["episode_return"], episode_length=out["episode_length"])
            if args.bootstrap_truncated:
                s["final_values"][step] = self.get_value(out["final_obs"])
            self.next_obs.copy_(out["next_obs"])  # in place: a captured iteration reads this address
        next_value = self.get_value(self.next_obs)
        # Value of each transition's true next state: the next stored value, or the final observation's.
        next_values = torch.cat([s["values"][1:], next_value.unsqueeze(0)])
        if args.bootstrap_truncated:
            next_values = torch.where(s["truncated"], s["final_values"], next_values)
        terminated = s["terminated"] if args.bootstrap_truncated else s["terminated"] | s["truncated"]
        return next_values, terminated

    def reset(self, seed):
        self.next_obs = self.envs.reset(seed=seed)

    def _iterate(self):
        """Rollout, GAE and every update epoch; the last minibatch's metrics and the explained variance."""
        args, s = self.args, self.storage
        next_values, terminated = self.rollout()
        advantages, returns = self.gae(s["rewards"], s["values"], next_values, terminated,
                                       s["terminated"] | s["truncated"], args.gamma, args.gae_lambda)
        b = s.select("obs", "actions", "logprobs", "values").reshape(-1)
        b["advantages"], b["returns"] = advantages.reshape(-1), returns.reshape(-1)
        for _ in range(args.update_epochs):
            # argsort of uniform noise: a random permutation that a CUDA graph can replay
            b_inds = torch.rand(self.batch_size, device=self.device).argsort().split(self.minibatch_size)
            for mb_inds in b_inds:
                mb = b[mb_inds]
                out = self.update(mb["obs"], mb["actions"], mb["logprobs"], mb["advantages"], mb["returns"],
                                  mb["values"])
        explained_var = 1 - (b["returns"] - b["values"]).var() / b["returns"].var()
        return (*out, explained_var)

    def train_iteration(self, logger):
        args, s = self.args, self.storage
        if args.anneal_lr:
            frac = 1.0 - self.iteration / self.num_iterations
            self.optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)
        metrics = dict(zip(UPDATE_METRICS, self.iterate()))
        metrics["charts/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        logger.record(metrics)
        logger.record_episodes(s["terminated"] | s["truncated"], s["episode_return"], s["episode_length"])
        self.iteration += 1
        self.global_step += self.batch_size

    def benchmark_calls(self):
        """The accelerated functions with inputs of this run's shapes, for `benchmarks/run.py`."""
        s = self.storage.reshape(-1)[: self.minibatch_size]
        advantages, returns = torch.randn_like(s["values"]), torch.randn_like(s["values"])
        return {"policy": (self.policy, (self.storage["obs"][0],)),
                "update": (self.update, (s["obs"], s["actions"], s["logprobs"], advantages, returns, s["values"]))}

    def state_dict(self):
        return dict(agent=self.agent.state_dict(), optimizer=self.optimizer.state_dict(),
                    envs=self.envs.state_dict(), next_obs=self.next_obs, global_step=self.global_step,
                    iteration=self.iteration)

    def load_state_dict(self, state):
        # Before any capture; parameters are copied in place, the tensor learning rate is kept.
        self.agent.load_state_dict(state["agent"])
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.param_groups[0]["lr"] = lr.copy_(self.optimizer.param_groups[0]["lr"])
        self.global_step, self.iteration = state["global_step"], state["iteration"]
        self.next_obs = leanrl.restore_envs(self.envs, state["envs"], state["next_obs"],
                                            seed=self.args.seed + self.iteration)


def train(args: Args, envs, device=None) -> PPO:
    """Run PPO to `args.total_timesteps` (logging, checkpoints, resume: see `leanrl.run`)."""
    device = device or leanrl.resolve_device(args.device)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    return leanrl.run(PPO(args, envs, device), args)


# ---------------------------------------------------------------------------- async training (--async)
def ppo_collector(ctx, args: Args, make_envs, device):
    """A collector role: PPO's own rollout on its own envs, the policy reading the newest weights in place at
    every step boundary (`ctx.step_boundary()`, which also gives the version each step is tagged with)."""
    rank_seed = args.seed + 1 + ctx.rank
    leanrl.seed_everything(rank_seed, args.torch_deterministic)
    algo = PPO(args, make_envs(seed=rank_seed, device=device), device)
    policy, versions = algo.policy, []

    def tagged_policy(obs):
        versions.append(ctx.step_boundary())
        return policy(obs)

    algo.policy = tagged_policy
    algo.reset(rank_seed)
    for batch in ctx.batches(from_module(algo.agent).data, async_batch_template(algo.storage)):
        versions.clear()
        next_values, terminated = algo.rollout()
        batch.update_(algo.storage)
        batch["next_values"].copy_(next_values)
        batch["gae_terminated"].copy_(terminated)
        batch["version"].copy_(torch.tensor(versions).unsqueeze(1).expand(batch.shape))


def async_batch_template(storage):
    """What a collector sends: the rollout storage, GAE's inputs and the version of every step."""
    template = storage.clone()
    template["next_values"] = torch.zeros_like(template["values"])
    template["gae_terminated"] = torch.zeros_like(template["terminated"])
    template["version"] = torch.zeros(template.shape, dtype=torch.int64, device=storage.device)
    return template


class AsyncPPO(PPO):
    """The trainer role: consumes collectors' batches in ticket order, corrects for their staleness
    (`--correction`), publishes its weights after every iteration. Collectors own the environments."""

    def __init__(self, args: Args, make_envs, device):
        super().__init__(args, make_envs(seed=args.seed, device=device), device)  # for spaces and shapes only
        self.make_envs = make_envs
        wrap = dict(compile=args.compile, cudagraphs=args.cudagraphs, device=device)
        self.update = leanrl.accelerate(make_async_update(self.agent, self.optimizer, args), name="update", **wrap)
        self.logprob = leanrl.accelerate(self._logprob, name="logprob", **wrap)
        self.trainer = None

    def _logprob(self, obs, actions):
        return sample_and_logprob(self.agent_inference, self.agent_inference(obs)[0], actions)[1]

    def reset(self, seed):
        pass  # each collector resets its own envs

    def start(self):
        args = self.args
        collector_device = self.device if args.transport == "threads" else torch.device("cpu")
        self.trainer = leanrl.pipeline.start(
            args.transport, args.num_collectors, ppo_collector, (args, self.make_envs, collector_device),
            async_batch_template(self.storage), from_module(self.agent).data, max_lag=args.max_lag,
            deterministic=args.deterministic, publish_every=args.publish_every)

    def train_iteration(self, logger):
        args, s = self.args, self.storage
        if self.trainer is None:
            self.start()
        if args.anneal_lr:
            frac = 1.0 - self.iteration / self.num_iterations
            self.optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)
        batch = self.trainer.next_batch()
        s.update_(batch.select(*s.keys()))
        advantages, returns = self.gae(s["rewards"], s["values"], batch["next_values"].to(self.device),
                                       batch["gae_terminated"].to(self.device), s["terminated"] | s["truncated"],
                                       args.gamma, args.gae_lambda)
        b = s.select("obs", "actions", "logprobs", "values").reshape(-1)
        b["advantages"], b["returns"] = advantages.reshape(-1), returns.reshape(-1)
        with torch.no_grad():  # the proximal policy: the weights this batch is consumed with
            b["proximal_logprobs"] = self.logprob(b["obs"], b["actions"])
        for _ in range(args.update_epochs):
            for mb_inds in torch.rand(self.batch_size, device=self.device).argsort().split(self.minibatch_size):
                mb = b[mb_inds]
                out = self.update(mb["obs"], mb["actions"], mb["logprobs"], mb["proximal_logprobs"],
                                  mb["advantages"], mb["returns"], mb["values"])
        self.trainer.publish()
        explained_var = 1 - (b["returns"] - b["values"]).var() / b["returns"].var()
        metrics = dict(zip(UPDATE_METRICS, (*out, explained_var)))
        metrics["charts/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        metrics["async/ess"] = effective_sample_size(b["proximal_logprobs"] - b["logprobs"])
        metrics.update(self.trainer.stats.summary())
        logger.record(metrics)
        logger.record_episodes(s["terminated"] | s["truncated"], s["episode_return"], s["episode_length"])
        self.iteration += 1
        self.global_step += self.batch_size

    def state_dict(self):
        return dict(agent=self.agent.state_dict(), optimizer=self.optimizer.state_dict(),
                    global_step=self.global_step, iteration=self.iteration)

    def load_state_dict(self, state):
        # Collectors restart their envs on resume; the learner resumes exactly.
        super().load_state_dict({**state, "envs": self.envs.state_dict(), "next_obs": torch.zeros(0)})

    def close(self):
        if self.trainer is not None:
            self.trainer.close()


def train_async(args: Args, make_envs, device=None) -> AsyncPPO | None:
    """Async PPO (`--async`): `make_envs(seed=, device=)` builds one collector's envs (picklable for processes).
    With `--transport distributed`, every torchrun rank calls this; collector ranks return None."""
    device = device or leanrl.resolve_device(args.device)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    if args.transport == "distributed":
        from leanrl.pipeline.distributed import is_collector_rank, join
        device = join(args.num_collectors, device)
        if is_collector_rank():
            leanrl.pipeline.start("distributed", args.num_collectors, ppo_collector, (args, make_envs, device), None,
                                  None, max_lag=args.max_lag, deterministic=args.deterministic,
                                  publish_every=args.publish_every)
            return None
    algo = AsyncPPO(args, make_envs, device)
    try:
        return leanrl.run(algo, args)
    finally:
        algo.close()
