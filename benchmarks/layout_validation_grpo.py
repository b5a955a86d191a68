"""The layout planner against measured GRPO runs, sync and async: one sampler and one trainer, the two-pool system.

    python benchmarks/layout_validation_grpo.py [--iterations 40] [--quick]

The run is the default tiny-model GRPO of scripts/grpo_arith.py (heavy-tailed arithmetic, 16 prompts x 8 per
batch); async is one collector process and the trainer, one torch thread each. Each setting is calibrated right
before its run, on the same machine, from the pieces the run executes:
- the sampler: sync `Sampler.fill`s of whole batches at the setting's slot count, split into the time of starting
  a sequence (`Sampler._start`: its prefill or its group's cache copy, and bookkeeping, timed) and of a decode
  step (the rest, per step). A fill's steps shrink to a half or a quarter of the slots as it drains (the
  sampler's step sizes): the time per step is the fills' average over their sizes, given to the planner as a flat
  curve at the slot count (a pipelined run, which seldom drains, steps at full size a little more often);
- the response lengths of those fills, as the empirical distribution;
- the trainer's seconds per batch: `grpo.Learner.update` on a freshly filled batch each time (its cost follows the
  batch's tokens: 83 to 123 ms over 12 batches of the 64-slot setting here, so one batch timed again and again
  measures that batch, not the run's mean), and the log of its metrics; sync adds the verifier's scoring (in async
  the collector scores), async the publishing of the weights (`WeightRing`), timed while a process samples as the
  run's collector does (two processes on 2 cores: the update is ~15 % slower).
The planner (closed form and simulator) gets only these and the settings. Each run's completions/s (charts/SPS,
after its first two iterations) and mean sequence and token lags are compared with them; so is the closed form
given the update time and the mean response length the run itself logged (the calibrated lengths scaled to that
mean), which separates the model's error from its inputs' drift: the speed of shared cores, and the lengths, which
change as the policy trains (the calibration samples the warm start). Writes
benchmarks/results/<machine>/layout_validation_grpo.{json,md}; `--quick` runs two small settings into a temporary
folder (a check that the script works, not a validation).
"""

import glob
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial

import torch
import tyro

from tensordict import from_module

import leanrl
from leanrl import layout
from leanrl.algorithms import grpo, grpo_async
from leanrl.envs.llm_tasks import make_task
from leanrl.llm.tasks import PromptStream, score
from leanrl.llm.warm_start import load_policy
from leanrl.pipeline.weights import WeightRing

from measure import machine_info

CPU = torch.device("cpu")


@dataclass
class Bench:
    iterations: int = 40
    """batches per validation run"""
    calib_fills: int = 16
    """sync fills timed per setting (their lengths are the planner's distribution: heavy-tailed, so many)"""
    calib_updates: int = 16
    """trainer updates timed (each on a batch of its own)"""
    quick: bool = False
    """check that the script runs: two settings of 6 iterations, 2 fills and 2 updates timed, written to a
    temporary folder (never over the committed results)"""
    run_dir: str = "runs/layout_validation_grpo"
    """where the runs and their shared warm start go"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """where the machine's results folder is (ignored with --quick)"""


# (mode, slots, max_lag, update_epochs): sync generates then trains; pipelined is `--async` with one collector.
# One update epoch halves the trainer's time; one slot (no prefill to share either) makes the sampler the bound.
SETTINGS = [("sync", 64, 0, 2), ("sync", 32, 0, 2), ("pipelined", 64, 1, 2), ("pipelined", 64, 2, 2),
            ("pipelined", 32, 4, 2), ("pipelined", 64, 2, 1), ("pipelined", 16, 2, 1), ("pipelined", 1, 2, 1)]
QUICK = dict(iterations=6, calib_fills=2, calib_updates=2)


def grpo_args(mode, slots, max_lag, epochs, iterations, run_dir):
    base = grpo_async.Args(run_dir=run_dir, device="cpu", progress=False, log_every=1, checkpoint_every=0,
                           num_slots=slots, update_epochs=epochs, exp_name=f"val_{mode}_{slots}_{max_lag}_{epochs}")
    base = replace(base, total_timesteps=iterations * base.num_prompts * base.group_size)
    if mode == "sync":
        return base
    return replace(base, async_=True, max_lag=max_lag, transport="processes", num_collectors=1)


