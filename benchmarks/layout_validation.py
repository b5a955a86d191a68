"""The layout planner against measured async PPO runs (collectors and a trainer: the two-pool system).

    python benchmarks/layout_validation.py [--total-timesteps 24000]

Calibration, right before the runs, on the same machine: (1) a collector's rollout time, measured on one
collector alone with the slow env of the setting (policy, env and sleep overshoot included), as an empirical
distribution; (2) the trainer's time per batch (GAE, proximal log-probs and the update epochs of AsyncPPO's
own train_iteration on a real batch). The planner (closed form and simulator) gets only those and the
settings; each run's env steps/s (charts/SPS, after burn-in), mean lag and idle fractions are compared.
Writes benchmarks/results/<machine>/layout_validation.{json,md}.
"""

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro

from leanrl import layout
from leanrl.algorithms import ppo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from async_vs_sync import make_slow_env, rows  # noqa: E402
from measure import machine_info  # noqa: E402

TICK = 1e-4  # the simulator's decode step for PPO: a rollout of d seconds is a "sequence" of d / TICK steps


@dataclass
class Bench:
    total_timesteps: int = 24_000
    """env steps per validation run"""
    calib_rollouts: int = 40
    """rollouts timed per env setting for the collector calibration"""
    calib_updates: int = 15
    """trainer iterations timed per update_epochs value"""
    machine: str | None = None
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# (collectors, max_lag, update_epochs, median_ms, sigma): the trainer time is set by update_epochs, the
# collector time by the env's step time distribution
SETTINGS = [(2, 1, 10, 4.0, 1.0), (4, 2, 10, 4.0, 1.0), (4, 1, 20, 2.0, 0.5), (3, 3, 30, 4.0, 1.5),
            (6, 2, 5, 4.0, 1.0)]


def ppo_args(run_dir, collectors, max_lag, epochs, total):
    return ppo.Args(env_id="torch/CartPole-v1", seed=1, num_envs=8, num_steps=32, num_minibatches=1,
                    update_epochs=epochs, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
                    clip_coef=0.2, total_timesteps=total, log_every=1, checkpoint_every=0, progress=False,
                    run_dir=run_dir, async_=True, num_collectors=collectors, max_lag=max_lag,
                    correction="decoupled", transport="processes")


def rollout_times(median_ms, sigma, n):
    """A lone collector's rollout durations (s) with this env (its first two are warm-up, dropped)."""
    algo = ppo.PPO(ppo_args(None, 1, 1, 1, 256), make_slow_env("torch/CartPole-v1", 8, median_ms, sigma, seed=7),
                   torch.device("cpu"))
    algo.reset(7)
    out = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        algo.rollout()
        out.append(time.perf_counter() - t0)
    return out[2:]


class _OneBatch:
    """Stands in for the pipeline's trainer side in the timing of AsyncPPO.train_iteration: always the same
    real batch, no transport (what the transport adds shows up as the validation error)."""

    def __init__(self, batch):
        self.batch, self.stats = batch, self

    def next_batch(self):
        return self.batch

    def publish(self):
        pass

    def summary(self):
        return {}


def trainer_time(epochs, n):
    args = ppo_args(tempfile.mkdtemp(), 1, 1, epochs, 256 * 1000)
    make_envs = functools.partial(make_slow_env, "torch/CartPole-v1", 8, 0.0, 0.0)
    collector = ppo.PPO(args, make_envs(seed=3), torch.device("cpu"))
    collector.reset(3)
    next_values, terminated = collector.rollout()
    batch = ppo.async_batch_template(collector.storage)
    batch.update_(collector.storage)
    batch["next_values"].copy_(next_values)
    batch["gae_terminated"].copy_(terminated)
    algo = ppo.AsyncPPO(args, make_envs, torch.device("cpu"))
    algo.trainer = _OneBatch(batch)

    class Sink:
        def record(self, *a, **k):
            pass

        record_episodes = record

    times = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        algo.train_iteration(Sink())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the median: other jobs share the cores


def measured_run(collectors, max_lag, epochs, median_ms, sigma, total):
    run_dir = tempfile.mkdtemp(prefix="layout_val_")
    args = ppo_args(run_dir, collectors, max_lag, epochs, total)
    make_envs = functools.partial(make_slow_env, "torch/CartPole-v1", 8, median_ms, sigma)
    t0 = time.perf_counter()
    algo = ppo.train_async(args, make_envs, torch.device("cpu"))
    return dict(algo.logged, wall_s=time.perf_counter() - t0, metrics=rows(run_dir))


def planner_setup(collectors, max_lag, durations, train_s):
    """PPO as the planner's two-pool system: a collector is a replica with one slot, a rollout a sequence of
    duration/TICK steps of TICK each, one rollout per optimizer step, consumed in ticket order."""
    lengths = layout.Lengths("empirical", values=tuple(max(round(d / TICK), 1) for d in durations))
    return layout.Setup(total_gpus=collectors + 1, model=layout.Model(1e4, 1, 1, 1), gpu=layout.GPUS["CPU"],
                        lengths=lengths, batch=1, max_lag=max_lag, mode="pipelined", train_step_s=train_s,
                        pause_s=0.0, latency=layout.LatencyCurve((1,), (TICK,)), consume="ticket")


