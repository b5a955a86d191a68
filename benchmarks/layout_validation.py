"""The layout planner against measured async PPO runs (collectors and a trainer: the two-pool system).

    python benchmarks/layout_validation.py [--total-timesteps 24000] [--quick]

Each setting is calibrated right before its run, on the same machine (the speed of shared cores drifts): (1) a
collector's rollout time with the slow env of the setting (`ppo.stepwise_rollout`: policy, env and sleep overshoot
included), as an empirical distribution, measured with as many collector processes rolling out at once as the setting
runs (on a CPU they share the cores; with this env, which mostly sleeps, that moved the mean by less than 2 % from a
lone collector's); (2) the trainer's time per batch (what `ppo_async.train` does with a batch, built from its pieces:
GAE, the flat batch, the proximal log-probs and the update epochs with `ppo_async.make_loss`) on a real collected
batch; (3) the handoff h, the loop's latency beyond (1) and (2) (transport, weight pickup, wake-ups, logging), from
one run of its own setting in which rollouts and updates strictly alternate. The planner (closed form and simulator)
gets only those and the settings; each run's (`ppo_async.train`) env steps/s (charts/SPS, after burn-in), mean lag
and idle fractions are compared.
Writes benchmarks/results/<machine>/layout_validation.{json,md}; `--quick` runs one small setting into a
temporary folder (a check that the script works, not a validation).
"""

import functools
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import tyro
from tensordict import from_module

import leanrl
from leanrl import layout
from leanrl.algorithms import ppo, ppo_async
from leanrl.envs import make_env

from async_vs_sync import make_slow_env
from measure import machine_info

TICK = 1e-4  # the simulator's decode step for PPO: a rollout of d seconds is a "sequence" of d / TICK steps
ENV_ID = "torch/CartPole-v1"
CPU = torch.device("cpu")


@dataclass
class Bench:
    total_timesteps: int = 24_000
    """env steps per validation run"""
    calib_rollouts: int = 40
    """rollouts timed per collector process and setting for the collector calibration"""
    calib_updates: int = 15
    """trainer iterations timed per update_epochs value"""
    quick: bool = False
    """check that the script runs: one setting, 2,560 env steps, 5 rollouts and 3 trainer iterations timed,
    written to a temporary folder (never over the committed results)"""
    machine: str | None = None
    """results folder name (default: the machine slug benchmarks/run.py uses)"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """where the machine's results folder is (ignored with --quick)"""


# (collectors, max_lag, update_epochs, median_ms, sigma): the trainer time is set by update_epochs, the
# collector time by the env's step time distribution
SETTINGS = [(2, 1, 10, 4.0, 1.0), (4, 2, 10, 4.0, 1.0), (4, 1, 20, 2.0, 0.5), (3, 3, 30, 4.0, 1.5),
            (6, 2, 5, 4.0, 1.0)]
QUICK = dict(total_timesteps=2_560, calib_rollouts=5, calib_updates=3)
# The handoff's run: one collector and max_lag 0, so rollouts and updates strictly alternate.
HANDOFF_SETTING = (1, 0, 10, 4.0, 1.0)
NUM_ENVS, NUM_STEPS = 8, 32
STEPS_PER_BATCH = NUM_ENVS * NUM_STEPS  # env steps per collector batch: the planner's sequence


def ppo_args(collectors, max_lag, epochs, total, run_dir="runs"):
    return ppo_async.Args(env_id=ENV_ID, seed=1, num_envs=NUM_ENVS, num_steps=NUM_STEPS, num_minibatches=1,
                          update_epochs=epochs, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
                          clip_coef=0.2, total_timesteps=total, log_every=1, checkpoint_every=0, progress=False,
                          run_dir=run_dir, async_=True, num_collectors=collectors, max_lag=max_lag,
                          correction="decoupled", transport="processes")


def collector_rollout(args, envs, seed):
    """A collector's rollout as `ppo_async.collector` runs it (eager, fresh weights), on `envs`: a function that
    runs one into the returned storage and returns GAE's next values and terminations."""
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, CPU).requires_grad_(False)
    storage = ppo.make_storage(envs, args, CPU)
    collect = ppo.stepwise_rollout(leanrl.Acceleration(), functools.partial(ppo.policy, agent), agent.get_value, args,
                                   envs, storage, envs.reset(seed=seed))

    def rollout():
        collect()
        return ppo.bootstrap(storage, args)
    return rollout, storage


def rollout_times(median_ms, sigma, n, seed=7):
    """A collector's rollout durations (s) with this env (its first two are warm-up, dropped)."""
    torch.set_num_threads(1)  # as a collector process (leanrl.pipeline)
    envs = make_slow_env(ENV_ID, NUM_ENVS, median_ms, sigma, seed=seed)
    rollout, _ = collector_rollout(ppo_args(1, 1, 1, 256), envs, seed=seed)
    out = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        rollout()
        out.append(time.perf_counter() - t0)
    envs.close()
    return out[2:]


