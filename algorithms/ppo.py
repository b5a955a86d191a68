"""PPO (Schulman et al., 2017) with CleanRL's implementation details.

Read top to bottom: arguments, networks, the phases lifted into functions (`policy`, `rollout`, `gae`, `update`)
so `leanrl.accelerate` can compile and CUDA-graph them, then `train`, whose loop is the whole algorithm.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, numpy, tensordict and
leanrl. `envs` is a vector env with torch tensors in and out: a gymnasium vector env made
with `autoreset_mode=AutoresetMode.SAME_STEP` and wrapped in `leanrl.TorchVectorEnv`, or any env of
`leanrl.envs`. It provides `num_envs`, `single_observation_space`, `single_action_space` (gymnasium spaces),
`obs_dtype`, `on_device`, `reset(seed) -> obs`, `step(action) -> TensorDict(next_obs, final_obs, reward,
terminated, truncated, episode_return, episode_length)`, `state_dict()` and `load_state_dict()`. An on-device env
(`on_device`, stepped in torch: `leanrl.envs`' torch/ ones) also takes its auto-reset noise, `step(action,
reset_noise)` with `reset_noise(num_steps)`, and steps as a pure function for a compiled scan: `carry`,
`transition(carry, action, reset_noise) -> (carry, outputs)`, `set_carry(carry)`.
"""

import functools
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
from tensordict import TensorDict, from_module
from torch._higher_order_ops.scan import scan
from torch.torch_version import TorchVersion

import leanrl


@dataclass
class Args(leanrl.RunArgs):
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
    eval_every: int = 0
    """evaluate the policy (charts/eval_return) every this many env steps, and once at the end (0: never)"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the evaluation env)"""
    capture_video: bool = False
    """record the evaluation episodes of the first evaluation env to `<run dir>/videos` (evaluates at the end
    even without --eval-every; resuming a finished run with it records the trained agent)"""


def check_args(args: Args) -> tuple[int, int, int]:
    """Fail on settings that cannot work, before any environment is built or anything compiled."""
    leanrl.check_flags(args, positive=("num_envs", "num_steps", "learning_rate", "num_minibatches", "update_epochs",
                                       "max_grad_norm", "eval_episodes"),
                       non_negative=("clip_coef", "ent_coef", "vf_coef", "eval_every"),
                       unit_interval=("gamma", "gae_lambda"))
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
        # The frames to float in one copy, already in the convolutions' channels_last layout: `obs / 255.0` made an
        # NCHW copy that oneDNN converted again, forward and backward. Eager update at the Atari minibatch on a
        # 2-core CPU: 73 ms against 97 (compiled: 68-69 ms either way, inductor already fused it).
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
    if len(observation_space.shape) == 3:
        # channels_last is the conv layout oneDNN and cuDNN prefer: at the Atari minibatch on CPU the update is
        # 1.36x faster eager and 1.14x faster compiled than with contiguous weights.
        return AtariAgent(action_space.n, device).to(memory_format=torch.channels_last)
    action_dim = action_space.shape[0] if continuous else action_space.n
    return MLPAgent(int(np.prod(observation_space.shape)), action_dim, continuous, device)


# ---------------------------------------------------------------------------- distributions, sync-free
def sample_and_logprob(agent, dist_params, action=None, noise=None):
    """Sample (when `action` is None), log-probability and entropy, written out so no validation
    check or host sync hides inside torch.distributions. `noise`: the sample's random numbers as `draw_noise`
    draws them (standard normal for a Gaussian, uniform for the Gumbel-max), drawn here if None."""
    if hasattr(agent, "actor_logstd"):  # Gaussian
        logstd = agent.actor_logstd.expand_as(dist_params)
        if action is None:
            noise = torch.randn_like(dist_params) if noise is None else noise
            action = dist_params + logstd.exp() * noise
        logprob = -((action - dist_params) ** 2) / (2 * (2 * logstd).exp()) - logstd - 0.5 * math.log(2 * math.pi)
        entropy = 0.5 + 0.5 * math.log(2 * math.pi) + logstd
        return action, logprob.sum(-1), entropy.sum(-1)
    logits = dist_params.log_softmax(-1)
    if action is None:  # Gumbel-max: an exact categorical sample drawn in-graph
        noise = torch.rand_like(logits) if noise is None else noise
        gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
        action = (logits + gumbel).argmax(-1)
    logprob = logits.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.exp() * logits).sum(-1)
    return action, logprob, entropy


