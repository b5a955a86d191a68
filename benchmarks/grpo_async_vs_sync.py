"""GRPO async vs sync on the heavy-tailed arithmetic task (the default tiny-model run of scripts/grpo_arith.py).

    python benchmarks/grpo_async_vs_sync.py [--iterations 60 --max-lags 1 2 --transport processes --threads 1]

The variants start from the same warm start with the same seed and consume the same number of batches: async at each
lag bound (one collector process and the trainer, `threads` torch threads each: two cores at the defaults), sync on
`threads` threads (one core), and sync on every core (the same hardware as async). They run in turns (sync, sync,
async, ...) `repeats` times, and ratios are of the medians: on a shared 2-core machine one pair's ratio swung from
1.22x to 1.61x. All of it once per `update_epochs` value: async can hide the shorter of sampling and training behind
the longer, so its gain over sync is at most (sample + update) / max(sample, update), 2x when the two are equal.
Reported per variant: trained completion tokens per second of wall clock (after the first two iterations: warm-up;
the median and every run's), and from its last run: the start-up (launch to the end of iteration 2: imports,
model, collector processes), the mean sampling and update seconds per batch, the wall clock until the training solve
rate (mean of 5 batches) first reaches `target`, the per-token lag histogram and, for async, the trainer's and
collectors' idle fractions; and from every run, the held-out solve rate at the end (64 fixed prompts x 8, sampled with
3 seeds; after the same number of sampled batches, so this is the solve rate per sampled token): async runs differ
where their timing does.
Writes benchmarks/results/<machine>/grpo_async_vs_sync.{json,md} (grpo_async_vs_sync_compile.* with --compile).
"""

import glob
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial

import torch
import tyro

import leanrl
from leanrl.algorithms import grpo, grpo_async
from leanrl.envs.llm_tasks import make_task
from leanrl.llm import tasks
from leanrl.llm.warm_start import load_policy

from measure import cpu_line, machine_info

HELD_OUT_SEEDS = (123, 7, 99)  # sampling seeds of each run's held-out solve rate


