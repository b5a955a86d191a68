"""What the built-in sampler's shrinking steps buy: the same fills with every step over all slots and the whole
cache, over the fewest slots (`shrink_steps`), and over the fewest slots and cache positions (`shrink_cache` too).

    python benchmarks/sampler_shrink.py [--models tiny 20m --max-lens 128 512 --num-slots 16]

The batch and prompts of benchmarks/sampler_vs_vllm.py (64 sequences in groups of 4, temperature 1, random weights:
completions of every length up to max_len). Per model and max_len the three samplers fill it `warmup` times each, in
that order (compiling the step sizes they use; the warm-up time is reported, a graph an earlier sampler compiled
being a cache hit for a later one), then `repeats` times in turns; tokens/s = completion tokens of the batch / fill
time, the median reported, with the cache positions a step reads on average.
Writes benchmarks/results/<machine>/sampler_shrink.{json,md}.
"""

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import tyro

from leanrl.llm import Sampler, char_tokenizer, load_model, save_tiny_model

from measure import machine_info
from sampler_latency import ALPHABET, MODELS
from sampler_vs_vllm import prompt_stream

VARIANTS = {"neither": dict(shrink_steps=False, shrink_cache=False),
            "slots": dict(shrink_steps=True, shrink_cache=False),
            "slots+cache": dict(shrink_steps=True, shrink_cache=True)}


@dataclass
class Bench:
    models: list[str] = field(default_factory=lambda: ["tiny", "20m"])
    """models of sampler_vs_vllm.MODELS, built locally with random weights"""
    max_lens: list[int] = field(default_factory=lambda: [128, 512])
    """prompt + completion tokens: the cache length"""
    num_slots: int = 16
    """sequences decoded together"""
    num_sequences: int = 64
    """sequences per batch (groups of 4)"""
    compile: bool = True
    """compiled decode steps (False: eager)"""
    warmup: int = 3
    """untimed fills per sampler first"""
    repeats: int = 7
    """timed fills per sampler, in turns"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


def fill(sampler, tok, b: Bench):
    """One fill of the batch: (completion tokens / second, mean cache positions a step read)."""
    batch = sampler.make_batch(b.num_sequences)
    stats = sampler.fill(batch, prompt_stream(tok, b.num_sequences), group_size=4, carry_over=False)
    return int(batch["completion_length"].sum()) / stats["time_s"], stats["stepped_positions"] / stats["decode_steps"]


def run(name: str, max_len: int, b: Bench) -> dict:
    tok = char_tokenizer(ALPHABET)
    model, tok = load_model(save_tiny_model(tempfile.mkdtemp(), tok, **MODELS[name]))
    model.requires_grad_(False)
    samplers = {v: Sampler(model, num_slots=b.num_slots, max_len=max_len, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, compile=b.compile, **kwargs)
                for v, kwargs in VARIANTS.items()}
    warmup_s = {}
    for v, sampler in samplers.items():
        t0 = time.perf_counter()
        for _ in range(b.warmup):
            fill(sampler, tok, b)
        warmup_s[v] = time.perf_counter() - t0
    runs = {v: [] for v in samplers}
    for _ in range(b.repeats):
        for v, sampler in samplers.items():
            runs[v].append(fill(sampler, tok, b))
    return {v: dict(tokens_per_s=statistics.median(r[0] for r in rs), tokens_per_s_runs=[r[0] for r in rs],
                    cache_positions_per_step=statistics.mean(r[1] for r in rs), warmup_s=warmup_s[v])
            for v, rs in runs.items()}


def main(b: Bench):
    machine = machine_info(torch.device("cpu"))
    load = [os.getloadavg()[0]]
    results = {name: {max_len: run(name, max_len, b) for max_len in b.max_lens} for name in b.models}
    load.append(os.getloadavg()[0])
    folder = os.path.join(b.out_dir, machine["slug"])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sampler_shrink.json"), "w") as f:
        json.dump(dict(machine=machine, bench=vars(b), loadavg_1min=load, torch_threads=torch.get_num_threads(),
                       results=results), f, indent=1)
    lines = [f"# Shrinking decode steps, {'compiled' if b.compile else 'eager'}, on {machine['slug']} "
             f"({machine['cpu']}, {torch.get_num_threads()} torch threads, 1-min load average "
             f"{min(load):.1f}-{max(load):.1f}, commit {machine['commit']})", "",
             f"{b.num_sequences} sequences in groups of 4, {b.num_slots} slots, temperature 1; completion tokens/s, "
             f"medians of {b.repeats} fills in turns after {b.warmup} each.", "",
             "| model | max_len | neither | slots | slots+cache | slots / neither | slots+cache / slots "
             "| cache positions a step reads: slots / slots+cache "
             "| warm-up s (compiles): neither / slots / slots+cache |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, by_len in results.items():
        for max_len, r in by_len.items():
            x = {v: r[v]["tokens_per_s"] for v in VARIANTS}
            lines.append(f"| {name} | {max_len} | {x['neither']:,.0f} | {x['slots']:,.0f} | "
                         f"{x['slots+cache']:,.0f} | {x['slots'] / x['neither']:.2f}x | "
                         f"{x['slots+cache'] / x['slots']:.2f}x | "
                         f"{r['slots']['cache_positions_per_step']:.0f} / "
                         f"{r['slots+cache']['cache_positions_per_step']:.0f} | "
                         + " / ".join(f"{r[v]['warmup_s']:.1f}" for v in VARIANTS) + " |")
    with open(os.path.join(folder, "sampler_shrink.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Bench))
