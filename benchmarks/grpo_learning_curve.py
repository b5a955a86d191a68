"""A GRPO learning curve on the arithmetic task: held-out solve rate vs iterations and wall clock.

    python benchmarks/grpo_learning_curve.py [--model smollm2-135m --iterations 100 --eval-every 20]

The run is `scripts/grpo_arith.py` with the flags below, trained in chunks of `eval_every` iterations, each chunk
resuming the previous one's checkpoint (exactly: the same run as in one go). Before the first chunk and after each,
the held-out solve rate: 64 fixed prompts x group_size completions at the run's temperature, sampled eagerly (a
sampler made per evaluation would compile and capture again). On a GPU:

    python benchmarks/grpo_learning_curve.py --device cuda --dtype bfloat16 --cudagraphs

Writes benchmarks/results/<machine>/grpo_learning_curve_<model>.{json,md,png} after every point.
"""

import glob
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Literal

import matplotlib
import torch
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import leanrl  # noqa: E402
from leanrl.algorithms import grpo  # noqa: E402
from leanrl.envs.llm_tasks import make_task  # noqa: E402
from leanrl.llm.warm_start import load_policy  # noqa: E402

from grpo_async_vs_sync import held_out_solve_rate  # noqa: E402
from measure import cpu_line, machine_info  # noqa: E402


@dataclass
class Bench:
    model: str = "smollm2-135m"
    """grpo's --model: a named model or `tiny`"""
    iterations: int = 100
    """GRPO iterations (batches)"""
    eval_every: int = 20
    """iterations between held-out evaluations"""
    learning_rate: float = 1e-6
    """GRPO's Adam learning rate"""
    num_prompts: int = 8
    """prompts per batch (4 minibatches of a quarter of the batch's sequences each)"""
    group_size: int = 4
    """completions per prompt"""
    max_len: int = 48
    """prompt + completion tokens"""
    num_slots: int = 32
    """sampler slots"""
    update_epochs: int = 1
    """passes over each batch"""
    sft_steps: int = 30
    """supervised warm-start steps (the answer format)"""
    sft_batch: int = 16
    """warm-start batch"""
    sft_learning_rate: float = 1e-4
    """warm-start Adam learning rate"""
    device: str = "cpu"
    """where the run trains and samples (cuda, cuda:N or cpu)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights"""
    compile: bool = False
    """torch.compile the sampler's decode step and the update"""
    cudagraphs: bool = False
    """capture them in CUDA graphs (on a CUDA device)"""
    threads: int = 0
    """torch CPU threads (0: leanrl.set_threads' choice for the model's size)"""
    run_dir: str = "runs/grpo_learning_curve"
    """where the run (and its warm start) goes"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


def main(b: Bench):
    B = b.num_prompts * b.group_size
    args = grpo.Args(model=b.model, learning_rate=b.learning_rate, num_prompts=b.num_prompts,
                     group_size=b.group_size, max_len=b.max_len, num_slots=b.num_slots, update_epochs=b.update_epochs,
                     micro_batch=B // 4, sft_steps=b.sft_steps, sft_batch=b.sft_batch,
                     sft_learning_rate=b.sft_learning_rate, run_dir=b.run_dir, exp_name=f"curve_{b.model}",
                     device=b.device, dtype=b.dtype, compile=b.compile, cudagraphs=b.cudagraphs, progress=False,
                     log_every=1, checkpoint_every=0, threads=b.threads)
    device = leanrl.resolve_device(b.device)
    eval_args = replace(args, compile=False, cudagraphs=False)
    t0 = time.perf_counter()
    task = make_task(args.task)
    model, _, _ = load_policy(args, task, device)  # builds (or reads) the warm start
    points = [dict(iteration=0, wall_s=0.0, warm_start_s=time.perf_counter() - t0,
                   held_out_solve_rate=held_out_solve_rate(eval_args, model.state_dict()))]
    print(points[-1], flush=True)
    machine = machine_info(device)
    wall, checkpoint = 0.0, None
    for done in range(b.eval_every, b.iterations + 1, b.eval_every):
        chunk = replace(args, total_timesteps=done * B, resume=checkpoint)
        t0 = time.perf_counter()
        grpo.train(chunk, partial(make_task, chunk.task))
        wall += time.perf_counter() - t0
        (path,) = sorted(glob.glob(f"{b.run_dir}/*__{args.exp_name}__*"))[-1:]
        checkpoint = f"{path}/checkpoint.pt"
        state = torch.load(checkpoint, weights_only=False)["model"]
        points.append(dict(iteration=done, wall_s=wall, held_out_solve_rate=held_out_solve_rate(eval_args, state)))
        print(points[-1], flush=True)
        rows = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
        # after every point: a run stopped at a deadline (a GPU lease's) keeps the curve so far
        write(b, machine, task, points, [(r["global_step"] // B, r["charts/solve_rate"]) for r in rows])


def write(b: Bench, machine: dict, task, points: list, train_curve: list):
    out = os.path.join(b.out_dir, machine["slug"])
    os.makedirs(out, exist_ok=True)
    name = f"grpo_learning_curve_{b.model}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(dict(machine=machine, bench=asdict(b), task=repr(task), points=points, train_curve=train_curve,
                       threads=torch.get_num_threads()), f, indent=1)
    where = (f"{machine['gpu']}, CUDA {machine['cuda']}, torch {machine['torch']}" if machine["gpu"] else
             f"{cpu_line(machine)}, {machine['cores']} cores")
    graphs = b.cudagraphs and machine["gpu"] is not None  # on a CPU --cudagraphs falls back to eager
    mode = " + ".join(m for m, on in (("compile", b.compile), ("cudagraphs", graphs)) if on) or "eager"
    lines = [f"# GRPO learning curve: {b.model} on the arithmetic task ({where}, commit {machine['commit']})", "",
             f"{points[-1]['iteration']} of {b.iterations} iterations of {b.num_prompts} prompts x {b.group_size}, "
             f"learning rate {b.learning_rate}, max_len {b.max_len}, {b.num_slots} slots, {b.update_epochs} "
             f"epoch(s), {b.dtype}, {mode}; warm start {b.sft_steps} steps of {b.sft_batch} "
             f"({points[0]['warm_start_s']:.0f} s to build it, or to load it from the run directory); "
             f"{torch.get_num_threads()} torch threads. Held-out: 64 fixed prompts x {b.group_size}.", "",
             "| iteration | wall clock (s) | held-out solve rate |", "|---:|---:|---:|"]
    lines += [f"| {p['iteration']} | {p['wall_s']:.0f} | {p['held_out_solve_rate']:.3f} |" for p in points]
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train_curve), alpha=0.4, label="training batch solve rate")
    ax.plot([p["iteration"] for p in points], [p["held_out_solve_rate"] for p in points], marker="o",
            label="held-out solve rate")
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("solve rate")
    ax.set_title(f"{b.model}, arithmetic, {machine['slug']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, name + ".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(Bench))
