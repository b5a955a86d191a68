"""Async vs sync PPO on an env whose step time has a heavy tail (log-normal sleeps), in one run.

    python benchmarks/async_vs_sync.py [--total-timesteps 60000 --num-collectors 4 --max-lag 2 --median-ms 4]

Writes benchmarks/results/<machine>/async_vs_sync.{json,png}: env steps/s, trainer idle fraction, lag
statistics, and the return reached per env step (and per second) for both.
"""

import functools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import matplotlib
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from algorithms import ppo  # noqa: E402
from envs import make_env  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import machine_info  # noqa: E402


class SlowEnv:
    """Wraps a vector env; every step sleeps a log-normal time (median `median_ms`, log-std `sigma`), like a
    simulator or an LLM rollout whose length has a heavy tail. Not on-device: the sleep is host work."""

    on_device = False

    def __init__(self, env, median_ms, sigma, seed):
        self.env, self.median, self.sigma, self.rng = env, median_ms / 1e3, sigma, random.Random(seed)

    def step(self, action):
        time.sleep(self.median * self.rng.lognormvariate(0.0, self.sigma))
        return self.env.step(action)

    def __getattr__(self, name):
        return getattr(self.env, name)


def make_slow_env(env_id, num_envs, median_ms, sigma, seed=0, device="cpu"):
    return SlowEnv(make_env(env_id, num_envs, device=device, seed=seed), median_ms, sigma, seed)


@dataclass
class Bench:
    total_timesteps: int = 60_000
    num_collectors: int = 4
    max_lag: int = 2
    correction: str = "decoupled"
    median_ms: float = 4.0
    """median env step time: 4 ms makes a rollout (32 steps) take about twice the update (10 epochs), the regime
    async is for; at 1 ms on an idle 2-core machine the update dominates and async has nothing to hide"""
    sigma: float = 1.0
    """log-std of the step time (1.0: the slowest 1% of steps take 10x the median)"""
    update_epochs: int = 10
    machine: str | None = None
    """results folder name (default: the machine slug benchmarks/run.py uses, e.g. cpu-2core-intel-xeon-2-50ghz)"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def rows(run_dir):
    (path,) = [os.path.join(run_dir, d, "metrics.jsonl") for d in os.listdir(run_dir)]
    return [json.loads(line) for line in open(path)]


def main(b: Bench):
    out = os.path.join(b.out_dir, b.machine or machine_info(torch.device("cpu"))["slug"])
    os.makedirs(out, exist_ok=True)
    common = dict(env_id="torch/CartPole-v1", seed=1, num_envs=8, num_steps=32, num_minibatches=1,
                  update_epochs=b.update_epochs, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
                  clip_coef=0.2, total_timesteps=b.total_timesteps, log_every=10, checkpoint_every=0,
                  progress=False)
    make_envs = functools.partial(make_slow_env, "torch/CartPole-v1", 8, b.median_ms, b.sigma)
    results = {}
    for name in ("sync", "async"):
        run_dir = tempfile.mkdtemp(prefix=f"async_vs_sync_{name}_")
        args = ppo.Args(**common, run_dir=run_dir, async_=name == "async", num_collectors=b.num_collectors,
                        max_lag=b.max_lag, correction=b.correction)
        t0 = time.perf_counter()
        if name == "sync":
            algo = ppo.train(args, make_envs(seed=args.seed), torch.device("cpu"))
            idle = None  # not measured: the sync loop trains only between rollouts, by construction
        else:
            algo = ppo.train_async(args, make_envs, torch.device("cpu"))
        wall = time.perf_counter() - t0
        history = rows(run_dir)
        last = algo.logged
        results[name] = {
            "env_steps_per_s": last["charts/SPS"], "wall_s": wall,
            "trainer_idle_frac": last.get("async/trainer_idle_frac", idle),
            "collector_idle_frac": last.get("async/collector_idle_frac"),
            "lag_mean": last.get("async/lag_mean", 0.0), "lag_max": last.get("async/lag_max", 0.0),
            "lag_hist": [last[k] for k in sorted(k for k in last if k.startswith("async/lag_hist_"))],
            "ess": last.get("async/ess"), "final_return": last.get("charts/episodic_return"),
            "curve": [(r["global_step"], r.get("charts/episodic_return")) for r in history],
        }
    results["speedup"] = results["async"]["env_steps_per_s"] / results["sync"]["env_steps_per_s"]
    results["settings"] = vars(b) | {"env": "torch/CartPole-v1 with log-normal step sleeps", "num_envs": 8,
                                      "num_steps": 32, "transport": "threads"}
    with open(os.path.join(out, "async_vs_sync.json"), "w") as f:
        json.dump(results, f, indent=1)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("sync", "async"):
        r = results[name]
        steps, rets = zip(*[(s, v) for s, v in r["curve"] if v is not None])
        label = f"{name}: {r['env_steps_per_s']:.0f} steps/s"
        ax1.plot(steps, rets, label=label)
        ax2.plot([s / r["env_steps_per_s"] for s in steps], rets, label=label)
    ax1.set(xlabel="env steps", ylabel="episodic return", title="return per sample")
    ax2.set(xlabel="seconds (steady state)", ylabel="episodic return",
            title=f"async ({b.num_collectors} collectors, max_lag {b.max_lag}): {results['speedup']:.2f}x")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "async_vs_sync.png"), dpi=120)
    print(json.dumps({k: v for k, v in results.items() if k != "settings"} | {
        n: {k: v for k, v in results[n].items() if k != "curve"} for n in ("sync", "async")}, indent=1))


if __name__ == "__main__":
    main(tyro.cli(Bench))