# ----------------------------------------------------------------------------------- the three phases
def make_policy(agent_inference):
    def policy(obs, noise=None):
        dist_params, value = agent_inference(obs)
        action, logprob, _ = sample_and_logprob(agent_inference, dist_params, noise=noise)
        return action, logprob, value

    return policy


def draw_noise(envs, args: Args, device) -> tuple:
    """A rollout's random numbers, drawn at once before it: the policy's samples and, with an on-device env, its
    auto-reset states, each (num_steps, ...). Every mode (eager, compiled step by step, CUDA-graphed, one scan)
    uses them in the same order, so all take the same actions from the same seed."""
    space, shape = envs.single_action_space, (args.num_steps, envs.num_envs)
    policy_noise = (torch.randn(*shape, space.shape[0], device=device) if space.shape else
                    torch.rand(*shape, space.n, device=device))
    return (policy_noise, envs.reset_noise(args.num_steps)) if envs.on_device else (policy_noise,)


def make_act(policy, get_value, env_step, args: Args):
    """One step of acting: the policy, the env, and the critic on each true final observation (to bootstrap
    truncated episodes, as `final_values` in the env's output). `noise`: this step's of `draw_noise`."""
    def act(obs, *noise):
        action, logprob, value = policy(obs, noise[0])
        out = env_step(action, *noise[1:])
        if args.bootstrap_truncated:
            out["final_values"] = get_value(out["final_obs"])
        return action, logprob, value, out

    return act


def make_acting(agent_inference, envs, args: Args, wrap: dict):
    """`act` and `get_value`, accelerated. With an on-device env a whole step is one compiled call (one CUDA graph):
    each call pays guards and wrapper overhead, so on a 2-core CPU (AMD EPYC) a 128-step rollout of 4 CartPoles
    took 81 ms in one call per step, 248 ms in three (policy, env, critic), 213 ms eager. On a CPU `train` scans
    the whole rollout instead (`make_scanned_rollout`): 3.8 ms, against 18.7 ms in one call per step and 39 ms
    eager (one thread, cpu-2core-intel-xeon, one run). A host env steps eagerly between the compiled policy and
    critic."""
    policy, get_value = make_policy(agent_inference), agent_inference.get_value
    fast_value = leanrl.accelerate(get_value, name="get_value", **wrap)
    if envs.on_device:
        return leanrl.accelerate(make_act(policy, get_value, envs.step, args), name="act", **wrap), fast_value
    return make_act(leanrl.accelerate(policy, name="policy", **wrap), fast_value, envs.step, args), fast_value


def stored_step(obs, action, logprob, value, out, args: Args) -> dict:
    """What the rollout stores of a step, by storage key."""
    stored = dict(obs=obs, actions=action, logprobs=logprob, values=value,
                  rewards=out["reward"].sign() if args.clip_reward else out["reward"],
                  **{key: out[key] for key in ("terminated", "truncated", "episode_return", "episode_length")})
    if args.bootstrap_truncated:
        stored["final_values"] = out["final_values"]
    return stored


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


def loss_coefs(args: Args) -> dict:
    return dict(clip_coef=args.clip_coef, clip_vloss=args.clip_vloss, norm_adv=args.norm_adv, ent_coef=args.ent_coef,
                vf_coef=args.vf_coef)


def update_outputs(m: dict, grad_norm) -> tuple:
    """What an update returns: its minibatch's losses and statistics, in UPDATE_METRICS' order."""
    return (m["pg_loss"].detach(), m["v_loss"].detach(), m["entropy"].detach(), m["old_approx_kl"], m["approx_kl"],
            m["clipfrac"], grad_norm.detach())


