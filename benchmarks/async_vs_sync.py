"""Async vs sync PPO on an env whose step time has a heavy tail (log-normal sleeps), in one run.

    python benchmarks/async_vs_sync.py [--seeds 1 2 3 --transports threads processes --max-lag 2 --no-control]

Every seed runs sync PPO and async PPO on each transport with the same hyperparameters and env-step budget.
Writes benchmarks/results/<machine>/async_vs_sync.{json,md,png}: env steps/s, trainer and collector idle
fractions, lag statistics, effective sample size, and the return reached per env step: the mean episodic
return over the whole run (the area under the return-vs-samples curve) and over its last quarter.
"""

import functools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import matplotlib
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanrl.algorithms import ppo, ppo_async  # noqa: E402
from leanrl.envs import make_env  # noqa: E402

from measure import machine_info  # noqa: E402


class SlowEnv:
    """Wraps a vector env; every step sleeps a log-normal time (median `median_ms`, log-std `sigma`), like a
    simulator or an LLM rollout whose length has a heavy tail. Not on-device: the sleep is host work."""

    on_device = False

    def __init__(self, env, median_ms, sigma, seed):
        self.env, self.median, self.sigma, self.rng = env, median_ms / 1e3, sigma, random.Random(seed)

    def step(self, action):
        self.send(action)
        return self.recv()

    def send(self, action):
        self.action = action

    def recv(self):
        time.sleep(self.median * self.rng.lognormvariate(0.0, self.sigma))
        return self.env.step(self.action)

    def __getattr__(self, name):
        return getattr(self.env, name)


def make_slow_env(env_id, num_envs, median_ms, sigma, seed=0, device="cpu"):
    return SlowEnv(make_env(env_id, num_envs, device=device, seed=seed), median_ms, sigma, seed)


