"""GRPO async vs sync on the heavy-tailed arithmetic task (the default tiny-model run of scripts/grpo_arith.py).

    python benchmarks/grpo_async_vs_sync.py [--iterations 60 --max-lag 2 --transport processes --threads 1 --repeats 3]

Both variants start from the same warm start with the same seed and consume the same number of batches; they run
in turns (sync, async, sync, ...) `repeats` times, and the ratio is of the medians: on a shared 2-core machine one
pair's ratio swung from 1.22x to 1.61x. Reported per variant: trained completion tokens per second of wall clock
(after the first two iterations: warm-up; the median and every run's), and from its last run: the
wall clock until the training solve rate (mean of 5 batches) first reaches `target`, the held-out solve rate at the
end (64 fixed prompts x 8; the same number of sampled batches, so this is the solve rate per sampled token), the
per-token lag histogram and, for async, the trainer's and collectors' idle fractions.
Writes benchmarks/results/<machine>/grpo_async_vs_sync.{json,md} (grpo_async_vs_sync_compile.* with --compile).
"""

import glob
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import tyro

from leanrl.algorithms import grpo, grpo_async

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import machine_info  # noqa: E402


@dataclass
class Bench:
    iterations: int = 60
    """batches consumed by each variant"""
    max_lag: int = 2
    """async lag bound"""
    transport: str = "processes"
    """async transport (processes: the collectors do not share the trainer's interpreter lock)"""
    num_collectors: int = 1
    """async collectors"""
    target: float = 0.3
    """training solve rate (mean of 5 consecutive batches) whose first crossing is timed"""
    compile: bool = False
    """--compile in both variants (the sampler's decode steps and the trainer's update)"""
    threads: int | None = 1
    """torch CPU threads of the trainer (1: no OpenMP contention on a machine shared with other jobs)"""
    repeats: int = 3
    """runs of each variant, in turns"""
    run_dir: str = "runs/grpo_async_vs_sync"
    """where the runs (and their shared warm start) go"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


def held_out_solve_rate(args, state, num_prompts=64) -> float:
    task, model, tokenizer, _ = grpo.load_policy(args, torch.device("cpu"))
    model.load_state_dict(state)
    sampler = grpo.make_sampler(model, tokenizer, args, seed=123)
    batch = sampler.make_batch(num_prompts * args.group_size)
    sampler.fill(batch, grpo.PromptStream(task, tokenizer, seed=-1000), group_size=args.group_size, carry_over=False)
    return float(grpo.score(task, tokenizer, batch.cpu(), -1000).mean())


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
    out = {"trained_tokens_per_s": sum(tokens[2:]) / (times[-1] - times[1]), "wall_s": wall_s,
           "time_to_target_s": hit, "final_train_solve_rate": rolling[-1],
           "token_lag_hist": [sum(r[k] for r in rows) for k in lag_keys]}
    for k in ("async/trainer_idle_frac", "async/collector_idle_frac", "async/lag_mean"):
        if k in rows[-1]:
            out[k.split("/")[1]] = rows[-1][k]
    return out


def main(bench: Bench):
    if bench.threads:
        torch.set_num_threads(bench.threads)
    base = grpo_async.Args(run_dir=bench.run_dir, device="cpu", progress=False, log_every=1,
                           max_lag=bench.max_lag, transport=bench.transport, num_collectors=bench.num_collectors,
                           compile=bench.compile)
    base = replace(base, total_timesteps=bench.iterations * base.num_prompts * base.group_size)
    runs = {"sync": [], "async": []}
    for _ in range(bench.repeats):
        for name, args in (("sync", replace(base, exp_name="bench_sync")),
                           ("async", replace(base, exp_name="bench_async", async_=True))):
            t0 = time.perf_counter()
            (grpo_async.train if args.async_ else grpo.train)(args)
            wall = time.perf_counter() - t0
            (path,) = sorted(glob.glob(f"{bench.run_dir}/*__{args.exp_name}__*"))[-1:]
            rows = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
            runs[name].append((summarize(rows, args, wall, bench.target), args, path))
            print(name, runs[name][-1][0])
    results = {}
    for name, variant in runs.items():
        result, args, path = variant[-1]
        result["trained_tokens_per_s_runs"] = [r["trained_tokens_per_s"] for r, _, _ in variant]
        result["trained_tokens_per_s"] = statistics.median(result["trained_tokens_per_s_runs"])
        state = torch.load(f"{path}/checkpoint.pt", weights_only=False)["model"]
        result["held_out_solve_rate"] = held_out_solve_rate(args, state)
        result["loss"] = args.loss
        results[name] = result
    machine = machine_info(torch.device("cpu"))
    out = os.path.join(bench.out_dir, machine["slug"])
    os.makedirs(out, exist_ok=True)
    speedup = results["async"]["trained_tokens_per_s"] / results["sync"]["trained_tokens_per_s"]
    record = {"machine": machine, "bench": vars(bench), "results": results, "speedup_tokens_per_s": speedup}
    stem = "grpo_async_vs_sync_compile" if bench.compile else "grpo_async_vs_sync"
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1)
    lines = [f"# GRPO async vs sync, heavy-tailed arithmetic ({machine['cpu']}, {machine['cores']} cores, "
             f"commit {machine['commit']})", "",
             f"{bench.iterations} batches of {base.num_prompts} prompts x {base.group_size}; async: {bench.transport}, "
             f"{bench.num_collectors} collector(s), max_lag {bench.max_lag}; torch threads {bench.threads}"
             f"{'; --compile' if bench.compile else ''}.", "",
             f"| variant | loss | trained tokens/s (median) | every run's | time to solve rate {bench.target} "
             "| train solve rate (last 5) "
             "| held-out solve rate | token lag histogram | trainer idle | collector idle |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        hit = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
        idle = [r.get(k, float("nan")) for k in ("trainer_idle_frac", "collector_idle_frac")]
        every = ", ".join(f"{x:.0f}" for x in r["trained_tokens_per_s_runs"])
        lines.append(f"| {name} | {r['loss']} | {r['trained_tokens_per_s']:.0f} | {every} | {hit} | "
                     f"{r['final_train_solve_rate']:.3f} | {r['held_out_solve_rate']:.3f} | {r['token_lag_hist']} | "
                     f"{idle[0]:.2f} | {idle[1]:.2f} |")
    lines += ["", f"Async / sync trained tokens per second (medians of {bench.repeats} runs each): {speedup:.2f}x. "
              "Time to target, solve rates, lags and idle fractions: each variant's last run."]
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Bench))
