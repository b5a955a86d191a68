"""The built-in sampler's decode step time vs number of slots: eager, compile, on CUDA compile+cudagraphs, and on a
CPU compile-plain (compiled, weights not packed).

    python benchmarks/sampler_latency.py [--slots 1 2 4 8 16 32 64 --cache-len 128 --models tiny 20m --threads 1]

A decode step is what `Sampler.fill` runs per token: the version and noise written into the step's buffers,
the (compiled, graphed) step over all slots, and the read of the slots' ended flags. All slots are busy.
Writes benchmarks/results/<machine>/sampler_latency.{json,md,png}; the JSON is the latency curve the layout
planner reads: {"machine", "device", "model": {...}, "cache_len", "points": [{"mode", "batch", "step_time_s"}]}
for the first model, and the same per model under "models".
"""

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import matplotlib
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import leanrl  # noqa: E402
from leanrl.llm import Sampler, char_tokenizer, load_model, save_tiny_model  # noqa: E402
from leanrl.llm.models import NAMED_MODELS  # noqa: E402

from measure import machine_info  # noqa: E402

# name -> save_tiny_model arguments (head_dim >= 32 so vLLM's CPU backend can run the same models)
MODELS = {
    "tiny": dict(family="qwen2", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2),
    "20m": dict(family="llama", num_layers=7, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376),
}
ALPHABET = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz\n"


@dataclass
class Bench:
    slots: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """numbers of slots (the decode batch)"""
    cache_len: int = 128
    """the static KV cache length (max_len: prompt + completion)"""
    models: list[str] = field(default_factory=lambda: ["tiny", "20m"])
    """which models to time: MODELS (random weights) or a named model (e.g. smollm2-135m); the first one is the
    JSON's top-level curve"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """where the sampler runs"""
    dtype: str = "bfloat16" if torch.cuda.is_available() else "float32"
    """the weights' and cache's dtype"""
    steps: int = 40
    """timed decode steps per point, in 4 rounds that alternate the modes (the median is reported)"""
    warmup: int = 5
    """untimed steps first (compilation, CUDA graph capture)"""
    modes: list[str] = field(default_factory=lambda: ["eager", "compile", "compile+cudagraphs", "compile-plain"])
    """which modes to time (compile+cudagraphs only on CUDA; compile-plain, compiled without the packed weights
    that a CPU sampler uses, only on a CPU)"""
    threads: int = 0
    """torch CPU threads (0: leanrl.set_threads' choice for each model's size)"""
    out_dir: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    """results folder; the machine's slug is appended"""


MODES = {"eager": dict(), "compile": dict(compile=True), "compile+cudagraphs": dict(compile=True, cudagraphs=True),
         "compile-plain": dict(compile=True, pack_weights=False)}
ONLY_ON = {"compile+cudagraphs": "cuda", "compile-plain": "cpu"}


def modes(names, device: torch.device):
    return [(m, MODES[m]) for m in names if ONLY_ON.get(m, device.type) == device.type]


def start(sampler: Sampler, warmup: int) -> float:
    """Every slot busy; `warmup` untimed steps (compilation, CUDA graph capture): returns their time."""
    S = sampler.num_slots
    sampler.active.fill_(True)
    sampler.last.copy_(torch.randint(3, sampler.vocab_size, (S,), generator=torch.Generator().manual_seed(0)))
    sampler.pos.fill_(0)
    t0 = time.perf_counter()
    for _ in range(warmup):
        sampler.decode(0)
    return time.perf_counter() - t0


