"""Learning parity: final returns of leanrl's scripts over several seeds, next to the figures CleanRL publishes for the
same task and settings (rl-baselines3-zoo's where CleanRL has none).

Every run is `python scripts/<script> --seed S ...` in a process of its own, one after the other (on 2 cores two
runs at once would time each other out of their threads); a run that finished in an earlier call (its summary
in `<runs>/<task>-<seed>.out`) is not run again, so a long table can be built over several calls. Then it writes
learning_parity.json, learning_parity.md and a plot per task (`python -m leanrl.plot`: learning_parity_<task>.png) to
benchmarks/results/<machine>/ (or --out), and prints the table.

A run's final return is the mean of its logged `charts/episodic_return` over the last tenth of its steps (the
episodes that ended there); a task's is the mean over seeds ± their standard deviation (CleanRL's tables give the
mean ± std over 3 seeds of the final returns of training episodes; rl-baselines3-zoo's, of one trained agent's
deterministic evaluation episodes). Where a task also evaluates (`--eval-every`), the last deterministic
evaluation is reported next to it.

    python benchmarks/learning_parity.py [--tasks ppo_cartpole,dqn_cartpole] [--seeds 1 2 3] [--runs DIR]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from leanrl.metrics import read_metrics
from measure import git_commit, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Task:
    script: str
    flags: tuple
    """the script's flags for this task, beyond its defaults"""
    reference: str
    """whose figure, for which env version, steps and settings"""
    reference_mean: float
    reference_std: float
    differences: str = ""
    """where our run differs from the reference's (env version, steps, settings)"""
    total_timesteps: int = field(default=0)


TASKS = {
    "ppo_cartpole": Task(
        "ppo_cartpole.py", (), "CleanRL ppo.py, CartPole-v1, 500k steps (docs/rl-algorithms/ppo.md)", 490.04, 6.12,
        "rl-baselines3-zoo's CartPole settings and 100k steps (the script's defaults) against CleanRL's 500k; "
        "torch/CartPole-v1, gymnasium's dynamics in torch", 100_000),
    "dqn_cartpole": Task(
        "dqn_cartpole.py", ("--compile",), "CleanRL dqn.py, CartPole-v1, 500k steps (docs/rl-algorithms/dqn.md)",
        488.69, 16.11, "torch/CartPole-v1, gymnasium's dynamics in torch; --compile", 500_000),
    "ppo_halfcheetah": Task(
        "ppo_continuous.py", ("--env-id", "HalfCheetah-v5", "--compile"),
        "CleanRL ppo_continuous_action.py, HalfCheetah-v4, 1M steps (docs/benchmark/ppo_continuous_action.md)",
        1442.64, 46.03, "HalfCheetah-v5 against v4; --compile", 1_000_000),
    "ppo_hopper": Task(
        "ppo_continuous.py", ("--env-id", "Hopper-v5", "--compile"),
        "CleanRL ppo_continuous_action.py, Hopper-v4, 1M steps (docs/benchmark/ppo_continuous_action.md)",
        2382.86, 271.74, "Hopper-v5 against v4; --compile", 1_000_000),
    "td3_pendulum": Task(
        "td3_continuous.py", ("--env-id", "Pendulum-v1", "--learning-starts", "5000", "--eval-every", "50000",
                              "--compile"),
        "rl-baselines3-zoo TD3, Pendulum-v1, 20k steps, tuned (benchmark.md; deterministic evaluation)", -151.86,
        90.23, "CleanRL's TD3 settings but 50k steps and learning_starts 5k (CleanRL publishes no Pendulum run); "
        "--compile", 50_000),
    "sac_pendulum": Task(
        "sac_continuous.py", ("--env-id", "Pendulum-v1", "--eval-every", "50000", "--compile"),
        "rl-baselines3-zoo SAC, Pendulum-v1, 20k steps, tuned (benchmark.md; deterministic evaluation)", -157.00,
        88.71, "CleanRL's SAC settings (learning_starts 5k) and 50k steps (CleanRL publishes no Pendulum run); "
        "--compile", 50_000),
}

SUMMARY = re.compile(r"^run: +(\S+)$", re.M)


