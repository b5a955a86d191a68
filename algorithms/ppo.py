"""PPO (Schulman et al., 2017) with CleanRL's implementation details.

Read top to bottom: the arguments, the networks, the phases as plain functions (`policy`, `store_and_act`: a step's
one call, `rollout`, `gae`, `ppo_loss`, `update`), then `train`: CleanRL's loop, after one block that decides how
each phase runs.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, numpy, tensordict and
leanrl. `envs` is a `leanrl.VectorEnv` (leanrl/env.py): any of `leanrl.envs`, or a gymnasium vector env made with
`autoreset_mode=AutoresetMode.SAME_STEP` and wrapped in `leanrl.TorchVectorEnv`.
"""

import os
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict, from_module

import leanrl


@dataclass
class Args(leanrl.EvalArgs, leanrl.RunArgs):
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the environment"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_env_buffers: int = 1
    """the groups host envs step in: while the policy acts on one, the others step in the background (2: PufferLib's
    double buffering); 1 steps every env together"""
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
    anneal_clip: bool = False
    """anneal the clipping coefficient to 0 with the iterations, as --anneal-lr does the learning rate"""
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
    leanrl.check_flags(args, positive=("num_envs", "num_env_buffers", "num_steps", "learning_rate", "num_minibatches",
                                       "update_epochs", "max_grad_norm"),
                       non_negative=("clip_coef", "ent_coef", "vf_coef"), unit_interval=("gamma", "gae_lambda"))
    if args.num_envs % args.num_env_buffers:
        raise leanrl.UsageError(f"num_envs = {args.num_envs} is not divisible by num_env_buffers = "
                                f"{args.num_env_buffers}")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise leanrl.UsageError(f"num_envs * num_steps = {batch_size} is not divisible by num_minibatches = "
                                f"{args.num_minibatches}")
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        raise leanrl.UsageError(f"total_timesteps = {args.total_timesteps} is less than one batch ({batch_size} steps)")
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

    def trunk(self, obs):
        # The frames to float in one copy, already in the convolutions' channels_last layout: `obs / 255.0` makes an
        # NCHW copy that oneDNN converts again, forward and backward.
        return self.network(obs.to(torch.float32, memory_format=torch.channels_last, copy=True).div_(255.0))

    def forward(self, obs):
        """Distribution parameters (logits) and value."""
        hidden = self.trunk(obs)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def get_value(self, obs):
        return self.critic(self.trunk(obs)).squeeze(-1)


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
    if len(observation_space.shape) == 3:  # channels_last: the conv layout oneDNN and cuDNN prefer
        return AtariAgent(action_space.n, device).to(memory_format=torch.channels_last)
    action_dim = action_space.shape[0] if continuous else action_space.n
    return MLPAgent(int(np.prod(observation_space.shape)), action_dim, continuous, device)


# ------------------------------------------------------------------------------------------- the phases
def sample_and_logprob(agent, dist_params, action=None, noise=None):
    """Sample (when `action` is None, from `noise` as `draw_noise` draws it), log-probability and entropy."""
    if hasattr(agent, "actor_logstd"):
        return leanrl.diagonal_gaussian(dist_params, agent.actor_logstd, action, noise)
    return leanrl.categorical(dist_params, action, noise)


def policy(agent, obs, noise=None):
    """The action sampled for `obs`, its log-probability and the state's value."""
    dist_params, value = agent(obs)
    action, logprob, _ = sample_and_logprob(agent, dist_params, noise=noise)
    return action, logprob, value


def draw_noise(envs, num_steps: int, device) -> tuple:
    """A rollout's random numbers, drawn before it: the policy's samples and, with an on-device env, its auto-reset
    states, each (num_steps, ...). Every mode uses them in the same order: the same actions from the same seed."""
    space, shape = envs.single_action_space, (num_steps, envs.num_envs)
    policy_noise = (torch.randn(*shape, space.shape[0], device=device) if space.shape else
                    torch.rand(*shape, space.n, device=device))
    return (policy_noise, envs.reset_noise(num_steps)) if envs.on_device else (policy_noise,)


def outcome(get_value, args: Args, out: dict) -> dict:
    """What the rollout stores of an env step's outcome `out` (`envs.step`'s dict): the reward (its sign with
    --clip-reward), the episode ends and statistics, and the critic's value of each true final observation (to
    bootstrap truncated episodes)."""
    stored = dict(rewards=out["reward"].sign() if args.clip_reward else out["reward"],
                  **{key: out[key] for key in ("terminated", "truncated", "episode_return", "episode_length")})
    if args.bootstrap_truncated:
        stored["final_values"] = get_value(out["final_obs"])
    return stored