def make_update(agent, optimizer, args: Args, loss=ppo_loss):
    """One gradient step on a minibatch, given as `loss`'s arguments after the agent (`ppo_loss`'s: MINIBATCH_KEYS)."""
    def update(*minibatch):
        optimizer.zero_grad()
        value, m = loss(agent, *minibatch, **loss_coefs(args))
        value.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return update_outputs(m, grad_norm)

    return update


MINIBATCH_KEYS = ("obs", "actions", "logprobs", "advantages", "returns", "values")  # `ppo_loss`'s arguments


def minibatches(args: Args, batch_size: int, device) -> torch.Tensor:
    """Every epoch's minibatch indices, (update_epochs * num_minibatches, minibatch_size): each epoch a random
    permutation, as the argsort of uniform noise (a CUDA graph can replay it)."""
    return torch.stack([torch.rand(batch_size, device=device).argsort() for _ in range(args.update_epochs)]).view(
        args.update_epochs * args.num_minibatches, -1)


def update_epochs(update, b, args: Args, keys=MINIBATCH_KEYS) -> tuple:
    """Every epoch's minibatch updates, one call each; the last one's outputs."""
    for mb_inds in minibatches(args, b.shape[0], b.device):
        mb = b[mb_inds]
        out = update(*(mb[key] for key in keys))
    return out


# A compiled scan (torch 2.13) takes fullgraph=True: without it, inductor's lowering of the scan to a loop fails on
# reading the loop index. The scan is marked cacheable: inductor's cache skips higher-order ops unless told, and
# every run then compiled the scan again (3 s of a warm start-up). The key still holds the scanned body's code.
SCAN_OPTIONS = dict(unsafe_marked_cacheable_functions={"torch.ops.higher_order.scan": torch.__version__})


def make_scanned_update(agent, optimizer, args: Args, wrap: dict, loss=ppo_loss, keys=MINIBATCH_KEYS):
    """On a CPU under --compile: `update_epochs` as one compiled call, a scan over the minibatches that carries the
    parameters and Adam's state (`leanrl.ScannableAdam`); each step is `update`'s math written as functions:
    torch.func.grad of the same `loss`, torch's gradient clipping, torch's Adam. One compiled `update` per
    minibatch is three graphs (backward and the optimizer step break it), each paying guards and Python.
    At CleanRL's CartPole settings (16 updates of 128 per iteration), one thread, cpu-2core-intel-xeon: 5.5 ms
    scanned, 19.5 ms in one compiled call per update, 27 ms eager."""
    adam = leanrl.ScannableAdam(dict(agent.named_parameters()), optimizer)

    def params_loss(params, mb):  # `loss` of the parameters the scan carries, swapped into `agent` for the call
        with torch.nn.utils.stateless._reparametrize_module(agent, params):
            return loss(agent, *mb, **loss_coefs(args))

    def scan_epochs(carry, batch, minibatch_inds, lr):
        def step(carry, mb_inds):
            grads, m = torch.func.grad(params_loss, has_aux=True)(carry[0], tuple(x[mb_inds] for x in batch))
            grad_norm = nn.utils.get_total_norm(grads.values())
            # nn.utils.clip_grads_with_norm_'s math, written out: its in-place scaling of torch.func's gradients
            # is lost inside a compiled scan (torch 2.13; the test against eager catches it)
            clip = (args.max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
            grads = {name: g * clip for name, g in grads.items()}
            return adam.step(carry, grads, lr), torch.stack(update_outputs(m, grad_norm))

        return scan(step, carry, minibatch_inds)

    scanned = leanrl.accelerate(scan_epochs, name="update", compile_kwargs=dict(fullgraph=True, options=SCAN_OPTIONS),
                                **wrap)

    def scanned_update_epochs(b):
        carry, outputs = scanned(adam.carry(), tuple(b[key] for key in keys), minibatches(args, b.shape[0], b.device),
                                 optimizer.param_groups[0]["lr"])
        adam.load(carry)
        return tuple(outputs[-1])

    return scanned_update_epochs


def make_learn(agent, optimizer, args: Args, wrap: dict, loss=ppo_loss, keys=MINIBATCH_KEYS):
    """`learn(b)`: every epoch's minibatch updates on the flat batch `b`, the last one's outputs. On a CPU under
    --compile, one scan (a CPU has no graphs: fewer, larger calls); for the MLP agents only: the Atari CNN's 4
    updates of 256 took 394 ms scanned against 289 ms in one compiled call each (418 ms eager). Else one
    accelerated `update` call per minibatch."""
    if leanrl.compiling_on_cpu(wrap) and isinstance(agent, MLPAgent):
        return make_scanned_update(agent, optimizer, args, wrap, loss, keys)
    update = leanrl.accelerate(make_update(agent, optimizer, args, loss), name="update", **wrap)
    return functools.partial(update_epochs, update, args=args, keys=keys)


MAX_COMPILED_GAE_STEPS = 256  # longer rollouts run GAE uncompiled (still inside the CUDA graph with --cudagraphs)


def make_gae(args: Args, wrap: dict):
    """`gae`, accelerated. torch.compile unrolls its loop: fine at Atari's 128 steps on a GPU, but a 2048-step
    rollout (MuJoCo) takes about 10 minutes and 800 MB to compile on CPU, for a loop that costs milliseconds eager."""
    compile = wrap["compile"] and args.num_steps <= MAX_COMPILED_GAE_STEPS and leanrl.wrap_flags(
        args, wrap["device"], eager_on_cpu="GAE: its loop, unrolled, compiles for longer than a whole short run "
        "saves")["compile"]
    return leanrl.accelerate(gae, name="gae", **{**wrap, "compile": compile})


UPDATE_METRICS = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/old_approx_kl",
                  "losses/approx_kl", "losses/clipfrac", "losses/grad_norm", "losses/explained_variance")