def main(b: Bench):
    out = os.path.join(b.out_dir, b.machine or machine_info(torch.device("cpu"))["slug"])
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    calib_roll, calib_train = {}, {}
    for _, _, epochs, median_ms, sigma in SETTINGS:
        if (median_ms, sigma) not in calib_roll:
            calib_roll[(median_ms, sigma)] = rollout_times(median_ms, sigma, b.calib_rollouts)
        if epochs not in calib_train:
            calib_train[epochs] = trainer_time(epochs, b.calib_updates)
    t_calib = time.perf_counter() - t_start
    print(f"calibration {t_calib:.0f} s: rollout means " + ", ".join(
        f"{k}: {statistics.fmean(v) * 1e3:.1f} ms" for k, v in calib_roll.items()) + "; trainer " + ", ".join(
        f"{k} epochs: {v * 1e3:.1f} ms" for k, v in calib_train.items()), flush=True)
    results = []
    for collectors, max_lag, epochs, median_ms, sigma in SETTINGS:
        s = planner_setup(collectors, max_lag, calib_roll[(median_ms, sigma)], calib_train[epochs])
        pred = layout.predict(s, collectors, 1)
        sim = layout.simulate(s, collectors, 1, steps=400, warmup=20)
        m = measured_run(collectors, max_lag, epochs, median_ms, sigma, b.total_timesteps)
        steps_per_batch = 8 * 32
        row = dict(collectors=collectors, max_lag=max_lag, update_epochs=epochs, median_ms=median_ms, sigma=sigma,
                   rollout_s=statistics.fmean(calib_roll[(median_ms, sigma)]), train_s=calib_train[epochs],
                   measured_sps=m["charts/SPS"], model_sps=pred.seqs_per_s * steps_per_batch,
                   sim_sps=sim.seqs_per_s * steps_per_batch, measured_lag=m["async/lag_mean"],
                   model_lag=pred.lag_mean, sim_lag=sim.lag_mean, bound=pred.bound,
                   measured_trainer_idle=m.get("async/trainer_idle_frac"), model_trainer_idle=pred.trainer_idle,
                   sim_trainer_idle=sim.trainer_idle, measured_collector_idle=m.get("async/collector_idle_frac"),
                   model_collector_idle=pred.sampler_idle, sim_collector_idle=sim.sampler_idle,
                   measured_lag_hist=[m[k] for k in sorted(k for k in m if k.startswith("async/lag_hist_"))],
                   sim_lag_hist=sim.lag_hist, wall_s=m["wall_s"])
        for who in ("model", "sim"):
            row[f"{who}_sps_err"] = row[f"{who}_sps"] / row["measured_sps"] - 1
            row[f"{who}_lag_err"] = row[f"{who}_lag"] - row["measured_lag"]
        results.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if "hist" not in k},
              flush=True)
    load_after = os.getloadavg()
    info = dict(machine=machine_info(torch.device("cpu")), load_before=load_before, load_after=load_after,
                calibration_s=t_calib, total_s=time.perf_counter() - t_start, tick_s=TICK,
                total_timesteps=b.total_timesteps, results=results)
    with open(os.path.join(out, "layout_validation.json"), "w") as f:
        json.dump(info, f, indent=1)
    md = table(info)
    with open(os.path.join(out, "layout_validation.md"), "w") as f:
        f.write(md)
    print(md)


def table(info) -> str:
    lines = [f"Planner vs measured async PPO (torch/CartPole-v1, 8 envs x 32 steps per collector batch, processes "
             f"transport, {info['total_timesteps']:,} env steps per run). Calibration measured right before the "
             f"runs ({info['calibration_s']:.0f} s); whole script {info['total_s']:.0f} s. Load average (1/5/15 "
             f"min) before {tuple(round(x, 1) for x in info['load_before'])}, after "
             f"{tuple(round(x, 1) for x in info['load_after'])} on {info['machine']['cores']} cores shared with "
             "other jobs.", "",
             "| collectors | max_lag | epochs | env step (median ms, sigma) | rollout s | train s | bound | "
             "measured steps/s | model (err) | simulator (err) | measured lag | model lag (err) | sim lag (err) | "
             "trainer idle meas / model | collector idle meas / model |",
             "|---" * 15 + "|"]
    for r in info["results"]:
        lines.append(
            f"| {r['collectors']} | {r['max_lag']} | {r['update_epochs']} | {r['median_ms']}, {r['sigma']} | "
            f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['bound']} | {r['measured_sps']:.0f} | "
            f"{r['model_sps']:.0f} ({r['model_sps_err']:+.1%}) | {r['sim_sps']:.0f} ({r['sim_sps_err']:+.1%}) | "
            f"{r['measured_lag']:.2f} | {r['model_lag']:.2f} ({r['model_lag_err']:+.2f}) | "
            f"{r['sim_lag']:.2f} ({r['sim_lag_err']:+.2f}) | {r['measured_trainer_idle']:.2f} / "
            f"{r['model_trainer_idle']:.2f} | {r['measured_collector_idle']:.2f} / {r['model_collector_idle']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Bench))