def calibrate_sampler(args, slots, fills):
    """Seconds per decode step and per started sequence at `slots` slots, and the completion lengths sampled."""
    task = make_task(args.task)
    model, tokenizer, _ = load_policy(args, task, CPU)
    prompts = PromptStream(task, tokenizer, seed=-7)
    sampler = grpo.make_sampler(model, tokenizer, args, num_slots=slots)
    batch = sampler.make_batch(args.num_prompts * args.group_size)
    started = [0.0]

    def timed_start(*a, _start=sampler._start):
        t0 = time.perf_counter()
        _start(*a)
        started[0] += time.perf_counter() - t0

    sampler._start = timed_start
    step_s, start_s, lengths = [], [], []
    for i in range(fills + 1):  # the first fill is warm-up
        started[0] = 0.0
        stats = sampler.fill(batch, prompts, group_size=args.group_size, carry_over=False)
        if i:
            step_s.append((stats["time_s"] - started[0]) / stats["decode_steps"])
            start_s.append(started[0] / (stats["prefills"] + stats["cache_copies"]))
            lengths += batch["completion_length"].tolist()
    return statistics.median(step_s), statistics.median(start_s), lengths


def busy_collector(args, started, stop):
    """What an async run's collector process does to the trainer's cores: sampler fills (one torch thread)."""
    torch.set_num_threads(1)
    task = make_task(args.task)
    model, tokenizer, _ = load_policy(args, task, CPU)
    sampler = grpo.make_sampler(model, tokenizer, args)
    batch = sampler.make_batch(args.num_prompts * args.group_size)
    prompts = PromptStream(task, tokenizer, seed=-9)
    while not stop.is_set():
        sampler.fill(batch, prompts, group_size=args.group_size, carry_over=False)
        started.set()


def calibrate_trainer(args, updates):
    """Seconds per batch of what the trainer does besides waiting: `Learner.update` (on batches of the
    warm-started policy, a fresh one each time: its cost follows the batch's lengths), logging its metrics (a
    Logger's record and flush: the runs log every batch), publishing the weights (the pipeline's `WeightRing`, async
    only) and scoring (sync only: in async the collector scores). Async times them while a collector process
    samples, as it does in the run: on 2 cores it slows the update."""
    task = make_task(args.task)
    model, tokenizer, _ = load_policy(args, task, CPU)
    learner = grpo.Learner(model, args, CPU, max_lag=args.max_lag)
    sampler = grpo.make_sampler(model, tokenizer, args)
    batch = sampler.make_batch(args.num_prompts * args.group_size)
    prompts = PromptStream(task, tokenizer, seed=-8)
    params = from_module(model).data
    ring = WeightRing(params, args.max_lag + 1, shared=True)
    times = {k: [] for k in ("score_s", "update_s", "publish_s", "log_s")}
    spawn = torch.multiprocessing.get_context("spawn")
    started, stop = spawn.Event(), spawn.Event()
    collector = spawn.Process(target=busy_collector, args=(args, started, stop)) if args.async_ else None
    if collector:
        collector.start()
        started.wait()
    with tempfile.TemporaryDirectory() as tmp, leanrl.Logger.from_args(
            replace(args, progress=False, track=False), tmp, 10 ** 9, summary=False) as logger:
        for i in range(updates + 1):
            # a fresh batch each time: the update's micro-batches are planned from its lengths
            sampler.fill(batch, prompts, group_size=args.group_size, carry_over=False)
            t0 = time.perf_counter()
            host = batch.select("tokens", "prompt_length", "completion_length", "prompt_id", "finished").cpu()
            rewards, _ = score(task, tokenizer, host, -8)
            t1 = time.perf_counter()
            metrics = learner.update(batch, rewards, 0)
            t2 = time.perf_counter()
            ring.publish(params, i)
            t3 = time.perf_counter()
            logger.record(metrics)
            logger.end_iteration(i + 1)
            logger.flush()
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)):
                times[k].append(dt)
    if collector:
        stop.set()
        collector.join()
    return {k: statistics.fmean(v[1:]) for k, v in times.items()}  # the mean, as a run's throughput sees it


