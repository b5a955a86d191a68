"""Async PPO: collectors act with in-flight weight updates while the trainer trains, staleness bounded by `max_lag`
(PipelineRL style), the stale data corrected (`--correction`: AReaL's decoupled PPO, PipelineRL's truncated IS, or
none). PPO's networks, rollout, GAE and update epochs are imported from `ppo.py`; this file adds the corrections,
the collector and the trainer's loop. Depends on torch, tensordict, `leanrl` (its pipeline) and `ppo.py` beside it.
"""

from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Literal

import torch
from tensordict import TensorDict, from_module

import leanrl
import leanrl.pipeline
from leanrl.algorithms import ppo
from leanrl.config import ASYNC_ONLY
from leanrl.pipeline import AsyncArgs


@dataclass
class Args(ppo.Args, AsyncArgs):
    """PPO's arguments and the pipeline's (`--async` chooses this loop in the scripts)."""

    correction: Literal["decoupled", "truncated_is", "none"] = field(default="decoupled", metadata=ASYNC_ONLY)
    """stale-data correction: decoupled PPO (AReaL), truncated IS (PipelineRL), or none (naive PPO)"""
    is_clip: float = field(default=2.0, metadata=ASYNC_ONLY)
    """truncation of the importance weights: behaviour ratio (truncated_is), proximal/behaviour (decoupled)"""


def check_args(args: Args) -> tuple[int, int, int]:
    """Fail on settings that cannot work, before any environment is built or anything compiled."""
    sizes = ppo.check_args(args)
    if args.async_:
        leanrl.pipeline.check_settings(args.transport, args.num_collectors, args.max_lag, args.deterministic,
                                       args.publish_every, args.max_restarts)
    return sizes


# ------------------------------------------------------------------------------ stale-data corrections
def truncated_is_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values, *, is_clip, clip_coef,
                      clip_vloss, norm_adv, ent_coef, vf_coef):
    """PipelineRL's off-policy policy gradient: -A * min(pi/mu, is_clip) * log pi, the importance weight to the
    behaviour policy mu truncated and detached (its gradient is pi/mu * A * grad log pi below the clip);
    value and entropy terms, and the statistics, as in `ppo.ppo_loss` (clipfrac: the truncated fraction)."""
    dist_params, newvalue = agent(obs)
    _, newlogprob, entropy = ppo.sample_and_logprob(agent, dist_params, actions)
    logratio = newlogprob - behaviour_logprobs
    weight = logratio.detach().exp().clamp(max=is_clip)
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = -(weight * advantages * newlogprob).mean()
    v_loss = ppo.value_loss(newvalue, returns, values, clip_coef, clip_vloss)
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    with torch.no_grad():
        ratio = logratio.exp()
        metrics = torch.stack([pg_loss, v_loss, entropy_loss, (-logratio).mean(), ((ratio - 1) - logratio).mean(),
                               (ratio > is_clip).float().mean()])
    return loss, metrics


def decoupled_ppo_loss(agent, obs, actions, behaviour_logprobs, proximal_logprobs, advantages, returns, values, *,
                       is_clip, clip_coef, clip_vloss, norm_adv, ent_coef, vf_coef):
    """AReaL's decoupled PPO: the clipped trust region around the proximal policy (the trainer's weights when the
    batch is consumed), each sample reweighted by proximal/behaviour (truncated at is_clip). The weight is
    positive, so w * max(-A r, -A clip(r)) = max(-wA r, -wA clip(r)): `ppo.ppo_loss` with advantages w * A."""
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    weight = (proximal_logprobs - behaviour_logprobs).exp().clamp(max=is_clip)
    return ppo.ppo_loss(agent, obs, actions, proximal_logprobs, weight * advantages, returns, values,
                        clip_coef=clip_coef, clip_vloss=clip_vloss, norm_adv=False, ent_coef=ent_coef, vf_coef=vf_coef)


MINIBATCH_KEYS = ("obs", "actions", "logprobs", "proximal_logprobs", "advantages", "returns", "values")