def act(policy, get_value, args: Args, env_step, obs, noise: tuple):
    """One step of an on-device env: the policy, the env, the critic. Returns the next observation and what the
    rollout stores of the step, by storage key."""
    action, logprob, value = policy(obs, noise[0])
    out = env_step(action, *noise[1:])
    return out["next_obs"], dict(obs=obs, actions=action, logprobs=logprob, values=value,
                                 **outcome(get_value, args, out))


def write(storage: dict, t, fields: dict):
    """`fields` into row `t` of `storage`'s tensors: `t` a one-element tensor, so that one graph writes every row."""
    for key, x in fields.items():
        storage[key][t] = x.unsqueeze(0).to(storage[key].dtype)


def act_and_store(act, storage: dict, next_obs, t, noise: tuple):
    """An on-device env's step as one call: `act` on `next_obs`, stored at row t, `next_obs` advanced in place."""
    obs, stored = act(next_obs, noise)
    write(storage, t, stored)
    next_obs.copy_(obs)


def store_and_act(policy, get_value, args: Args, storage: dict, t, out: dict, noise):
    """A host env's step as one call: store `out`, what the env returned for the last action, at row t - 1 (at t = 0
    the spare last row: it was stored at the end of the last rollout), then act on its next observation and store
    that at row t. Returns the action to send."""
    write(storage, (t - 1) % (args.num_steps + 1), outcome(get_value, args, out))
    action, logprob, value = policy(out["next_obs"], noise)
    write(storage, t, dict(obs=out["next_obs"], actions=action, logprobs=logprob, values=value))
    return action


def make_storage(envs, args: Args, device) -> TensorDict:
    """The rollout buffer, allocated once (captured graphs write its addresses): row t < num_steps is step t, the
    last row the observation after the rollout and its value, which GAE bootstraps from."""
    act_space, T, N = envs.single_action_space, args.num_steps, args.num_envs
    fields = dict(obs=(envs.single_observation_space.shape, envs.obs_dtype),
                  actions=(act_space.shape, torch.float32 if act_space.shape else torch.long),
                  terminated=((), torch.bool), truncated=((), torch.bool),
                  **dict.fromkeys(("logprobs", "values", "rewards", "final_values", "episode_return",
                                   "episode_length"), ((), torch.float32)))
    return TensorDict({key: torch.zeros(T + 1, N, *shape, dtype=dtype, device=device) for key, (shape, dtype) in
                       fields.items()}, batch_size=[T + 1, N], device=device)


@torch.no_grad()
def rollout_on_device(step, get_value, envs, next_obs, storage, args: Args):
    """`num_steps` calls of `step(t, noise)` (`act_and_store`), then the last observation's value."""
    noise = draw_noise(envs, args.num_steps, next_obs.device)
    rows = torch.arange(args.num_steps, device=next_obs.device).view(-1, 1)
    for t in range(args.num_steps):
        step(rows[t], tuple(n[t] for n in noise))
    storage["values"][-1] = get_value(next_obs)


@torch.no_grad()
def scanned_rollout(scanned, get_value, envs, next_obs, storage, args: Args):
    """`rollout_on_device` as one call: `scanned` is `act` over the whole rollout, a compiled scan
    (`leanrl.scan_env_steps`)."""
    last_obs, stored = scanned(next_obs, draw_noise(envs, args.num_steps, next_obs.device))
    for key, x in stored.items():  # (a dict into a TensorDict costs more than the scan)
        storage[key][:-1].copy_(x)
    next_obs.copy_(last_obs)
    storage["values"][-1] = get_value(next_obs)


@torch.no_grad()
def rollout(steps: list, envs, outs: list, args: Args):
    """`num_steps` steps of host envs, for each of their buffers (`leanrl.EnvBuffers`; else the envs are one) one
    call of its `steps[b](t, out, noise)` (`store_and_act`) between the buffer's `recv` and `send`: while the policy
    acts on one buffer, the others step in the background. A last call per buffer stores the last step and values
    the observation after it. `outs`: each buffer's last step, advanced in place."""
    T, buffers = args.num_steps, getattr(envs, "buffers", [envs])
    # each step's random numbers, the last step's again for the last call (whose action is not taken)
    noise = draw_noise(envs, T, outs[0]["next_obs"].device)[0][list(range(T)) + [T - 1]]
    noise = noise.split([b.num_envs for b in buffers], dim=1)
    rows = torch.arange(T + 1, device=noise[0].device).view(-1, 1)
    for t in range(T + 1):
        for b, buffer in enumerate(buffers):
            if t:
                outs[b] = buffer.recv()
            action = steps[b](rows[t], outs[b], noise[b][t])
            if t < T:
                buffer.send(action)