@dataclass
class Bench:
    total_timesteps: int = 60_000
    seeds: tuple[int, ...] = (1, 2, 3)
    """every seed runs sync and each async transport: return per sample is compared over seeds, not one run"""
    transports: tuple[Literal["threads", "processes"], ...] = ("threads", "processes")
    control: bool = True
    """also run the same collectors with max_lag 0 (each batch waits for the previous update: no staleness, no
    speedup), which separates what staleness costs from what more envs in flight cost per sample"""
    num_collectors: int = 4
    max_lag: int = 2
    correction: Literal["decoupled", "truncated_is", "none"] = "decoupled"
    median_ms: float = 4.0
    """median env step time: at 4 ms a rollout (32 steps) takes several times the update, the regime async
    is for; at 1 ms on a 2-core machine the update dominates and async has little to hide"""
    sigma: float = 1.0
    """log-std of the step time (1.0: the slowest 1% of steps take 10x the median)"""
    update_epochs: int = 10
    machine: str | None = None
    """results folder name (default: the machine slug benchmarks/run.py uses)"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


CONTROL = "control: async-processes, max_lag 0"


def rows(run_dir):
    (path,) = [os.path.join(run_dir, d, "metrics.jsonl") for d in os.listdir(run_dir)]
    return [json.loads(line) for line in open(path)]


def run_one(b: Bench, variant: str, seed: int) -> dict:
    common = dict(env_id="torch/CartPole-v1", seed=seed, num_envs=8, num_steps=32, num_minibatches=1,
                  update_epochs=b.update_epochs, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
                  clip_coef=0.2, total_timesteps=b.total_timesteps, log_every=10, checkpoint_every=0,
                  progress=False)
    make_envs = functools.partial(make_slow_env, "torch/CartPole-v1", 8, b.median_ms, b.sigma)
    run_dir = tempfile.mkdtemp(prefix="async_vs_sync_")
    control = variant == CONTROL
    transport = "processes" if control else variant.removeprefix("async-") if variant != "sync" else "threads"
    args = ppo_async.Args(**common, run_dir=run_dir, async_=variant != "sync", num_collectors=b.num_collectors,
                          max_lag=0 if control else b.max_lag, correction=b.correction, transport=transport)
    t0 = time.perf_counter()
    if variant == "sync":
        algo = ppo.train(args, make_envs(seed=seed), torch.device("cpu"))
    else:
        algo = ppo_async.train(args, make_envs, make_env("torch/CartPole-v1", 1), torch.device("cpu"))
    wall = time.perf_counter() - t0
    curve = [(r["global_step"], r["charts/episodic_return"]) for r in rows(run_dir) if "charts/episodic_return" in r]
    returns = [v for _, v in curve]
    last = algo.logged
    return {
        "env_steps_per_s": last["charts/SPS"], "wall_s": wall,
        "trainer_idle_frac": last.get("async/trainer_idle_frac"),  # sync trains only between rollouts
        "collector_idle_frac": last.get("async/collector_idle_frac"),
        "lag_mean": last.get("async/lag_mean", 0.0), "lag_max": last.get("async/lag_max", 0.0),
        "lag_hist": [last[k] for k in sorted(k for k in last if k.startswith("async/lag_hist_"))],
        "ess": last.get("async/ess"),
        "return_mean": statistics.fmean(returns),
        "return_last_quarter": statistics.fmean(returns[-max(len(returns) // 4, 1):]),
        "curve": curve,
    }


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in ("env_steps_per_s", "wall_s", "trainer_idle_frac", "collector_idle_frac", "lag_mean", "lag_max",
                "ess", "return_mean", "return_last_quarter"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = statistics.fmean(values)
            out[key + "_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


def fmt(s, key, digits=0):
    if key not in s:
        return "—"
    return f"{s[key]:.{digits}f} ± {s[key + '_std']:.{digits}f}" if s[key + "_std"] else f"{s[key]:.{digits}f}"


def table(b: Bench, summary: dict, speedups: dict) -> str:
    variants = list(summary)
    lines = [f"Async vs sync PPO, torch/CartPole-v1 (8 envs x 32 steps) with log-normal step sleeps (median "
             f"{b.median_ms} ms, sigma {b.sigma}); {b.total_timesteps:,} env steps, seeds {list(b.seeds)}; async: "
             f"{b.num_collectors} collectors, max_lag {b.max_lag}, correction {b.correction}. Mean ± std over seeds. "
             f"Each collector owns 8 envs, so async has {b.num_collectors}x the envs in flight: the control runs "
             "those collectors without overlap (max_lag 0).",
             "", "| | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    cells = [("env steps/s (after burn-in)", "env_steps_per_s", 0), ("wall s (start-up included)", "wall_s", 1),
             ("trainer idle fraction", "trainer_idle_frac", 2), ("collector idle fraction", "collector_idle_frac", 2),
             ("lag mean", "lag_mean", 2), ("lag max", "lag_max", 0), ("ESS of proximal/behaviour", "ess", 3),
             ("return per sample: mean over the run", "return_mean", 1),
             ("return per sample: mean over the last quarter", "return_last_quarter", 1)]
    for label, key, digits in cells:
        lines.append(f"| {label} | " + " | ".join(fmt(summary[v], key, digits) for v in variants) + " |")
    lines.append("| throughput vs sync | " + " | ".join(
        "1.00x" if v == "sync" else f"{speedups[v]:.2f}x" for v in variants) + " |")
    return "\n".join(lines) + "\n"


def plot(b: Bench, runs: dict, summary: dict, path: str):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, per_seed in runs.items():
        color = None
        for i, r in enumerate(per_seed):
            steps, rets = zip(*r["curve"])
            label = f"{variant}: {summary[variant]['env_steps_per_s']:.0f} steps/s" if i == 0 else None
            (line,) = ax1.plot(steps, rets, color=color, alpha=0.8, label=label)
            color = line.get_color()
            ax2.plot([s / r["env_steps_per_s"] for s in steps], rets, color=color, alpha=0.8, label=label)
    ax1.set(xlabel="env steps", ylabel="episodic return", title=f"return per sample ({len(b.seeds)} seeds)")
    ax2.set(xlabel="seconds (steady state)", ylabel="episodic return",
            title=f"{b.num_collectors} collectors, max_lag {b.max_lag}, {b.correction}")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(b: Bench):
    out = os.path.join(b.out_dir, b.machine or machine_info(torch.device("cpu"))["slug"])
    os.makedirs(out, exist_ok=True)
    variants = ["sync", *(f"async-{t}" for t in b.transports), *([CONTROL] if b.control else [])]
    runs = {v: [] for v in variants}
    for seed in b.seeds:
        for variant in variants:
            runs[variant].append(run_one(b, variant, seed))
            r = runs[variant][-1]
            print(f"seed {seed} {variant}: {r['env_steps_per_s']:.0f} steps/s, return mean {r['return_mean']:.1f}, "
                  f"last quarter {r['return_last_quarter']:.1f}", flush=True)
    summary = {v: summarize(rs) for v, rs in runs.items()}
    speedups = {v: summary[v]["env_steps_per_s"] / summary["sync"]["env_steps_per_s"] for v in variants}
    md = table(b, summary, speedups)
    with open(os.path.join(out, "async_vs_sync.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "async_vs_sync.json"), "w") as f:
        json.dump({"settings": vars(b), "summary": summary, "speedup": speedups, "runs": runs}, f, indent=1)
    plot(b, runs, summary, os.path.join(out, "async_vs_sync.png"))
    print(md)


if __name__ == "__main__":
    main(tyro.cli(Bench))