def make_storage(envs, args: Args, device) -> TensorDict:
    """The rollout buffer, (num_steps, num_envs), allocated once: captured graphs read and write its addresses."""
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    T, N = args.num_steps, args.num_envs
    zeros = dict(device=device)
    return TensorDict(
        obs=torch.zeros(T, N, *obs_space.shape, dtype=envs.obs_dtype, **zeros),
        actions=torch.zeros(T, N, *act_space.shape, dtype=torch.float32 if act_space.shape else torch.long, **zeros),
        logprobs=torch.zeros(T, N, **zeros), values=torch.zeros(T, N, **zeros), rewards=torch.zeros(T, N, **zeros),
        final_values=torch.zeros(T, N, **zeros), terminated=torch.zeros(T, N, dtype=torch.bool, **zeros),
        truncated=torch.zeros(T, N, dtype=torch.bool, **zeros), episode_return=torch.zeros(T, N, **zeros),
        episode_length=torch.zeros(T, N, **zeros), batch_size=[T, N], device=device)


@torch.no_grad()
def rollout(act, get_value, envs, next_obs, storage, args: Args):
    """Acting and storing: `num_steps` steps of every env into `storage`, `next_obs` advanced in place (a captured
    iteration reads its address). Returns the value of each transition's true next state and GAE's terminations."""
    noise = draw_noise(envs, args, next_obs.device)
    for step in range(args.num_steps):
        action, logprob, value, out = act(next_obs, *(n[step] for n in noise))
        # Key by key: writing a TensorDict costs more than the step's compiled call, and breaks a compiled rollout.
        for key, x in stored_step(next_obs, action, logprob, value, out, args).items():
            storage[key][step] = x
        next_obs.copy_(out["next_obs"])
    return bootstrap(get_value, next_obs, storage, args)


def bootstrap(get_value, next_obs, storage, args: Args):
    """Value of each transition's true next state (the next stored value, or the final observation's), and GAE's
    terminations."""
    s = storage
    next_values = torch.cat([s["values"][1:], get_value(next_obs).unsqueeze(0)])
    if args.bootstrap_truncated:
        next_values = torch.where(s["truncated"], s["final_values"], next_values)
    terminated = s["terminated"] if args.bootstrap_truncated else s["terminated"] | s["truncated"]
    return next_values, terminated