def stepwise_rollout(fast, policy, get_value, args: Args, envs, storage, next_obs, boundary=None):
    """The rollout as `collect()`, one call accelerated with `fast` (a `leanrl.Acceleration`) per env step (per
    buffer for host envs in `leanrl.EnvBuffers`), with `boundary()` before each (an async collector's: new weights
    come in between two steps)."""
    def tagged(step):
        if boundary is None:
            return step

        def step_at_boundary(*args):
            boundary()
            return step(*args)
        return step_at_boundary

    if envs.on_device:
        step = fast(partial(act_and_store, partial(act, policy, get_value, args, envs.step), dict(storage.items()),
                            next_obs), name="act")
        return partial(rollout_on_device, tagged(step), fast(get_value, name="get_value"), envs, next_obs, storage,
                       args=args)
    sizes = [b.num_envs for b in getattr(envs, "buffers", [envs])]
    columns = [slice(sum(sizes[:b]), sum(sizes[:b + 1])) for b in range(len(sizes))]  # each buffer's envs' storage
    graph = dict(compile_kwargs=leanrl.ONE_GRAPH) if fast.cpu_compile else {}  # a CPU: one graph, no Python inside
    steps = [tagged(fast(partial(store_and_act, policy, get_value, args, {k: x[:, cols] for k, x in storage.items()}),
                         name=f"act_{b}", **graph)) for b, cols in enumerate(columns)]
    outs = [leanrl.no_step(obs) for obs in next_obs.split(sizes)]
    return partial(rollout, steps, envs, outs, args=args)


def bootstrap(storage, args: Args):
    """Value of each transition's true next state (the next row's, or where an episode was truncated its final
    observation's) and GAE's terminations."""
    s = storage[:-1]
    next_values = storage["values"][1:]
    if args.bootstrap_truncated:
        next_values = torch.where(s["truncated"], s["final_values"], next_values)
    terminated = s["terminated"] if args.bootstrap_truncated else s["terminated"] | s["truncated"]
    return next_values, terminated


def gae(rewards, values, next_values, terminated, dones, gamma: float, gae_lambda: float):
    """Generalized advantage estimation over a (num_steps, num_envs) rollout. `next_values[t]` is the value of the
    true next state of transition t (for a truncated episode, its final observation); termination cuts the
    bootstrap, any episode end cuts the recursion."""
    deltas = rewards + gamma * next_values * (~terminated) - values
    not_done = (~dones).float()
    advantages = []
    lastgaelam = torch.zeros_like(deltas[0])
    for t in reversed(range(rewards.shape[0])):
        lastgaelam = deltas[t] + gamma * gae_lambda * not_done[t] * lastgaelam
        advantages.append(lastgaelam)
    advantages = torch.stack(advantages[::-1])
    return advantages, advantages + values


def value_loss(newvalue, returns, values, clip_coef, clip_vloss: bool):
    v_loss_unclipped = (newvalue - returns) ** 2
    if clip_vloss:
        v_clipped = values + torch.clamp(newvalue - values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        return 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    return 0.5 * v_loss_unclipped.mean()


# What ppo_loss measures, then the update's gradient norm and the batch's explained variance.
UPDATE_METRICS = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/old_approx_kl",
                  "losses/approx_kl", "losses/clipfrac", "losses/grad_norm", "losses/explained_variance")


def ppo_loss(agent, obs, actions, logprobs, advantages, returns, values, *, clip_coef, clip_vloss, norm_adv,
             ent_coef, vf_coef):
    """The clipped surrogate, value and entropy loss of a minibatch, and its statistics (UPDATE_METRICS' first six)
    stacked. `clip_coef` may be a tensor annealed in place (--anneal-clip)."""
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
    v_loss = value_loss(newvalue, returns, values, clip_coef, clip_vloss)
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    return loss, torch.stack([pg_loss.detach(), v_loss.detach(), entropy_loss.detach(), old_approx_kl, approx_kl,
                              clipfrac])


MINIBATCH_KEYS = ("obs", "actions", "logprobs", "advantages", "returns", "values")  # `ppo_loss`'s arguments


def update(agent, optimizer, loss, max_grad_norm: float, *minibatch):
    """One gradient step of `loss(agent, *minibatch) -> (value, metrics)`: its metrics and gradient norm."""
    optimizer.zero_grad()
    value, metrics = loss(agent, *minibatch)
    value.backward()
    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
    optimizer.step()
    return metrics, grad_norm.detach()