def planner_setup(mode, slots, max_lag, cal, args):
    train_s = cal["update_s"] + cal["log_s"] + (cal["score_s"] if mode == "sync" else cal["publish_s"])
    return layout.Setup(total_gpus=1 if mode == "sync" else 2, model=layout.Model(1e4, 1, 1, 1),
                        gpu=layout.GPUS["CPU"], lengths=layout.Lengths("empirical", values=tuple(cal["lengths"])),
                        batch=args.num_prompts * args.group_size, group_size=args.group_size, max_lag=max_lag,
                        mode=mode, train_step_s=train_s, pause_s=0.0, prefill_s=cal["start_s"],
                        latency=layout.LatencyCurve((slots,), (cal["step_s"],)))


def hist_mean(rows, prefix):
    keys = sorted((k for k in rows[0] if k.startswith(prefix)), key=lambda k: int(k.rsplit("_", 1)[1]))
    counts = [sum(r[k] for r in rows) for k in keys]
    return sum(i * c for i, c in enumerate(counts)) / max(sum(counts), 1)


def measured_run(args):
    t0 = time.perf_counter()
    (grpo_async.train if args.async_ else grpo.train)(args, partial(make_task, args.task))
    wall = time.perf_counter() - t0
    path = sorted(glob.glob(f"{args.run_dir}/*__{args.exp_name}__*"))[-1]
    rows = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
    steady = rows[2:]  # SPS counts from the end of iteration 2: the lags over the same batches
    return dict(sps=rows[-1]["charts/SPS"], seq_lag=hist_mean(steady, "lag/sequence_hist_"),
                mean_length=statistics.fmean(r["charts/response_length_mean"] for r in steady),
                update_s=statistics.fmean(r["perf/update_time"] for r in steady),
                token_lag=hist_mean(steady, "lag/token_hist_"), wall_s=wall,
                trainer_idle=rows[-1].get("async/trainer_idle_frac"),
                collector_idle=rows[-1].get("async/collector_idle_frac"),
                dropped=statistics.fmean(r["perf/dropped"] for r in steady) if args.async_ else 0.0)


def main(b: Bench):
    settings = [SETTINGS[0], SETTINGS[3]] if b.quick else SETTINGS
    if b.quick:
        tmp = tempfile.mkdtemp(prefix="layout_validation_grpo_quick_")
        b = replace(b, **QUICK, out_dir=tmp, run_dir=os.path.join(tmp, "runs"))
    out = os.path.join(b.out_dir, machine_info(CPU)["slug"])
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    results, t_calib = [], 0.0
    for mode, slots, max_lag, epochs in settings:
        run_args = grpo_args(mode, slots, max_lag, epochs, b.iterations, b.run_dir)
        t0 = time.perf_counter()  # calibrated right before its run: the speed of shared cores drifts
        step_s, start_s, lengths = calibrate_sampler(run_args, slots, b.calib_fills)
        cal = dict(step_s=step_s, start_s=start_s, lengths=lengths, **calibrate_trainer(run_args, b.calib_updates))
        update_s, mean_length = cal["update_s"], statistics.fmean(lengths)
        t_calib += time.perf_counter() - t0
        s = planner_setup(mode, slots, max_lag, cal, run_args)
        pred = layout.predict(s, 1, slots)
        sim = layout.simulate(s, 1, slots, steps=300, warmup=20)
        m = measured_run(run_args)
        # The same model given the run's own update time and mean length: what is left is the model's own error
        scale = m["mean_length"] / mean_length
        in_run = layout.predict(replace(s, train_step_s=s.train_step_s - update_s + m["update_s"],
                                        lengths=layout.Lengths("empirical", values=tuple(x * scale for x in lengths))),
                                1, slots)
        row = dict(mode=mode, slots=slots, max_lag=max_lag, update_epochs=epochs, step_s=step_s, start_s=start_s,
                   mean_length=mean_length, update_s=update_s, log_s=cal["log_s"],
                   publish_s=cal["publish_s"], train_s=s.train_step_s,
                   bound=pred.bound, measured_sps=m["sps"], model_sps=pred.seqs_per_s, sim_sps=sim.seqs_per_s,
                   run_update_s=m["update_s"], run_mean_length=m["mean_length"], in_run_sps=in_run.seqs_per_s,
                   in_run_lag=in_run.lag_mean,
                   measured_lag=m["seq_lag"], model_lag=pred.lag_mean, sim_lag=sim.lag_mean,
                   measured_token_lag=m["token_lag"], model_token_lag=pred.token_lag_mean,
                   sim_token_lag=sim.token_lag_mean, measured_trainer_idle=m["trainer_idle"],
                   model_trainer_idle=pred.trainer_idle, measured_collector_idle=m["collector_idle"],
                   model_collector_idle=pred.sampler_idle, restarted_per_batch=m["dropped"], wall_s=m["wall_s"])
        for who in ("model", "sim"):
            row[f"{who}_sps_err"] = row[f"{who}_sps"] / row["measured_sps"] - 1
            row[f"{who}_lag_err"] = row[f"{who}_lag"] - row["measured_lag"]
        row["in_run_sps_err"] = row["in_run_sps"] / row["measured_sps"] - 1
        results.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    info = dict(machine=machine_info(CPU), load_before=load_before, load_after=os.getloadavg(),
                calibration_s=t_calib, total_s=time.perf_counter() - t_start, iterations=b.iterations,
                results=results)
    with open(os.path.join(out, "layout_validation_grpo.json"), "w") as f:
        json.dump(info, f, indent=1)
    md = table(info)
    with open(os.path.join(out, "layout_validation_grpo.md"), "w") as f:
        f.write(md)
    print(md + f"written to {out}")