@dataclass
class Bench:
    iterations: int = 60
    """batches consumed by each variant"""
    max_lags: tuple[int, ...] = (1, 2)
    """async lag bounds, a variant each (where the trainer is the slower side, a larger bound adds staleness, not
    throughput: benchmarks/results/<machine>/grpo_async_vs_sync.md)"""
    transport: str = "processes"
    """async transport (processes: the collectors do not share the trainer's interpreter lock)"""
    num_collectors: int = 1
    """async collectors"""
    target: float = 0.3
    """training solve rate (mean of 5 consecutive batches) whose first crossing is timed"""
    compile: bool = False
    """--compile in both variants (the sampler's decode steps and the trainer's update)"""
    threads: int = 1
    """torch CPU threads of the async trainer and of the first sync variant (1: no OpenMP contention between the
    trainer and a collector process)"""
    update_epochs: tuple[int, ...] = (2, 1)
    """passes over each batch, one set of runs each (2: grpo's default; 1: sampling and training take about as long
    here)"""
    repeats: int = 3
    """runs of each variant, in turns"""
    run_dir: str = "runs/grpo_async_vs_sync"
    """where the runs (and their shared warm start) go"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


def held_out_solve_rate(args, state, num_prompts=64, seeds=(123,)) -> float:
    """Mean solve rate on the same `num_prompts` held-out prompts, `group_size` samples each, once per sampling seed."""
    task = make_task(args.task)
    model, tokenizer, _ = load_policy(args, task, leanrl.resolve_device(args.device))
    model.load_state_dict(state)
    rates = []
    for seed in seeds:
        sampler = grpo.make_sampler(model, tokenizer, args, seed=seed)
        batch = sampler.make_batch(num_prompts * args.group_size)
        rates.append(tasks.held_out_solve_rate(sampler, task, tokenizer, batch, args.group_size))
    return statistics.mean(rates)


def summarize(rows, args, wall_s, target) -> dict:
    B = args.num_prompts * args.group_size
    warmup = rows[-1]["perf/warmup_time"]
    # Logger rows carry SPS since the end of iteration 2: the time of each row follows from it.
    times = [warmup + (r["global_step"] - 2 * B) / r["charts/SPS"] if "charts/SPS" in r
             else warmup if r["global_step"] == 2 * B else None for r in rows]
    tokens = [sum(v for k, v in r.items() if k.startswith("lag/token_hist_")) for r in rows]
    solve = [r["charts/solve_rate"] for r in rows]
    rolling = [sum(solve[max(0, i - 4):i + 1]) / len(solve[max(0, i - 4):i + 1]) for i in range(len(solve))]
    hit = next((times[i] for i in range(4, len(rows)) if rolling[i] >= target and times[i] is not None), None)
    lag_keys = sorted(k for k in rows[0] if k.startswith("lag/token_hist_"))
    steady = rows[2:]
    out = {"trained_tokens_per_s": sum(tokens[2:]) / (times[-1] - times[1]), "wall_s": wall_s, "startup_s": warmup,
           "update_s": statistics.mean(r["perf/update_time"] for r in steady),
           "sample_s": statistics.mean(r["perf/sample_time"] for r in steady),
           "time_to_target_s": hit, "final_train_solve_rate": rolling[-1],
           "token_lag_hist": [sum(r[k] for r in rows) for k in lag_keys]}
    for k in ("async/trainer_idle_frac", "async/collector_idle_frac", "async/lag_mean"):
        if k in rows[-1]:
            out[k.split("/")[1]] = rows[-1][k]
    return out


def run_variants(bench: Bench, base) -> dict:
    """Each variant `repeats` times in turns; the last run's summary with every run's tokens/s and held-out solve rate,
    and the median and mean of those."""
    variants = {"sync": replace(base, exp_name="bench_sync", threads=bench.threads),
                "sync, all cores": replace(base, exp_name="bench_sync_all", threads=os.cpu_count()),
                **{f"async, max_lag {lag}": replace(base, exp_name=f"bench_async_lag{lag}", async_=True, max_lag=lag,
                                                    threads=bench.threads) for lag in bench.max_lags}}
    runs = {name: [] for name in variants}
    for _ in range(bench.repeats):
        for name, args in variants.items():
            t0 = time.perf_counter()
            (grpo_async.train if args.async_ else grpo.train)(args, partial(make_task, args.task))
            wall = time.perf_counter() - t0
            (path,) = sorted(glob.glob(f"{bench.run_dir}/*__{args.exp_name}__*"))[-1:]
            rows = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
            runs[name].append((summarize(rows, args, wall, bench.target), args, path))
            print(base.update_epochs, name, runs[name][-1][0])
    results = {}
    for name, variant in runs.items():
        result, args, path = variant[-1]
        result["threads"] = variants[name].threads
        result["trained_tokens_per_s_runs"] = [r["trained_tokens_per_s"] for r, _, _ in variant]
        result["trained_tokens_per_s"] = statistics.median(result["trained_tokens_per_s_runs"])
        result["held_out_solve_rate_runs"] = [
            held_out_solve_rate(args, torch.load(f"{run_path}/checkpoint.pt", weights_only=False)["model"],
                                seeds=HELD_OUT_SEEDS) for _, _, run_path in variant]
        result["held_out_solve_rate"] = statistics.mean(result["held_out_solve_rate_runs"])
        result["loss"] = args.loss
        results[name] = result
    return results


def main(bench: Bench):
    base = grpo_async.Args(run_dir=bench.run_dir, device="cpu", progress=False, log_every=1,
                           transport=bench.transport, num_collectors=bench.num_collectors,
                           compile=bench.compile)
    base = replace(base, total_timesteps=bench.iterations * base.num_prompts * base.group_size)
    results = {epochs: run_variants(bench, replace(base, update_epochs=epochs)) for epochs in bench.update_epochs}
    speedups = {epochs: {lag: {"vs_sync": r[f"async, max_lag {lag}"]["trained_tokens_per_s"]
                               / r["sync"]["trained_tokens_per_s"],
                               "vs_sync_all_cores": r[f"async, max_lag {lag}"]["trained_tokens_per_s"]
                               / r["sync, all cores"]["trained_tokens_per_s"]} for lag in bench.max_lags}
                for epochs, r in results.items()}
    machine = machine_info(torch.device("cpu"))
    out = os.path.join(bench.out_dir, machine["slug"])
    os.makedirs(out, exist_ok=True)
    record = {"machine": machine, "bench": vars(bench), "results": results, "speedup_tokens_per_s": speedups}
    stem = "grpo_async_vs_sync_compile" if bench.compile else "grpo_async_vs_sync"
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1)

    lines = [f"# GRPO async vs sync, heavy-tailed arithmetic ({cpu_line(machine)}, {machine['cores']} cores, "
             f"commit {machine['commit']})", "",
             f"{bench.iterations} batches of {base.num_prompts} prompts x {base.group_size}; async: {bench.transport}, "
             f"{bench.num_collectors} collector(s) and the trainer, {bench.threads} torch thread(s) each"
             f"{'; --compile' if bench.compile else ''}. Sample and update: mean seconds per batch "
             "(async: the collector's sampling, overlapping the trainer's update).", "",
             "| epochs | variant | threads | trained tokens/s (median) | every run's | start-up s | sample s "
             f"| update s | time to solve rate {bench.target} | train solve rate (last 5) | held-out solve rate (mean) "
             "| every run's | token lag histogram | trainer idle | collector idle |",
             "|---:|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|---|---:|---:|"]
    for epochs, variants in results.items():
        for name, r in variants.items():
            hit = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
            idle = [r.get(k, float("nan")) for k in ("trainer_idle_frac", "collector_idle_frac")]
            every = ", ".join(f"{x:.0f}" for x in r["trained_tokens_per_s_runs"])
            every_held_out = ", ".join(f"{x:.3f}" for x in r["held_out_solve_rate_runs"])
            lines.append(f"| {epochs} | {name} | {r['threads']} | {r['trained_tokens_per_s']:.0f} | {every} | "
                         f"{r['startup_s']:.1f} | {r['sample_s']:.3f} | {r['update_s']:.3f} | {hit} | "
                         f"{r['final_train_solve_rate']:.3f} | {r['held_out_solve_rate']:.3f} | {every_held_out} | "
                         f"{r['token_lag_hist']} | {idle[0]:.2f} | {idle[1]:.2f} |")
    lines.append("")
    for epochs, by_lag in speedups.items():
        for lag, x in by_lag.items():
            lines.append(f"- {epochs} epoch(s), max_lag {lag}: async / sync trained tokens per second (medians of "
                         f"{bench.repeats} runs each) {x['vs_sync']:.2f}x; against sync on all cores "
                         f"{x['vs_sync_all_cores']:.2f}x.")
    lines.append(f"- Held-out solve rate: every run's checkpoint, {len(HELD_OUT_SEEDS)} sampling seeds each; start-up, "
                 "time to target, the training solve rate, lags and idle fractions: each variant's last run.")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Bench))