def make_scanned_rollout(agent_inference, envs, args: Args, wrap: dict):
    """With an on-device env on a CPU, under --compile: the whole rollout as one compiled call, a scan over the
    steps (torch's scan operator) whose loop runs in inductor's C++ wrapper, so guards and Python are paid once
    per rollout, not once per step (timed in `make_acting`'s docstring). Same contract as `rollout`, the env's state
    carried through the scan and written back after it. Not on CUDA, where one graph per step already removes
    that cost, and not for the async collectors, which take in-flight weights between steps."""
    policy = make_policy(agent_inference)

    def step(carry, noise):  # `act`, with the env's state passed along instead of written
        (obs, env_carry), (policy_noise, reset_noise) = carry, noise
        action, logprob, value = policy(obs, policy_noise)
        env_carry, out = envs.transition(env_carry, action, reset_noise)
        if args.bootstrap_truncated:
            out["final_values"] = agent_inference.get_value(out["final_obs"])
        # obs cloned: a scan's output may not alias its input
        return (out["next_obs"], env_carry), stored_step(obs.clone(), action, logprob, value, out, args)

    # torch 2.11's C++ wrapper cannot emit the scan's loop (AssertionError in codegen_while_loop); the Python one can
    options = dict(SCAN_OPTIONS, cpp_wrapper=TorchVersion(torch.__version__) >= "2.13")
    scanned = leanrl.accelerate(lambda obs, env_carry, noise: scan(step, (obs, env_carry), noise), name="rollout",
                                compile_kwargs=dict(fullgraph=True, options=options), **wrap)

    @torch.no_grad()
    def scanned_rollout(next_obs, storage):
        (last_obs, env_carry), stored = scanned(next_obs, envs.carry, draw_noise(envs, args, next_obs.device))
        for key, x in stored.items():
            storage[key].copy_(x)
        envs.set_carry(env_carry)
        next_obs.copy_(last_obs)
        # The last critic pass eager: one small call per rollout, not worth a graph to trace at start-up
        return bootstrap(agent_inference.get_value, next_obs, storage, args)

    return scanned_rollout


def flat_batch(storage, advantages, returns) -> TensorDict:
    """The rollout flattened to (num_steps * num_envs,) with its advantages and returns: what the epochs sample."""
    b = storage.select("obs", "actions", "logprobs", "values").reshape(-1)
    b["advantages"], b["returns"] = advantages.reshape(-1), returns.reshape(-1)
    return b


def explained_variance(b) -> torch.Tensor:
    return 1 - (b["returns"] - b["values"]).var() / b["returns"].var()


def make_evaluation(agent_inference, eval_envs, args: Args, statistics, own_draws=True):
    """evaluate() -> the mean return of the policy as it samples over `eval_envs`' episodes, their observations
    normalized as in training: with `statistics()` (the training envs' `statistics()`) at each call. `own_draws`: as
    in `leanrl.evaluate`."""
    policy = make_policy(agent_inference)  # eager: its batch is eval_episodes, not num_envs

    def evaluate():
        eval_envs.load_statistics(statistics())
        return leanrl.evaluate(lambda obs: policy(obs)[0], eval_envs, args.seed + 10_000, own_draws)

    return evaluate