def corrected_loss(agent, obs, actions, behaviour_logprobs, proximal_logprobs, advantages, returns, values, *,
                   correction: str, is_clip: float, **coefs):
    """`--correction`'s loss of a minibatch given in MINIBATCH_KEYS order (its stored log-probs are the behaviour
    policy's); `coefs`: `ppo.ppo_loss`'s."""
    if correction == "decoupled":
        return decoupled_ppo_loss(agent, obs, actions, behaviour_logprobs, proximal_logprobs, advantages, returns,
                                  values, is_clip=is_clip, **coefs)
    if correction == "truncated_is":
        return truncated_is_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values,
                                 is_clip=is_clip, **coefs)
    # naive PPO on stale data: the behaviour policy taken as the old policy
    return ppo.ppo_loss(agent, obs, actions, behaviour_logprobs, advantages, returns, values, **coefs)


def logprob(agent, obs, actions):
    """The log-probability of `actions` under the agent's weights now: the proximal policy's."""
    return ppo.sample_and_logprob(agent, agent(obs)[0], actions)[1]


def processes(args: Args) -> int:
    """The processes of this run that compute at once on this machine (leanrl.set_threads shares the cores)."""
    return args.num_collectors + 1 if args.transport == "processes" else 1


# ----------------------------------------------------------------------------------------- the collector
def batch_template(storage, statistics: dict) -> TensorDict:
    """What a collector sends: the rollout storage, the version of every step, and its envs' `statistics()` after
    the rollout (the normalizers', which the trainer evaluates and checkpoints with)."""
    version = torch.zeros(storage[:-1].shape, dtype=torch.int64, device=storage.device)
    return TensorDict(rollout=storage.clone(), version=version, statistics=TensorDict(statistics))  # (on the host)


def collector(ctx, args: Args, make_envs, device, statistics: dict | None = None):
    """A collector role: PPO's rollout on its own envs, its policy reading the newest weights in place at every
    step boundary (`ctx.step_boundary()`, which also gives the version each step is tagged with). `statistics`: the
    envs' to start from (a resumed run's)."""
    seed = args.seed + 1 + ctx.rank
    leanrl.seed_everything(seed, args.torch_deterministic)
    envs = make_envs(seed=seed, device=device)
    if statistics is not None:
        envs.load_statistics(statistics)
    leanrl.set_threads(args.threads, ppo.make_agent(envs.single_observation_space, envs.single_action_space, "meta"),
                       processes=processes(args), quiet=True)  # before the init, as in ppo.train
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, device).requires_grad_(False)
    storage = ppo.make_storage(envs, args, device)
    next_obs, versions = envs.reset(seed=seed), []
    # as in ppo.train, but never one scan: new weights come in between two steps
    collect = ppo.stepwise_rollout(leanrl.Acceleration.of(args, device), partial(ppo.policy, agent), agent.get_value,
                                   args, envs, storage, next_obs, boundary=lambda: versions.append(ctx.step_boundary()))
    # each step's version: a policy call's, for each buffer of envs in turn (one call for the rollout's last row)
    sizes = torch.tensor([b.num_envs for b in getattr(envs, "buffers", [envs])])

    def state():  # what a batch starts from; a host simulator's state cannot be saved, an on-device env's can
        return dict(rng=torch.random.get_rng_state(), envs=envs.state_dict(), next_obs=next_obs.clone())

    def load_state(saved):
        torch.random.set_rng_state(saved["rng"])
        envs.load_state_dict(saved["envs"])
        next_obs.copy_(saved["next_obs"])

    try:
        for batch in ctx.batches(from_module(agent).data, batch_template(storage, envs.statistics()),
                                 state=(state, load_state) if envs.on_device else None):
            versions.clear()
            collect()
            batch["rollout"].update_(storage)
            steps = torch.tensor(versions[:args.num_steps * len(sizes)]).view(args.num_steps, len(sizes))
            batch["version"].copy_(steps.repeat_interleave(sizes, dim=1))
            batch["statistics"].update_(TensorDict(envs.statistics()))
    finally:
        envs.close()