def minibatches(args: Args, batch_size: int, device) -> torch.Tensor:
    """Every epoch's minibatch indices, (update_epochs * num_minibatches, minibatch_size): each epoch a random
    permutation, as the argsort of uniform noise (a CUDA graph can replay it)."""
    return torch.stack([torch.rand(batch_size, device=device).argsort() for _ in range(args.update_epochs)]).view(
        args.update_epochs * args.num_minibatches, -1)


def update_epochs(update, batch: tuple, indices) -> tuple:
    """`update` on every epoch's minibatches (`indices`' rows into each tensor of `batch`), one call each; the last
    one's outputs. `leanrl.scan_gradient_steps` makes the same function one compiled scan."""
    for mb_inds in indices:
        out = update(*(x.index_select(0, mb_inds) for x in batch))  # on uint8 frames faster than x[mb_inds]
    return out


def flat_batch(storage, advantages, returns) -> TensorDict:
    """The rollout flattened to (num_steps * num_envs,) with its advantages and returns: what the epochs sample."""
    b = storage.select("obs", "actions", "logprobs", "values").reshape(-1)
    b["advantages"], b["returns"] = advantages.reshape(-1), returns.reshape(-1)
    return b


def explained_variance(b) -> torch.Tensor:
    return 1 - (b["returns"] - b["values"]).var() / b["returns"].var()


def evaluate_policy(agent, eval_envs, statistics: dict, seed: int, own_draws: bool = True):
    """The mean return of the policy as it samples over `eval_envs`' episodes, their observations normalized with
    the training envs' `statistics` (`leanrl.evaluate`; `own_draws` as there). Eager: its batch is eval_episodes."""
    eval_envs.load_statistics(statistics)
    return leanrl.evaluate(lambda obs: policy(agent, obs)[0], eval_envs, seed, own_draws)


# ------------------------------------------------------------------------------------------- training
MAX_COMPILED_GAE_STEPS = 256  # longer rollouts run GAE uncompiled (still inside the CUDA graph with --cudagraphs)