# ------------------------------------------------------------------------------------------- training
def train(args: Args, envs, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace:
    """Train to `args.total_timesteps`; log to the run directory (see `leanrl.Logger`); checkpoint every
    `checkpoint_every` iterations, at the end and on Ctrl-C/SIGTERM; resume exactly from `args.resume`.
    `make_eval_envs(video_folder=...)` builds the `args.eval_episodes` envs that evaluations run in (`video_folder`:
    where the first one records its episodes, with `--capture-video`; else None).
    `on_iteration(iteration, global_step)` is called after each iteration (benchmarks time with it). Returns the
    agent, optimizer, last logged values and counters."""
    device = device or leanrl.resolve_device(args.device)
    batch_size, _, num_iterations = check_args(args)
    if args.graph_iteration and not envs.on_device:
        raise leanrl.UsageError("--graph-iteration needs an on-device env (torch/CartPole-v1, torch/Pendulum-v1)")
    evaluating = args.eval_every > 0 or args.capture_video
    if evaluating and make_eval_envs is None:
        raise leanrl.UsageError("--eval-every / --capture-video: train() was given no make_eval_envs")
    # Without annealing no schedule depends on the horizon: a resumed run may go on longer.
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, () if args.anneal_lr else ("total_timesteps",))
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
    wrap = leanrl.wrap_flags(args, device)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5, **wrap)  # eps as CleanRL

    # With --graph-iteration the phases are only compiled: one outer graph captures them all.
    wrap["cudagraphs"] = args.cudagraphs and not args.graph_iteration
    if leanrl.compiling_on_cpu(wrap) and envs.on_device:  # a CPU has no graphs: one scan
        collect = make_scanned_rollout(agent_inference, envs, args, wrap)
    else:
        collect = functools.partial(rollout, *make_acting(agent_inference, envs, args, wrap), envs, args=args)
    gae_fn = make_gae(args, wrap)
    learn = make_learn(agent, optimizer, args, wrap)
    storage = make_storage(envs, args, device)

    iteration = 0
    if resumed:  # before any capture: parameters are copied in place, the tensor learning rate is kept
        state = resumed
        leanrl.restore_rng(state)
        agent.load_state_dict(state["agent"])
        leanrl.load_optimizer_state(optimizer, state["optimizer"])
        iteration = state["iteration"]
        next_obs = leanrl.restore_envs(envs, state["envs"], state["next_obs"], seed=args.seed + iteration)
    else:
        next_obs = envs.reset(seed=args.seed)

    def one_iteration():
        """Acting and storing, GAE, every update epoch; the last minibatch's metrics and the explained variance."""
        next_values, terminated = collect(next_obs, storage)
        advantages, returns = gae_fn(storage["rewards"], storage["values"], next_values, terminated,
                                     storage["terminated"] | storage["truncated"], args.gamma, args.gae_lambda)
        b = flat_batch(storage, advantages, returns)
        return (*learn(b), explained_variance(b))

    if args.graph_iteration:
        one_iteration = leanrl.accelerate(one_iteration, cudagraphs=args.cudagraphs, device=device, name="iteration")

    def checkpoint_state():
        return dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), envs=envs.state_dict(),
                    next_obs=next_obs, global_step=iteration * batch_size, iteration=iteration)

    if evaluating:
        eval_envs = make_eval_envs(video_folder=os.path.join(run_dir, "videos") if args.capture_video else None)
        evaluate = make_evaluation(agent_inference, eval_envs, args, envs.statistics)

    logger = leanrl.Logger.from_args(args, run_dir, args.total_timesteps, start_step=iteration * batch_size,
                                     checkpoint=ckpt_path)
    with logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"].fill_((1.0 - iteration / num_iterations) * args.learning_rate)
            metrics = dict(zip(UPDATE_METRICS, one_iteration()))
            metrics["charts/learning_rate"] = optimizer.param_groups[0]["lr"]
            logger.record(metrics)
            logger.record_episodes(storage["episode_return"], storage["episode_length"])
            iteration += 1
            logger.end_iteration(iteration * batch_size)
            if args.eval_every and leanrl.crossings((iteration - 1) * batch_size, iteration * batch_size,
                                                    args.eval_every) and iteration < num_iterations:
                logger.record({"charts/eval_return": evaluate()})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()  # the log boundary: the one device-to-host read
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
            if on_iteration is not None:
                on_iteration(iteration, iteration * batch_size)
        if evaluating:  # the trained policy, also when a finished run is resumed only to evaluate or film it
            logger.record({"charts/eval_return": evaluate()})
            logger.flush()
            eval_envs.close()
        leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
    return SimpleNamespace(agent=agent, optimizer=optimizer, logged=logger.last, iteration=iteration,
                           global_step=iteration * batch_size, run_dir=run_dir)