# ------------------------------------------------------------------------------------------- the trainer
def train(args: Args, make_envs, spec, device=None, make_eval_envs=None, on_iteration=None) -> SimpleNamespace | None:
    """Async PPO to `args.total_timesteps`. `make_envs(seed=, device=)` builds one collector's envs (picklable for
    processes); `spec` has the envs' `single_observation_space`, `single_action_space` and `obs_dtype` (e.g. a
    one-env instance): the trainer owns no training env. `make_eval_envs` as in `ppo.train`: the trainer evaluates
    its own weights. With `--transport distributed`, every torchrun rank calls this; collector ranks return None.
    Logging, checkpoints and resume as `ppo.train`: collectors start new episodes, their envs' statistics (each
    collector keeps its own) from those of the newest batch the trainer consumed."""
    device = torch.device(device or leanrl.resolve_device(args.device))
    batch_size, _, num_iterations = check_args(args)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    settings = dict(max_lag=args.max_lag, deterministic=args.deterministic, publish_every=args.publish_every,
                    max_restarts=args.max_restarts)
    if args.transport == "distributed":
        from leanrl.pipeline.distributed import broadcast_from_rank_zero, is_collector_rank, join
        device = join(args.num_collectors, device)
        if is_collector_rank():
            resumed_statistics = broadcast_from_rank_zero()
            leanrl.pipeline.start("distributed", args.num_collectors, collector,
                                  (args, make_envs, device, resumed_statistics), None, None, **settings)
            return None
    state = {}
    if args.resume:  # before the collectors start, from its envs' statistics (None in a checkpoint made before)
        anneals = args.anneal_lr or args.anneal_clip  # without, a resumed run may go on longer
        state = leanrl.load_checkpoint(args.resume, args, may_change=() if anneals else ("total_timesteps",)) or {}
        if state:  # (--resume auto finds none on a first attempt)
            leanrl.restore_rng(state)
    resumed_statistics = state.get("statistics")
    if args.transport == "distributed":
        broadcast_from_rank_zero(resumed_statistics)
    run_dir = leanrl.make_run_dir(args, args.env_id)
    ckpt_path = f"{run_dir}/checkpoint.pt"

    agent_inference = ppo.make_agent(spec.single_observation_space, spec.single_action_space, "meta")
    leanrl.set_threads(args.threads, agent_inference, processes=processes(args))  # before the init, as in ppo.train
    agent = ppo.make_agent(spec.single_observation_space, spec.single_action_space, device)
    from_module(agent).data.to_module(agent_inference)
    agent_inference.requires_grad_(False)  # to_module made its slots Parameters again
    accel = leanrl.Acceleration.of(args, device)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5, **accel.flags)
    clip_coef = torch.tensor(args.clip_coef, device=device)  # annealed in place, where captured graphs read it
    loss = partial(corrected_loss, correction=args.correction, is_clip=args.is_clip, clip_coef=clip_coef,
                   clip_vloss=args.clip_vloss, norm_adv=args.norm_adv, ent_coef=args.ent_coef, vf_coef=args.vf_coef)

    # ---- how each phase runs, as in ppo.train (the rollouts are the collectors') ----
    gae_fn = accel.replace(compile=accel.compile and args.num_steps <= ppo.MAX_COMPILED_GAE_STEPS).eager_on_cpu(
        "GAE", "its loop, unrolled, compiles for longer than a whole short run saves")(ppo.gae, name="gae")
    if accel.cpu_compile and isinstance(agent, ppo.MLPAgent):  # every epoch's updates one compiled scan
        learn = leanrl.scan_gradient_steps(loss, agent, optimizer, args.max_grad_norm, accel)
    else:
        learn = partial(ppo.update_epochs, accel(partial(ppo.update, agent, optimizer, loss, args.max_grad_norm),
                                                 name="update"))
    proximal_logprob = accel(partial(logprob, agent_inference), name="logprob")
    # ----
    storage = ppo.make_storage(spec, args, device)

    iteration = 0
    if state:  # the learner resumes exactly
        agent.load_state_dict(state["agent"])
        leanrl.load_optimizer_state(optimizer, state["optimizer"])
        iteration = state["iteration"]
    statistics = TensorDict(resumed_statistics or spec.statistics())  # the newest batch's, once one is consumed

    def checkpoint_state():
        return dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), global_step=iteration * batch_size,
                    iteration=iteration, statistics=statistics.to_dict())

    eval_envs = leanrl.open_eval_envs(args, make_eval_envs, run_dir)
    # Collector threads draw from torch's generators meanwhile: the evaluation cannot set them aside.
    evaluate = eval_envs and partial(ppo.evaluate_policy, agent_inference, eval_envs, seed=args.seed + 10_000,
                                     own_draws=args.transport != "threads")
    collector_device = device if args.transport == "threads" else torch.device("cpu")
    trainer = leanrl.pipeline.start(args.transport, args.num_collectors, collector,
                                    (args, make_envs, collector_device, resumed_statistics),
                                    batch_template(storage, spec.statistics()), from_module(agent).data, **settings)
    logger = leanrl.Logger.from_args(args, run_dir, args.total_timesteps, start_step=iteration * batch_size,
                                     checkpoint=ckpt_path)
    with trainer, logger, leanrl.save_on_interrupt(ckpt_path, checkpoint_state, args):
        while iteration < num_iterations:
            frac = 1.0 - iteration / num_iterations
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)
            if args.anneal_clip:
                clip_coef.fill_(frac * args.clip_coef)
            batch = trainer.next_batch()  # valid until the publish below
            storage.update_(batch["rollout"])
            statistics.update_(batch["statistics"])  # the slot is refilled after the publish
            next_values, terminated = ppo.bootstrap(storage, args)
            steps = storage[:-1]
            advantages, returns = gae_fn(steps["rewards"], steps["values"], next_values, terminated,
                                         steps["terminated"] | steps["truncated"], args.gamma, args.gae_lambda)
            b = ppo.flat_batch(steps, advantages, returns)
            with torch.no_grad():  # the proximal policy: the weights this batch is consumed with
                b["proximal_logprobs"] = proximal_logprob(b["obs"], b["actions"])
            update_metrics, grad_norm = learn(tuple(b[key] for key in MINIBATCH_KEYS),
                                              ppo.minibatches(args, batch_size, device))
            trainer.publish()
            metrics = dict(zip(ppo.UPDATE_METRICS, (*update_metrics.unbind(), grad_norm, ppo.explained_variance(b))))
            metrics["charts/learning_rate"] = optimizer.param_groups[0]["lr"]
            metrics["async/ess"] = leanrl.effective_sample_size(b["proximal_logprobs"] - b["logprobs"])
            metrics.update(trainer.stats.summary())
            logger.record(metrics)
            logger.record_episodes(storage["episode_return"][:-1], storage["episode_length"][:-1])
            iteration += 1
            logger.end_iteration(iteration * batch_size)
            if args.eval_every and leanrl.crossings((iteration - 1) * batch_size, iteration * batch_size,
                                                    args.eval_every) and iteration < num_iterations:
                logger.record({"charts/eval_return": evaluate(statistics)})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
            if on_iteration is not None and on_iteration(iteration, iteration * batch_size):
                break  # the caller ends the run here
        if eval_envs:  # the trained policy, also when a finished run is resumed only to evaluate or film it
            logger.record({"charts/eval_return": evaluate(statistics)})
            logger.flush()
            eval_envs.close()
        leanrl.save_checkpoint(ckpt_path, checkpoint_state(), args)
    return SimpleNamespace(agent=agent, optimizer=optimizer, logged=logger.last, iteration=iteration,
                           global_step=iteration * batch_size, run_dir=run_dir, consumed=trainer.consumed)