def time_steps(sampler: Sampler, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if sampler.pos.max().item() >= sampler.max_len - 2:  # outside the timed step: keep writes in the cache
            sampler.pos.fill_(0)
        t0 = time.perf_counter()
        sampler.decode(0)
        times.append(time.perf_counter() - t0)
    return times


def main(b: Bench):
    device, dtype = torch.device(b.device), getattr(torch, b.dtype)
    tokenizer = char_tokenizer(ALPHABET)
    load_before = os.getloadavg()
    results = []
    for name in b.models:
        if name in NAMED_MODELS:
            model, tok = load_model(name, device=device, dtype=dtype)
        else:
            with tempfile.TemporaryDirectory() as d:
                save_tiny_model(d, tokenizer, max_position_embeddings=max(512, b.cache_len), **MODELS[name])
                model, tok = load_model(d, device=device, dtype=dtype)
        model.requires_grad_(False)
        threads = leanrl.set_threads(b.threads, model)
        c = model.config
        info = dict(name=name, family=c.model_type, params=sum(p.numel() for p in model.parameters()), threads=threads,
                    layers=c.num_hidden_layers, hidden=c.hidden_size, kv_heads=c.num_key_value_heads,
                    head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                    vocab=c.vocab_size, dtype=b.dtype)
        points = []
        for S in b.slots:
            torch._dynamo.reset()  # each slot count is its own static graph; stay under the recompile limit
            samplers = {mode: Sampler(model, num_slots=S, max_len=b.cache_len, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, **kwargs)
                        for mode, kwargs in modes(b.modes, device)}
            first = {mode: start(sampler, b.warmup) for mode, sampler in samplers.items()}
            # The modes take turns in short rounds, so a change of the machine's load hits them alike.
            times = {mode: [] for mode in samplers}
            rounds = 4
            for _ in range(rounds):
                for mode, sampler in samplers.items():
                    times[mode] += time_steps(sampler, -(-b.steps // rounds))
            for mode, t in times.items():
                step = statistics.median(t)
                points.append(dict(mode=mode, batch=S, step_time_s=step, tokens_per_s=S / step,
                                   p90_step_time_s=sorted(t)[int(0.9 * (len(t) - 1))], warmup_s=first[mode]))
                print(f"{name} {mode:>20} slots {S:3d}: {step * 1e3:8.3f} ms/step, {S / step:9.0f} tokens/s "
                      f"(warmup {first[mode]:.1f} s)", flush=True)
            del samplers
        results.append(dict(model=info, points=points))
    load_after = os.getloadavg()

    machine = machine_info(device)
    first = results[0]
    out = dict(machine=machine["slug"], device=str(machine["gpu"] or machine["cpu"]), model=first["model"],
               cache_len=b.cache_len, points=first["points"], models=results, machine_info=machine,
               threads=torch.get_num_threads(), load_avg_before=load_before, load_avg_after=load_after,
               speedups=speedups(results, max(b.slots)), created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    path = os.path.join(b.out_dir, machine["slug"])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "sampler_latency.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(path, "sampler_latency.md"), "w") as f:
        f.write(markdown(out))
    plot(out, os.path.join(path, "sampler_latency.png"))
    print(markdown(out))


def speedups(results, slots):
    """Per model: each mode's step-time speedup over eager at `slots` slots."""
    out = {}
    for r in results:
        at = {p["mode"]: p["step_time_s"] for p in r["points"] if p["batch"] == slots}
        out[r["model"]["name"]] = {m: at["eager"] / t for m, t in at.items() if m != "eager" and "eager" in at}
    return out


def markdown(out) -> str:
    lines = [f"Decode step time of the built-in sampler on **{out['machine']}** ({out['device']}), cache length "
             f"{out['cache_len']}, all slots busy, median of the timed steps; {out['threads']} torch threads; load "
             f"average {out['load_avg_before'][0]:.2f} before, {out['load_avg_after'][0]:.2f} after "
             f"({out['created']}).", ""]
    for r in out["models"]:
        m = r["model"]
        lines += [f"**{m['name']}**: {m['family']}, {m['params'] / 1e6:.2f}M parameters, {m['layers']} layers, "
                  f"hidden {m['hidden']}, {m['kv_heads']} KV heads, head_dim {m['head_dim']}, {m['dtype']}", ""]
        mode_names = list(dict.fromkeys(p["mode"] for p in r["points"]))
        lines.append("| slots | " + " | ".join(f"{mo} ms/step | {mo} tokens/s" for mo in mode_names) + " |")
        lines.append("|---:|" + "---:|---:|" * len(mode_names))
        for S in sorted({p["batch"] for p in r["points"]}):
            cells = []
            for mo in mode_names:
                (p,) = [p for p in r["points"] if p["batch"] == S and p["mode"] == mo]
                cells += [f"{p['step_time_s'] * 1e3:.3f}", f"{p['tokens_per_s']:.0f}"]
            lines.append(f"| {S} | " + " | ".join(cells) + " |")
        sp = out["speedups"][m["name"]]
        lines += ["", "Speedup over eager at the largest slot count: " +
                  ", ".join(f"{mo} {x:.2f}x" for mo, x in sp.items()), ""]
    return "\n".join(lines) + "\n"


def plot(out, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in out["models"]:
        for mo in dict.fromkeys(p["mode"] for p in r["points"]):
            pts = sorted((p["batch"], p["step_time_s"]) for p in r["points"] if p["mode"] == mo)
            xs = [x for x, _ in pts]
            axes[0].plot(xs, [t * 1e3 for _, t in pts], marker="o", label=f"{r['model']['name']} {mo}")
            axes[1].plot(xs, [x / t for x, t in pts], marker="o", label=f"{r['model']['name']} {mo}")
    for ax, ylabel in zip(axes, ("ms per decode step", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("slots")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Sampler decode step on {out['machine']} (cache {out['cache_len']}, {out['threads']} torch threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(Bench))