def concurrent_rollout_times(collectors, median_ms, sigma, n):
    """The rollout durations of `collectors` processes rolling out at once, `n` each (pooled)."""
    with multiprocessing.get_context("spawn").Pool(collectors) as pool:
        runs = pool.starmap(rollout_times, [(median_ms, sigma, n, 7 + c) for c in range(collectors)])
    return [d for run in runs for d in run]


def trainer_time(epochs, n):
    """The trainer's seconds per batch: `ppo_async.train`'s work on a batch (copy into its storage, GAE, flat
    batch, proximal log-probs, the update epochs), built from its pieces and repeated on one real collected batch.
    The transport, the weight publish and the logging are not in it (they show up as the validation error)."""
    args = ppo_args(1, 1, epochs, 256)
    ppo_async.check_args(args)
    envs = make_env(ENV_ID, NUM_ENVS, seed=3)
    rollout, collected = collector_rollout(args, envs, seed=3)
    next_values, terminated = rollout()
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, CPU)
    agent_inference = ppo.make_agent(envs.single_observation_space, envs.single_action_space, "meta")
    from_module(agent).data.to_module(agent_inference)
    agent_inference.requires_grad_(False)
    optimizer = leanrl.make_adam(agent.parameters(), args.learning_rate, eps=1e-5,  # eager, as these runs train
                                 **leanrl.Acceleration.of(args, CPU).flags)
    loss = functools.partial(ppo_async.corrected_loss, correction=args.correction, is_clip=args.is_clip,
                             clip_coef=torch.tensor(args.clip_coef), clip_vloss=args.clip_vloss,
                             norm_adv=args.norm_adv, ent_coef=args.ent_coef, vf_coef=args.vf_coef)
    update = functools.partial(ppo.update, agent, optimizer, loss, args.max_grad_norm)
    logprob = functools.partial(ppo_async.logprob, agent_inference)
    storage = ppo.make_storage(envs, args, CPU)
    envs.close()
    times = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        storage.update_(collected)
        steps = storage[:-1]
        advantages, returns = ppo.gae(steps["rewards"], steps["values"], next_values, terminated,
                                      steps["terminated"] | steps["truncated"], args.gamma, args.gae_lambda)
        b = ppo.flat_batch(steps, advantages, returns)
        with torch.no_grad():
            b["proximal_logprobs"] = logprob(b["obs"], b["actions"])
        ppo.update_epochs(update, tuple(b[key] for key in ppo_async.MINIBATCH_KEYS),
                          ppo.minibatches(args, STEPS_PER_BATCH, CPU))
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times[2:])  # the mean, as a run's throughput sees it


def measured_run(collectors, max_lag, epochs, median_ms, sigma, total):
    make_envs = functools.partial(make_slow_env, ENV_ID, 8, median_ms, sigma)
    with tempfile.TemporaryDirectory(prefix="layout_val_") as run_dir:
        t0 = time.perf_counter()
        algo = ppo_async.train(ppo_args(collectors, max_lag, epochs, total, run_dir), make_envs,
                               make_env(ENV_ID, 1), CPU)
        return dict(algo.logged, wall_s=time.perf_counter() - t0)


def handoff_time(durations, train_s, total):
    """The planner's h for this transport: in a run where the collector and the trainer strictly alternate, a
    batch takes a rollout, an update and h (the batch's and the weights' transport, wake-ups, the trainer's
    logging), so h = 1 / (batches/s) - rollout - update. Measured at a setting of its own, not one validated; at
    least 0 (on a shared CPU the difference of three measurements can come out below)."""
    m = measured_run(*HANDOFF_SETTING, total)
    return max(STEPS_PER_BATCH / m["charts/SPS"] - statistics.fmean(durations) - train_s, 0.0)


def planner_setup(collectors, max_lag, durations, train_s, handoff_s):
    """PPO as the planner's two-pool system: a collector is a replica with one slot, a rollout a sequence of
    duration/TICK steps of TICK each, one rollout per optimizer step, consumed in ticket order."""
    lengths = layout.Lengths("empirical", values=tuple(max(round(d / TICK), 1) for d in durations))
    return layout.Setup(total_gpus=collectors + 1, model=layout.Model(1e4, 1, 1, 1), gpu=layout.GPUS["CPU"],
                        lengths=lengths, batch=1, max_lag=max_lag, mode="pipelined", train_step_s=train_s,
                        pause_s=0.0, handoff_s=handoff_s, latency=layout.LatencyCurve((1,), (TICK,)),
                        consume="ticket")


