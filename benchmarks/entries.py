"""What the benchmark measures: one entry per algorithm run, with the settings its script runs.

An entry names the algorithm module (its `train(args, envs, device, on_iteration=...)` is the loop measured
end to end, the same the script calls), the script's `DEFAULTS` (the sizes measured), how the script builds its
envs, the few `Args` the benchmark changes, tiny sizes for `--quick`, and `calls`: the algorithm's accelerated
functions with inputs of the run's shapes, for per-call timing. Adding an algorithm is one entry here.
"""

import tempfile
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch
from tensordict import from_module

import leanrl
from leanrl.algorithms import dqn, ppo, sac, td3
from leanrl.envs import make_env
from leanrl.scripts import (dqn_atari, dqn_cartpole, ppo_atari, ppo_cartpole, ppo_continuous, sac_continuous,
                            td3_continuous)

# mode -> (compile, cudagraphs), the flags every script takes
MODES = {"eager": (False, False), "compile": (True, False), "cudagraphs": (False, True),
         "compile+cudagraphs": (True, True)}

# The per-call functions are bound from each algorithm's public functions as its `train` binds them (its block
# "how each phase runs"): what a run calls, on a run's shapes.


def ppo_calls(args, envs, device) -> dict:
    """PPO's step (the policy and its storing: one buffer's call per env step; an on-device env's step in it too)
    and one minibatch's update."""
    agent_inference = ppo.make_agent(envs.single_observation_space, envs.single_action_space, "meta")
    leanrl.set_threads(args.threads, agent_inference, quiet=True)
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, device)
    from_module(agent).data.to_module(agent_inference)
    agent_inference.requires_grad_(False)
    accel = leanrl.Acceleration.of(args, device)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5, **accel.flags)
    loss = partial(ppo.ppo_loss, clip_coef=torch.tensor(args.clip_coef, device=device), clip_vloss=args.clip_vloss,
                   norm_adv=args.norm_adv, ent_coef=args.ent_coef, vf_coef=args.vf_coef)
    update = accel(partial(ppo.update, agent, optimizer, loss, args.max_grad_norm), name="update")
    storage = ppo.make_storage(envs, args, device)
    mb = storage[:-1].reshape(-1)[:args.num_envs * args.num_steps // args.num_minibatches].clone()
    policy, get_value, fields = partial(ppo.policy, agent_inference), agent_inference.get_value, dict(storage.items())
    obs, noise = envs.reset(seed=args.seed), ppo.draw_noise(envs, 1, device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    if envs.on_device:
        act = accel(partial(ppo.act_and_store, partial(ppo.act, policy, get_value, args, envs.step), fields, obs),
                    name="act")
        act_inputs = (row, tuple(n[0] for n in noise))
    else:  # the first buffer's
        n = envs.num_envs // getattr(args, "num_env_buffers", 1)
        graph = dict(compile_kwargs=leanrl.ONE_GRAPH) if accel.cpu_compile else {}
        act = accel(partial(ppo.store_and_act, policy, get_value, args, {k: x[:, :n] for k, x in fields.items()}),
                    name="act", **graph)
        act_inputs = (row, leanrl.no_step(obs[:n]), noise[0][0][:n])
    return dict(act=(act, act_inputs), update=(update, (
        mb["obs"], mb["actions"], mb["logprobs"], torch.randn_like(mb["values"]), torch.randn_like(mb["values"]),
        mb["values"])))


def scratch_logger(args, device) -> leanrl.Logger:
    """A Logger for a learner's episode statistics outside a run."""
    return leanrl.Logger(tempfile.mkdtemp(prefix="leanrl-calls-"), {}, 1, progress=False, summary=False,
                         device=device)


def box_calls(module, args, envs, device) -> dict:
    """TD3's or SAC's policy and its learner's full step (store, sample, the critic's and the actor's gradient
    steps, the targets' move) on a buffer of one batch."""
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    name = module.__name__.rsplit(".", 1)[-1]
    learner = (td3.TD3 if module is td3 else sac.SAC)(obs_space, act_space, args, device)
    leanrl.set_threads(args.threads, learner.actor, learner.q_params, quiet=True)
    replay = leanrl.Replay.of_transitions(args, obs_space, act_space, device)
    logger = scratch_logger(args, device)
    accel = leanrl.Acceleration.of(args, device)
    why = "one observation at a time, compiling costs more than it saves"
    if module is td3:
        policy = partial(td3.explore, learner, args.exploration_noise)
        losses = [(partial(td3.critic_loss, learner, args, accel.cpu_compile), learner.q_named, learner.q_optimizer),
                  (partial(td3.actor_loss, learner), learner.actor_named, learner.actor_optimizer)]
    else:
        policy = lambda obs: sac.sample_action(learner.actor_inference, obs)[0]  # noqa: E731
        losses = [(partial(sac.critic_loss, learner, args.gamma, accel.cpu_compile), learner.q_named,
                   learner.q_optimizer),
                  (partial(sac.actor_loss, learner, accel.cpu_compile), learner.actor_named, learner.actor_optimizer)]
        if args.autotune:
            losses.append((partial(sac.alpha_loss, learner), {"log_alpha": learner.log_alpha},
                           learner.alpha_optimizer))
    policy = accel.eager_on_cpu(f"{name.upper()}'s policy", why)(policy, name="policy")
    if accel.cpu_compile:
        steps, graph = [leanrl.functional_step(*loss) for loss in losses], dict(compile_kwargs=leanrl.ONE_GRAPH)
    else:
        steps, graph = [partial(module.gradient_step, *loss) for loss in losses], {}
    hyper = args.tau if module is td3 else args
    update = accel(partial(module.learn, learner, replay, logger, (*steps, None)[:3] if module is sac else steps,
                           hyper, update=True, delayed=True), name="update", **graph)
    obs = envs.reset(seed=args.seed)
    action = module.random_actions(learner, args.num_envs)
    out = envs.step(action)
    for _ in range(-(-args.batch_size // args.num_envs)):  # a batch in the buffer before the first sample
        replay.extend(dict(obs=obs, action=action, reward=out["reward"], next_obs=out["final_obs"],
                           terminated=out["terminated"]))
    return {"policy": (policy, (obs,)), "update": (update, (obs, action, out))}


def dqn_calls(args, envs, device) -> dict:
    """DQN's policy and its learner's step with one update (store, sample, the gradient step). Calling the policy
    advances its step counter (and so epsilon), as acting would."""
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    learner = dqn.DQN(obs_space, act_space, args, device)
    accel = leanrl.Acceleration.of(args, device)
    leanrl.set_threads(args.threads, learner.q_network, quiet=True)
    replay = leanrl.Replay.of_transitions(args, obs_space, act_space, args.buffer_device or device, envs.obs_dtype,
                                          (1, *obs_space.shape[1:]) if learner.frame_stack else None)
    policy = leanrl.Acceleration.of(args, device).eager_on_cpu(
        "DQN's policy", "one observation at a time, compiling costs more than it saves")(
        partial(dqn.policy, learner, args), name="policy")
    if replay.device != device:
        gradient_step = accel(partial(dqn.gradient_step, learner, args), name="gradient_step")
        fast = leanrl.Acceleration()
    elif accel.cpu_compile:
        gradient_step = leanrl.functional_step(partial(dqn.td_loss, learner, args), learner.q_named, learner.optimizer)
        fast = accel
    else:
        gradient_step, fast = partial(dqn.gradient_step, learner, args), accel
    graph = dict(compile_kwargs=leanrl.ONE_GRAPH) if fast.cpu_compile else {}
    update = fast(partial(dqn.learn, learner, replay, scratch_logger(args, device), gradient_step, device, updates=1),
                  name="update", **graph)
    obs = envs.reset(seed=args.seed)
    action = torch.randint(0, act_space.n, (args.num_envs,), device=device)
    out = envs.step(action)
    next_obs = out["final_obs"][:, -1:] if learner.frame_stack else out["final_obs"]
    for _ in range(-(-args.batch_size // args.num_envs)):
        replay.extend(dict(obs=obs, action=action, reward=out["reward"], next_obs=next_obs,
                           terminated=out["terminated"]))
    return {"policy": (policy, (obs,)), "update": (update, (obs, action, out))}


@dataclass(frozen=True)
class Entry:
    algorithm: object
    """the algorithm module: its `train` is measured end to end"""
    defaults: object
    """the script's `DEFAULTS` (its `Args`), the sizes measured"""
    envs: Callable
    """`envs(args, device)`: the envs as the script builds them"""
    calls: Callable
    """`calls(args, envs, device)`: {name: (accelerated function, inputs)} for per-call timing"""
    overrides: dict = field(default_factory=dict)
    """`Args` overrides in every benchmark run (say why next to each)"""
    quick: dict = field(default_factory=dict)
    """`Args` overrides for --quick (CI smoke: tiny sizes, same code paths)"""


@dataclass(frozen=True)
class Scaling:
    """End-to-end env-steps/s against the number of parallel envs, with an entry's script."""
    entry: str
    sizes: tuple
    """num_envs on CPU"""
    sizes_gpu: tuple
    sizes_quick: tuple
    overrides: dict = field(default_factory=dict)
    """`Args` overrides; where a variant of the iteration (e.g. one graph per iteration) is switched on"""


def plain_envs(*fields):
    """`make_env` with the script's env arguments named by `fields`, in PPO's `num_env_buffers` buffers."""
    return lambda args, device: leanrl.EnvBuffers.of(
        partial(make_env, args.env_id, **{k: getattr(args, k) for k in fields}), args.num_envs,
        getattr(args, "num_env_buffers", 1), seed=args.seed, device=device)


def raw_envs(args, device):
    """The off-policy scripts' envs: without running normalization of observations and rewards, as CleanRL's."""
    return make_env(args.env_id, args.num_envs, device=device, seed=args.seed, normalize=False)


# Cheapest first: a run cut short by a time limit keeps the most entries (results are saved after each).
# Off-policy entries start learning as soon as a batch is in the buffer (CleanRL waits 5k to 80k random
# steps), so that the iterations measured after burn-in are learning iterations.
ENTRIES = {
    "ppo_cartpole": Entry(ppo, ppo_cartpole.DEFAULTS, plain_envs(), ppo_calls,
                          quick=dict(num_steps=16, update_epochs=2)),
    "dqn_cartpole": Entry(dqn, dqn_cartpole.DEFAULTS, plain_envs(), dqn_calls, overrides=dict(learning_starts=128),
                          quick=dict(batch_size=32, learning_starts=32)),
    "td3_continuous": Entry(td3, td3_continuous.DEFAULTS, raw_envs, partial(box_calls, td3),
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "sac_continuous": Entry(sac, sac_continuous.DEFAULTS, raw_envs, partial(box_calls, sac),
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "ppo_atari": Entry(ppo, ppo_atari.DEFAULTS, plain_envs("sticky_actions"), ppo_calls,
                       quick=dict(num_envs=2, num_steps=16)),
    # The same envs in two buffers that step in turns, each while the policy acts on the other (the script's one
    # steps them together between the policy's calls).
    "ppo_atari_2buffers": Entry(ppo, ppo_atari.DEFAULTS, plain_envs("sticky_actions"), ppo_calls,
                                overrides=dict(num_env_buffers=2), quick=dict(num_envs=2, num_steps=16)),
    # 1e6 stacked Atari frames are 35 GB: a smaller buffer changes the memory, not the time of a step.
    "dqn_atari": Entry(dqn, dqn_atari.DEFAULTS, plain_envs("sticky_actions"), dqn_calls,
                       overrides=dict(learning_starts=32, buffer_size=50_000), quick=dict(buffer_size=1_000)),
    # Its compile is the longest: `gae` unrolls a 2048-step loop.
    "ppo_continuous": Entry(ppo, ppo_continuous.DEFAULTS, plain_envs("gamma"), ppo_calls,
                            quick=dict(num_steps=64, num_minibatches=2, update_epochs=2)),
    # 8 MuJoCo envs stepped together in this process, against two buffers of 4 in worker processes that step while
    # the policy acts on the other buffer (gymnasium's AsyncVectorEnv; a machine's cores decide which is faster).
    "ppo_continuous_8envs": Entry(ppo, ppo_continuous.DEFAULTS, plain_envs("gamma"), ppo_calls,
                                  overrides=dict(num_envs=8), quick=dict(num_steps=64, num_minibatches=2,
                                                                         update_epochs=2)),
    "ppo_continuous_async_envs": Entry(ppo, ppo_continuous.DEFAULTS, plain_envs("gamma", "vectorization_mode"),
                                       ppo_calls, overrides=dict(num_envs=8, num_env_buffers=2,
                                                                 vectorization_mode="async"),
                                       quick=dict(num_steps=64, num_minibatches=2, update_epochs=2)),
}

SCALING = {
    # The step-by-step PPO iteration for now. total_timesteps: at least one batch at every size (it only
    # sets the learning-rate annealing).
    "cartpole_scaling": Scaling("ppo_cartpole", sizes=(16, 256, 4096), sizes_gpu=(256, 4096, 32768, 262144),
                                sizes_quick=(4, 32),
                                overrides=dict(env_id="torch/CartPole-v1", total_timesteps=10**10)),
}


def make_args(name: str, quick: bool, **overrides):
    """The script's `DEFAULTS` with the entry's overrides (and --quick sizes), then the caller's."""
    entry = ENTRIES[name]
    return replace(entry.defaults, **{**entry.overrides, **(entry.quick if quick else {}), **overrides})