def run_one(name: str, task: Task, seed: int, runs: str) -> str:
    """The run directory of `task` at `seed`: run now, or found from an earlier call's finished run."""
    out = os.path.join(runs, f"{name}-{seed}.out")
    if os.path.isfile(out):
        with open(out) as f:
            text = f.read()
        # a finished run's summary: "N steps of TOTAL in ..." (PPO's N: whole batches), an interrupted one's "stopped"
        if (match := SUMMARY.search(text)) and f" steps of {task.total_timesteps:,} in " in text:
            return match[1]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", task.script), *task.flags, "--seed", str(seed),
           "--total-timesteps", str(task.total_timesteps), "--exp-name", name, "--run-dir", os.path.join(runs, name),
           "--no-progress", "--checkpoint-every", "0"]
    print(f"{name} seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{name} seed {seed} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    with open(out, "w") as f:
        f.write(proc.stdout)
    print(f"{name} seed {seed}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return SUMMARY.search(proc.stdout)[1]


def final(run_dir: str, total: int) -> dict:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    last = [r["charts/episodic_return"] for r in rows
            if "charts/episodic_return" in r and r["global_step"] > 0.9 * total]
    evals = [r["charts/eval_return"] for r in rows if "charts/eval_return" in r]
    sps = [r["charts/SPS"] for r in rows if "charts/SPS" in r]
    return dict(run_dir=run_dir, final_return=statistics.fmean(last), logged_points=len(last),
                eval_return=evals[-1] if evals else None, sps=sps[-1] if sps else None)


def plot_name(task: str) -> str:
    return f"learning_parity_{task}.png"  # beside benchmarks/run.py's charts, which are named by entry


def spread(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {std:.2f}"


def markdown(result: dict) -> str:
    lines = [f"# Learning parity ({result['machine']['slug']}, {result['created']})", "",
             "Final return: each run's mean logged episodic return over its last tenth of steps; mean ± std over "
             "seeds. Eval: the last deterministic evaluation (10 episodes), where the task evaluates. Command: "
             "`python benchmarks/learning_parity.py`. Commit: the code a task's runs ran (a table is built over "
             "several calls).", "",
             "| task | command | seeds | final return | eval | reference | reference's figure | differences | commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["tasks"].items():
        task = TASKS[name]
        command = "`" + " ".join(["python", f"scripts/{task.script}", *task.flags, "--total-timesteps",
                                  str(task.total_timesteps)]) + "`"
        lines.append(f"| {name} | {command} | {', '.join(str(s) for s in r['seeds'])} | "
                     f"{spread([s['final_return'] for s in r['runs']])} | {spread([s['eval_return'] for s in r['runs']])}"
                     f" | {task.reference} | {task.reference_mean:.2f} ± {task.reference_std:.2f} | "
                     f"{task.differences} | {r.get('commit') or '—'}, {r.get('date') or '—'} |")
    lines += ["", "Per run (seed: final return, eval, env-steps/s):", ""]
    for name, r in result["tasks"].items():
        per = "; ".join(f"{seed}: {s['final_return']:.1f}"
                        + (f", eval {s['eval_return']:.1f}" if s["eval_return"] is not None else "")
                        + (f", {s['sps']:,.0f} SPS" if s["sps"] else "") for seed, s in zip(r["seeds"], r["runs"]))
        lines.append(f"- {name}: {per}; curves: `{plot_name(name)}`")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "learning_parity"),
                   help="where the runs go (and are found again)")
    p.add_argument("--out", help="results folder (default: benchmarks/results/<machine>)")
    a = p.parse_args()
    names = a.tasks.split(",")
    for name in names:
        if name not in TASKS:
            p.error(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    machine = machine_info(torch.device("cpu"))
    out = a.out or os.path.join(HERE, "results", machine["slug"])
    os.makedirs(out, exist_ok=True)
    os.makedirs(a.runs, exist_ok=True)
    path = os.path.join(out, "learning_parity.json")
    result = dict(machine=machine, created=time.strftime("%Y-%m-%d"), tasks={})
    if os.path.isfile(path):  # the tasks of earlier calls stay in the table
        with open(path) as f:
            result["tasks"] = json.load(f)["tasks"]
    for name in names:
        task = TASKS[name]
        dirs = [run_one(name, task, seed, a.runs) for seed in a.seeds]
        result["tasks"][name] = dict(task=asdict(task), seeds=a.seeds, commit=git_commit(),
                                     date=time.strftime("%Y-%m-%d"), runs=[final(d, task.total_timesteps) for d in dirs])
        subprocess.run([sys.executable, "-m", "leanrl.plot", *dirs, "--out", os.path.join(out, plot_name(name)),
                        "--smooth", "5"], check=True, capture_output=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        text = markdown(result)
        with open(os.path.join(out, "learning_parity.md"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