def main(b: Bench):
    settings = SETTINGS[:1] if b.quick else SETTINGS
    if b.quick:
        b = replace(b, **QUICK, out_dir=tempfile.mkdtemp(prefix="layout_validation_quick_"))
    out = os.path.join(b.out_dir, b.machine or machine_info(CPU)["slug"])
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    collectors, _, epochs, median_ms, sigma = HANDOFF_SETTING
    handoff_s = handoff_time(concurrent_rollout_times(collectors, median_ms, sigma, b.calib_rollouts),
                             trainer_time(epochs, b.calib_updates), b.total_timesteps)
    t_calib = time.perf_counter() - t_start
    print(f"handoff {handoff_s * 1e3:.1f} ms", flush=True)
    results = []
    for collectors, max_lag, epochs, median_ms, sigma in settings:
        t0 = time.perf_counter()
        durations = concurrent_rollout_times(collectors, median_ms, sigma, b.calib_rollouts)
        train_s = trainer_time(epochs, b.calib_updates)
        t_calib += time.perf_counter() - t0
        s = planner_setup(collectors, max_lag, durations, train_s, handoff_s)
        pred = layout.predict(s, collectors, 1)
        pred_h0 = layout.predict(replace(s, handoff_s=0.0), collectors, 1)  # what the handoff term changes
        sim = layout.simulate(s, collectors, 1, steps=400, warmup=20)
        m = measured_run(collectors, max_lag, epochs, median_ms, sigma, b.total_timesteps)
        row = dict(collectors=collectors, max_lag=max_lag, update_epochs=epochs, median_ms=median_ms, sigma=sigma,
                   rollout_s=statistics.fmean(durations), train_s=train_s,
                   measured_sps=m["charts/SPS"], model_sps=pred.seqs_per_s * STEPS_PER_BATCH,
                   model_h0_sps=pred_h0.seqs_per_s * STEPS_PER_BATCH,
                   sim_sps=sim.seqs_per_s * STEPS_PER_BATCH, measured_lag=m["async/lag_mean"],
                   model_lag=pred.lag_mean, sim_lag=sim.lag_mean, bound=pred.bound,
                   measured_trainer_idle=m.get("async/trainer_idle_frac"), model_trainer_idle=pred.trainer_idle,
                   sim_trainer_idle=sim.trainer_idle, measured_collector_idle=m.get("async/collector_idle_frac"),
                   model_collector_idle=pred.sampler_idle, sim_collector_idle=sim.sampler_idle,
                   measured_lag_hist=[m[k] for k in sorted(k for k in m if k.startswith("async/lag_hist_"))],
                   sim_lag_hist=sim.lag_hist, wall_s=m["wall_s"])
        row["model_h0_sps_err"] = row["model_h0_sps"] / row["measured_sps"] - 1
        for who in ("model", "sim"):
            row[f"{who}_sps_err"] = row[f"{who}_sps"] / row["measured_sps"] - 1
            row[f"{who}_lag_err"] = row[f"{who}_lag"] - row["measured_lag"]
        results.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if "hist" not in k},
              flush=True)
    load_after = os.getloadavg()
    info = dict(machine=machine_info(CPU), load_before=load_before, load_after=load_after,
                calibration_s=t_calib, handoff_s=handoff_s, total_s=time.perf_counter() - t_start, tick_s=TICK,
                total_timesteps=b.total_timesteps, results=results)
    with open(os.path.join(out, "layout_validation.json"), "w") as f:
        json.dump(info, f, indent=1)
    md = table(info)
    with open(os.path.join(out, "layout_validation.md"), "w") as f:
        f.write(md)
    print(md + f"written to {out}")


def table(info) -> str:
    lines = [f"Planner vs measured async PPO (torch/CartPole-v1, 8 envs x 32 steps per collector batch, processes "
             f"transport, {info['total_timesteps']:,} env steps per run). Each setting calibrated right before its "
             f"run ({info['calibration_s']:.0f} s in all), the handoff h = {info['handoff_s'] * 1e3:.1f} ms from a run "
             f"of its own (1 collector, max_lag 0, 10 epochs, env step 4.0 ms, sigma 1.0); whole script "
             f"{info['total_s']:.0f} s. Load average (1/5/15 "
             f"min) before {tuple(round(x, 1) for x in info['load_before'])}, after "
             f"{tuple(round(x, 1) for x in info['load_after'])} on {info['machine']['cores']} cores shared with "
             "other jobs.", "",
             "| collectors | max_lag | epochs | env step (median ms, sigma) | rollout s | train s | bound | "
             "measured steps/s | model (err) | simulator (err) | model with h = 0 (err) | measured lag | "
             "model lag (err) | sim lag (err) | trainer idle meas / model | collector idle meas / model |",
             "|---" * 16 + "|"]
    for r in info["results"]:
        lines.append(
            f"| {r['collectors']} | {r['max_lag']} | {r['update_epochs']} | {r['median_ms']}, {r['sigma']} | "
            f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['bound']} | {r['measured_sps']:.0f} | "
            f"{r['model_sps']:.0f} ({r['model_sps_err']:+.1%}) | {r['sim_sps']:.0f} ({r['sim_sps_err']:+.1%}) | "
            f"{r['model_h0_sps']:.0f} ({r['model_h0_sps_err']:+.1%}) | "
            f"{r['measured_lag']:.2f} | {r['model_lag']:.2f} ({r['model_lag_err']:+.2f}) | "
            f"{r['sim_lag']:.2f} ({r['sim_lag_err']:+.2f}) | {r['measured_trainer_idle']:.2f} / "
            f"{r['model_trainer_idle']:.2f} | {r['measured_collector_idle']:.2f} / {r['model_collector_idle']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Bench))