def table(info) -> str:
    def idle(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [f"Planner vs measured GRPO (tiny model, heavy-tailed arithmetic, 16 prompts x 8 per batch, "
             f"{info['iterations']} batches per run; async: one collector process, one torch thread each). "
             f"Each setting calibrated right before its run ({info['calibration_s']:.0f} s in all); whole script "
             f"{info['total_s']:.0f} s. Load average (1/5/15 min) before "
             f"{tuple(round(x, 1) for x in info['load_before'])}, after "
             f"{tuple(round(x, 1) for x in info['load_after'])} on {info['machine']['cores']} cores.", "",
             "| mode | slots | max_lag | epochs | decode step ms | start ms | mean length | train s | bound | "
             "measured seqs/s | model (err) | simulator (err) | run's update s, mean length | "
             "model on them (err), lag | measured lag | model lag (err) | sim lag (err) | "
             "token lag meas / model / sim | trainer idle meas / model | sampler idle meas / model | "
             "restarted per batch |",
             "|---" * 21 + "|"]
    for r in info["results"]:
        lines.append(
            f"| {r['mode']} | {r['slots']} | {r['max_lag']} | {r['update_epochs']} | {r['step_s'] * 1e3:.2f} | "
            f"{r['start_s'] * 1e3:.2f} | {r['mean_length']:.2f} | {r['train_s']:.3f} | {r['bound']} | "
            f"{r['measured_sps']:.0f} | {r['model_sps']:.0f} ({r['model_sps_err']:+.1%}) | "
            f"{r['sim_sps']:.0f} ({r['sim_sps_err']:+.1%}) | {r['run_update_s']:.3f}, {r['run_mean_length']:.2f} | "
            f"{r['in_run_sps']:.0f} ({r['in_run_sps_err']:+.1%}), {r['in_run_lag']:.2f} | {r['measured_lag']:.2f} | "
            f"{r['model_lag']:.2f} ({r['model_lag_err']:+.2f}) | {r['sim_lag']:.2f} ({r['sim_lag_err']:+.2f}) | "
            f"{r['measured_token_lag']:.2f} / {r['model_token_lag']:.2f} / {r['sim_token_lag']:.2f} | "
            f"{idle(r['measured_trainer_idle'])} / {r['model_trainer_idle']:.2f} | "
            f"{idle(r['measured_collector_idle'])} / {r['model_collector_idle']:.2f} | "
            f"{r['restarted_per_batch']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Bench))