def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace:
    """Train to `args.total_timesteps`, logging to the run directory, checkpointing every `checkpoint_every`
    iterations, at the end and on Ctrl-C/SIGTERM; resume exactly from `args.resume`. `make_eval_envs(video_folder=)`
    builds the `args.eval_episodes` envs evaluations run in (`video_folder`: where the first records, else None).
    `on_iteration(iteration, global_step)` runs after each iteration (a true return ends the run there). Returns
    the agent, optimizer, last logged values and counters."""
    device = torch.device(device or leanrl.resolve_device(args.device))
    batch_size, _, num_iterations = check_args(args)
    if args.graph_iteration and not envs.on_device:
        raise leanrl.UsageError("--graph-iteration needs an on-device env (torch/CartPole-v1, torch/Pendulum-v1)")
    if len(getattr(envs, "buffers", [envs])) != args.num_env_buffers:
        raise leanrl.UsageError(f"envs in {len(getattr(envs, 'buffers', [envs]))} buffers, num_env_buffers = "
                                f"{args.num_env_buffers}: make them with leanrl.EnvBuffers.of")
    anneals = args.anneal_lr or args.anneal_clip  # without, a resumed run may go on longer
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, () if anneals else ("total_timesteps",))
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    run_dir = leanrl.make_run_dir(args, args.env_id)
    ckpt_path = os.path.join(run_dir, "checkpoint.pt")

    # The acting copy shares the learner's storage without its autograd history (a grad-free alias). Made first, on
    # the meta device, it sizes torch's threads before anything is initialised (orthogonal init's QR depends on
    # them) or compiled (inductor sizes its loops by them).
    agent_inference = make_agent(envs.single_observation_space, envs.single_action_space, "meta")
    leanrl.set_threads(args.threads, agent_inference)
    agent = make_agent(envs.single_observation_space, envs.single_action_space, device)
    from_module(agent).data.to_module(agent_inference)
    agent_inference.requires_grad_(False)  # to_module made its slots Parameters again
    accel = leanrl.Acceleration.of(args, device)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5, **accel.flags)  # eps as CleanRL
    clip_coef = torch.tensor(args.clip_coef, device=device)  # annealed in place, where captured graphs read it
    loss = partial(ppo_loss, clip_coef=clip_coef, clip_vloss=args.clip_vloss, norm_adv=args.norm_adv,
                   ent_coef=args.ent_coef, vf_coef=args.vf_coef)

    storage = make_storage(envs, args, device)
    iteration = 0
    if resumed:  # before any capture: parameters are copied in place, the tensor learning rate is kept
        leanrl.restore_rng(resumed)
        leanrl.load_in_place(dict(agent=agent, optimizer=optimizer), resumed)
        iteration = resumed["iteration"]
        next_obs = leanrl.restore_envs(envs, resumed["envs"], resumed["next_obs"], seed=args.seed + iteration)
    else:
        next_obs = envs.reset(seed=args.seed)

    # ---- how each phase runs: every decision of the execution mode, here and nowhere else ----
    # With --graph-iteration the phases are only compiled: one CUDA graph captures the whole iteration (below).
    fast = accel.replace(cudagraphs=False) if args.graph_iteration else accel
    agent_policy, get_value = partial(policy, agent_inference), agent_inference.get_value
    if fast.cpu_compile and envs.on_device:  # a CPU has no graphs: the whole rollout one compiled scan
        # (obs cloned: a scan's output may not alias its input; the last critic pass stays eager, one per rollout)
        collect = partial(scanned_rollout, leanrl.scan_env_steps(lambda env_step, obs, noise: act(
            agent_policy, get_value, args, env_step, obs.clone(), noise), envs, fast), get_value, envs, next_obs,
            storage, args=args)
    else:  # a step one compiled call (policy, storing, and on-device the env), one CUDA graph
        collect = stepwise_rollout(fast, agent_policy, get_value, args, envs, storage, next_obs)
    # torch.compile unrolls GAE's loop: fine at Atari's 128 steps on a GPU, minutes of compile at MuJoCo's 2048
    gae_fn = fast.replace(compile=fast.compile and args.num_steps <= MAX_COMPILED_GAE_STEPS).eager_on_cpu(
        "GAE", "its loop, unrolled, compiles for longer than a whole short run saves")(gae, name="gae")
    if fast.cpu_compile:  # the epochs one compiled scan
        learn = leanrl.scan_gradient_steps(loss, agent, optimizer, args.max_grad_norm, fast)
    else:
        learn = partial(update_epochs, fast(partial(update, agent, optimizer, loss, args.max_grad_norm), name="update"))
    # ----

    def one_iteration():
        """Acting and storing, GAE, every update epoch; the last minibatch's metrics and the explained variance."""
        collect()
        next_values, terminated = bootstrap(storage, args)
        steps = storage[:-1]
        advantages, returns = gae_fn(steps["rewards"], steps["values"], next_values, terminated,
                                     steps["terminated"] | steps["truncated"], args.gamma, args.gae_lambda)
        b = flat_batch(steps, advantages, returns)
        metrics, grad_norm = learn(tuple(b[key] for key in MINIBATCH_KEYS), minibatches(args, batch_size, device))
        return *metrics.unbind(), grad_norm, explained_variance(b)

    if args.graph_iteration:
        one_iteration = leanrl.accelerate(one_iteration, cudagraphs=args.cudagraphs, device=device, name="iteration")

    def checkpoint_state():
        return dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), envs=envs.state_dict(),
                    next_obs=next_obs if envs.on_device else None,  # (a host env starts new episodes on resume)
                    global_step=iteration * batch_size, iteration=iteration)

    eval_envs = leanrl.open_eval_envs(args, make_eval_envs, run_dir)
    evaluate = eval_envs and partial(evaluate_policy, agent_inference, eval_envs, seed=args.seed + 10_000)
    logger = leanrl.Logger.from_args(args, run_dir, args.total_timesteps, start_step=iteration * batch_size,
                                     checkpoint=ckpt_path)
    with logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            frac = 1.0 - iteration / num_iterations
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)
            if args.anneal_clip:
                clip_coef.fill_(frac * args.clip_coef)
            metrics = dict(zip(UPDATE_METRICS, one_iteration()))
            metrics["charts/learning_rate"] = optimizer.param_groups[0]["lr"]
            logger.record(metrics)
            logger.record_episodes(storage["episode_return"][:-1], storage["episode_length"][:-1])
            iteration += 1
            logger.end_iteration(iteration * batch_size)
            if args.eval_every and leanrl.crossings((iteration - 1) * batch_size, iteration * batch_size,
                                                    args.eval_every) and iteration < num_iterations:
                logger.record({"charts/eval_return": evaluate(envs.statistics())})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()  # the log boundary: the one device-to-host read
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
            if on_iteration is not None and on_iteration(iteration, iteration * batch_size):
                break  # the caller ends the run here
        if eval_envs:  # the trained policy, also when a finished run is resumed only to evaluate or film it
            logger.record({"charts/eval_return": evaluate(envs.statistics())})
            logger.flush()
            eval_envs.close()
        leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
    return SimpleNamespace(agent=agent, optimizer=optimizer, logged=logger.last, iteration=iteration,
                           global_step=iteration * batch_size, run_dir=run_dir)
