"""Whole runs timed from launch to exit, start-up included: PPO CartPole, leanrl against the way people write it.

Every run is its own process, one after the other, as a user would time them:
- `reference`: benchmarks/cleanrl_ppo.py, CleanRL's eager loop (gymnasium's numpy CartPole, per-step `.cpu().numpy()`)
- `eager`: scripts/ppo_cartpole.py on torch/CartPole-v1, at the same settings
- `compile (cold)`: the same with --compile and an empty inductor cache, as on a new machine
- `compile (warm)`: again, with the cache the cold run filled (a user's second run)
With --repeats N the four take turns N times (each turn's cold run with an empty cache of its own, its warm run with
the cache that cold run filled) and the table shows each run's median and every turn's wall time: on a shared 2-core
machine one run's wall time swung by 1-3 s from one turn to the next.
The settings are CleanRL's ppo.py (128 steps per env, 4 minibatches x 4 epochs, lr 2.5e-4 annealed, gamma 0.99,
GAE lambda 0.95, clip 0.2, entropy 0.01); only the number of envs varies. Writes cpu_speed.json and cpu_speed.md
to benchmarks/results/<machine>/ and prints the table.

    python benchmarks/cpu_speed.py [--envs 4,64,256] [--total-timesteps 100000] [--runs reference,eager,...]
                                   [--repeats 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import torch

from measure import cpu_line, machine_info

# CleanRL ppo.py's defaults, in scripts/ppo_cartpole.py's flags (the reference takes the ones it varies).
CLEANRL = ["--num-steps", "128", "--num-minibatches", "4", "--update-epochs", "4", "--learning-rate", "2.5e-4",
           "--gamma", "0.99", "--gae-lambda", "0.95", "--clip-coef", "0.2", "--ent-coef", "0.01"]
RUNS = ("reference", "eager", "compile (cold)", "compile (warm)")
SUMMARY = re.compile(r"steps: +([\d,]+) steps of [\d,]+ in ([\d.]+) s(?:, ([\d,]+) SPS after ([\d.]+) s warm-up)?")


def launch(cmd: list, env: dict) -> tuple[float, str]:
    """Seconds from launch to exit, and stdout; raises with the stderr tail if the run fails."""
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:3])}... exited with {proc.returncode}: {proc.stderr[-800:]}")
    return wall, proc.stdout


def reference(num_envs: int, total: int, tmp: str) -> dict:
    result = os.path.join(tmp, "reference.json")
    wall, _ = launch([sys.executable, os.path.join(HERE, "cleanrl_ppo.py"), "--num-envs", str(num_envs),
                      "--total-timesteps", str(total), "--result", result], {})
    with open(result) as f:
        r = json.load(f)
    returns = r["episode_returns"][-20:]
    # No compile and no warm-up: its first step comes once the imports and the envs are done.
    return dict(wall_s=wall, startup_s=wall - r["train_s"], sps=r["steps"] / r["train_s"],
                final_return=sum(returns) / len(returns) if returns else None)


def leanrl_run(num_envs: int, total: int, tmp: str, flags: list, env: dict) -> dict:
    run_dir = tempfile.mkdtemp(dir=tmp)
    wall, out = launch([sys.executable, os.path.join(ROOT, "scripts", "ppo_cartpole.py"), *CLEANRL,
                        "--num-envs", str(num_envs), "--total-timesteps", str(total), "--no-progress",
                        "--checkpoint-every", "0", "--run-dir", run_dir, *flags], env)
    steps, train_s, sps, warmup_s = SUMMARY.search(out).groups()
    metrics = next(os.path.join(r, "metrics.jsonl") for r, _, files in os.walk(run_dir) if "metrics.jsonl" in files)
    with open(metrics) as f:
        returns = [m["charts/episodic_return"] for m in map(json.loads, f) if "charts/episodic_return" in m]
    # The first step after the warm-up iterations (where the compile happens) is the first steady one.
    return dict(wall_s=wall, startup_s=wall - float(train_s) + float(warmup_s or 0),
                sps=float(sps.replace(",", "")) if sps else int(steps.replace(",", "")) / float(train_s),
                final_return=returns[-1] if returns else None)


def measure(num_envs: int, total: int, runs: list, repeats: int) -> dict:
    turns = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="leanrl-cpu-speed-") as tmp:
        for turn in range(repeats):
            # Empty until this turn's cold run fills it.
            cache = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor-{turn}")}
            how = {"reference": lambda: reference(num_envs, total, tmp),
                   "eager": lambda: leanrl_run(num_envs, total, tmp, [], {}),
                   "compile (cold)": lambda: leanrl_run(num_envs, total, tmp, ["--compile"], cache),
                   "compile (warm)": lambda: leanrl_run(num_envs, total, tmp, ["--compile"], cache)}
            for run in runs:
                print(f"{num_envs} envs, turn {turn + 1}: {run}", file=sys.stderr, flush=True)
                try:
                    turns[run].append(how[run]())
                except Exception as e:
                    turns[run].append(dict(error=str(e)[:800]))
                print(f"  {turns[run][-1]}", file=sys.stderr, flush=True)
    out = {}
    for run, results in turns.items():
        if errors := [r["error"] for r in results if "error" in r]:
            out[run] = dict(status="error", reason=errors[0])
            continue
        medians = {k: statistics.median(r[k] for r in results) for k in ("wall_s", "startup_s", "sps")}
        out[run] = dict(status="ok", **medians, every_wall_s=[r["wall_s"] for r in results],
                        final_return=results[0]["final_return"])
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"## PPO CartPole, {results['total_timesteps']:,} steps, launch to exit ({m['slug']})", "",
             f"{cpu_line(m)}, {m['cores']} cores, torch {m['torch']}, {results['created']}. Each run is a process of "
             "its own, started one after the other. `start-up`: the wall time outside the steady steps: launch to the "
             "end of the warm-up iterations, compile included, and the end (the last checkpoint; the interpreter's "
             "teardown, which leanrl's scripts skip). `speed-up`: the reference's wall time over the run's. "
             f"{results['repeats']} turn(s): medians, and every turn's wall time.", "",
             "| envs | run | wall s | speed-up | every turn's wall s | start-up s | env-steps/s after start-up | "
             "final return |",
             "|---:|---|---:|---:|---|---:|---:|---:|"]
    for num_envs, runs in results["envs"].items():
        ref = runs.get("reference", {})
        for run, r in runs.items():
            if r["status"] != "ok":
                lines.append(f"| {num_envs} | {run} | error: {r['reason'][:120]} | | | | | |")
                continue
            speedup = f"{ref['wall_s'] / r['wall_s']:.2f}x" if ref.get("status") == "ok" else "-"
            ret = "-" if r["final_return"] is None else f"{r['final_return']:.0f}"
            every = ", ".join(f"{w:.1f}" for w in r["every_wall_s"])
            lines.append(f"| {num_envs} | {run} | {r['wall_s']:.1f} | {speedup} | {every} | {r['startup_s']:.1f} | "
                         f"{r['sps']:,.0f} | {ret} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default="4,64,256", help="comma-separated numbers of envs")
    p.add_argument("--total-timesteps", type=int, default=100_000)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--repeats", type=int, default=3, help="turns of the runs, one after the other; medians")
    p.add_argument("--out", help="results folder (default: benchmarks/results/<machine>)")
    a = p.parse_args()
    runs = a.runs.split(",")
    if unknown := [r for r in runs if r not in RUNS]:
        p.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if a.repeats < 1:
        p.error(f"--repeats: {a.repeats}; at least 1")
    machine = machine_info(torch.device("cpu"))
    out = a.out or os.path.join(HERE, "results", machine["slug"])
    os.makedirs(out, exist_ok=True)
    results = dict(machine=machine, created=time.strftime("%Y-%m-%d %H:%M"), total_timesteps=a.total_timesteps,
                   repeats=a.repeats, envs={n: measure(int(n), a.total_timesteps, runs, a.repeats)
                                            for n in a.envs.split(",")})
    with open(os.path.join(out, "cpu_speed.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    with open(os.path.join(out, "cpu_speed.md"), "w") as f:
        f.write(table)
    print(table)
    failed = [f"{n} envs {run}" for n, rs in results["envs"].items() for run, r in rs.items() if r["status"] != "ok"]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
