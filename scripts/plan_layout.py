"""How to split a pool of GPUs between samplers and trainers: the planner's recommendation, or (--compare) its
prediction next to a finished run's metrics. Formulas: leanrl/layout.py.

    python scripts/plan_layout.py --total-gpus 8 --gpu H100 --params 7e9 --layers 32 --kv-heads 8 --head-dim 128 \\
        --prompt-len 512 --length-median 1000 --length-sigma 1.0 --length-cap 8192 --batch 512 --max-lag 4
    python scripts/plan_layout.py --config plan.yaml --out plans/      # the same inputs from a YAML/JSON file
    python scripts/plan_layout.py --config plan.yaml --compare runs/x/metrics.jsonl --n-sample 4 --slots 64
"""

import json
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro

import leanrl
from leanrl import layout


@dataclass
class Args:
    config: str | None = None
    """YAML or JSON file with the planner inputs (keys as the flags below, model/gpu/lengths as sub-dicts);
    flags given on the command line override it"""
    total_gpus: int | None = None
    """GPUs in the pool"""
    gpu: str | None = None
    """H100, H200, A100, L40S or CPU (built-in table), unless --gpu-flops/--gpu-bandwidth/--gpu-memory"""
    gpu_flops: float | None = None
    """peak dense FLOP/s per GPU (with --gpu-bandwidth and --gpu-memory: a GPU not in the table)"""
    gpu_bandwidth: float | None = None
    """HBM bytes/s per GPU"""
    gpu_memory: float | None = None
    """bytes per GPU"""
    model_dir: str | None = None
    """a local model directory: its config.json gives parameters, layers, KV heads, head dim"""
    params: float | None = None
    """model parameters"""
    layers: int | None = None
    """transformer layers"""
    kv_heads: int | None = None
    """KV heads (grouped-query attention)"""
    head_dim: int | None = None
    """head dimension"""
    dtype: str | None = None
    """weights and KV cache dtype: bf16, fp16, fp32, fp8"""
    tp: int | None = None
    """GPUs per sampler replica (tensor parallel)"""
    gpus_per_trainer: int | None = None
    """trainer GPUs come in multiples of this"""
    batch: int | None = None
    """sequences per optimizer step (prompts x group size)"""
    group_size: int | None = None
    """samples per prompt"""
    max_lag: int | None = None
    """staleness bound in optimizer steps"""
    mode: Literal["pipelined", "one_step_off", "sync"] | None = None
    """pipelined (in-flight updates), one_step_off, or sync (generate on all GPUs, then train on all)"""
    prompt_len: int | None = None
    """prompt tokens per sequence"""
    length_dist: Literal["lognormal", "constant"] | None = None
    """response length distribution"""
    length_median: float | None = None
    """median response length (tokens)"""
    length_sigma: float | None = None
    """log-std of the log-normal"""
    length_cap: int | None = None
    """maximum response length (tokens)"""
    lengths_from: str | None = None
    """a finished run's metrics.jsonl: a log-normal fitted to its response length mean and p90"""
    latency_curve: str | None = None
    """measured decode step time vs batch (benchmarks/sampler_latency.py JSON): replaces the roofline"""
    latency_mode: str | None = None
    """which curve of that file: eager, compile, compile+cudagraphs"""
    mfu: float | None = None
    """trainer model FLOP utilization"""
    train_tokens_per_s: float | None = None
    """measured trained tokens/s per GPU (replaces the MFU)"""
    train_step_s: float | None = None
    """measured seconds per optimizer step (replaces both)"""
    extra_forwards: int | None = None
    """extra forward passes per trained token (reference model, proximal log-probs)"""
    pause_s: float | None = None
    """sampler pause per weight update (default: the weights at 50 GB/s)"""
    overhead_s: float | None = None
    """fixed time per decode step"""
    handoff_s: float | None = None
    """pipelined: seconds from the end of an optimizer step to the samplers having its weights (transport,
    wake-ups; measured)"""
    top: int = 5
    """layouts shown"""
    simulate: bool = True
    """also run the simulator on the shown layouts"""
    sim_steps: int = 200
    """optimizer steps simulated"""
    out: str | None = None
    """folder for the plots (throughput vs split, latency curve with the knee, lag histogram) and plan.json"""
    compare: str | None = None
    """a finished run's metrics.jsonl: predicted vs measured at --n-sample / --slots"""
    n_sample: int | None = None
    """with --compare: the run's sampler GPUs; without: evaluate only this split"""
    slots: int | None = None
    """with --compare: the run's per-replica batch"""
    units_per_sequence: float = 1.0
    """with --compare: the run's throughput unit per planner sequence (e.g. env steps per PPO batch)"""


FLAG_TO_KEY = {"total_gpus", "tp", "gpus_per_trainer", "batch", "group_size", "max_lag", "mode", "prompt_len",
               "mfu", "train_tokens_per_s", "train_step_s", "extra_forwards", "pause_s", "overhead_s",
               "handoff_s", "latency_curve", "latency_mode"}


def read_config(path: str) -> dict:
    if path.endswith((".yaml", ".yml")):
        import yaml
        try:
            with open(path) as f:
                cfg = yaml.safe_load(f)
        except OSError as e:
            raise leanrl.UsageError(f"--config {path!r}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise leanrl.UsageError(f"--config {path!r}: not valid YAML ({' '.join(str(e).split())})") from None
    else:
        cfg = layout.read_json(path, f"--config {path!r}")
    if not isinstance(cfg, dict):
        raise leanrl.UsageError(f"--config {path!r}: expected a mapping of planner inputs")
    return cfg


def build_config(a: Args) -> dict:
    cfg = read_config(a.config) if a.config else {}
    cfg.update({k: getattr(a, k) for k in FLAG_TO_KEY if getattr(a, k) is not None})
    if a.model_dir:
        cfg["model"] = a.model_dir
    elif any(getattr(a, k) is not None for k in ("params", "layers", "kv_heads", "head_dim", "dtype")):
        model = dict(cfg["model"]) if isinstance(cfg.get("model"), dict) else {}
        model.update({k: getattr(a, k) for k in ("params", "layers", "kv_heads", "head_dim") if getattr(a, k)})
        if a.dtype:
            model["weight_bytes"] = model["kv_bytes"] = a.dtype
        cfg["model"] = model
    if a.gpu_flops or a.gpu_bandwidth or a.gpu_memory:
        cfg["gpu"] = dict(flops=a.gpu_flops, bandwidth=a.gpu_bandwidth, memory=a.gpu_memory)
        cfg["gpu"] = {k: v for k, v in cfg["gpu"].items() if v is not None}
    elif a.gpu:
        cfg["gpu"] = a.gpu
    if a.lengths_from:
        cfg["lengths"] = layout.lengths_from_metrics(a.lengths_from, a.length_cap)
    else:
        lengths = dict(cfg.get("lengths") or {})
        for flag, key in (("length_dist", "kind"), ("length_median", "median"), ("length_sigma", "sigma"),
                          ("length_cap", "cap")):
            if getattr(a, flag) is not None:
                lengths[key] = getattr(a, flag)
        cfg["lengths"] = lengths
    return cfg


def table(preds: list, sims: dict) -> str:
    lines = ["| # | sampler GPUs | trainer GPUs | slots/replica | seq/s | tokens/s | lag mean (seq/token) | lag max "
             "| sampler idle | trainer idle | bound | simulated seq/s | simulated lag (seq/token) | simulated tokens/s "
             "| restarted per consumed |", "|---" * 15 + "|"]
    for i, p in enumerate(preds):
        s = sims.get(i)
        sim = (f"{s.seqs_per_s:.3g} | {s.lag_mean:.2f} / {s.token_lag_mean:.2f} | {s.tokens_per_s:.4g} | "
               f"{s.restarts:.3f}" if s else "— | — | — | —")
        lines.append(f"| {i + 1} | {p.n_sample} | {p.n_train} | {p.slots} | {p.seqs_per_s:.3g} | "
                     f"{p.tokens_per_s:.4g} | {p.lag_mean:.2f} / {p.token_lag_mean:.2f} | {p.lag_max:.0f} | "
                     f"{p.sampler_idle:.2f} | {p.trainer_idle:.2f} | {p.bound} | {sim} |")
    return "\n".join(lines)


def plots(setup: layout.Setup, preds: list, best_sim, out: str):
    from matplotlib.figure import Figure

    os.makedirs(out, exist_ok=True)
    fig = Figure(figsize=(16, 4.2))  # a bare Figure renders with Agg and leaves pyplot's backend alone
    axes = fig.subplots(1, 3)
    best_per_split = {}
    for p in preds:
        if p.n_sample not in best_per_split or p.seqs_per_s > best_per_split[p.n_sample].seqs_per_s:
            best_per_split[p.n_sample] = p
    xs = sorted(best_per_split)
    axes[0].plot(xs, [best_per_split[x].tokens_per_s for x in xs], marker="o")
    axes[0].set(xlabel="sampler GPUs (rest train)", ylabel="tokens/s (best per-replica batch)",
                title=f"{setup.mode}, {setup.total_gpus} x {setup.gpu.name}")
    cap = layout.kv_cap(setup) if setup.latency is None else max(setup.latency.batches)
    top = max(cap, 2) if setup.latency else max(cap, 2 * layout.knee(setup))  # show both regimes
    bs = np.unique(np.geomspace(1, top, 60).astype(int))
    axes[1].plot(bs, [bs_ / layout.step_time(setup, bs_) for bs_ in bs])
    if setup.latency is None:
        axes[1].axvline(layout.knee(setup), ls="--", color="gray", label=f"knee B* = {layout.knee(setup):.0f}")
        axes[1].axvline(cap, ls=":", color="red", label=f"KV cap {cap}")
        axes[1].legend()
    axes[1].set(xscale="log", xlabel="batch per replica B", ylabel="tokens/s per replica",
                title="decode: " + ("measured curve" if setup.latency else "roofline"))
    if best_sim is not None:
        k = np.arange(len(best_sim.lag_hist))
        axes[2].bar(k - 0.2, best_sim.lag_hist, width=0.4, label="per sequence")
        axes[2].bar(k + 0.2, best_sim.token_lag_hist, width=0.4, label="per token")
        axes[2].legend()
    axes[2].set(xlabel="lag (optimizer steps)", ylabel="fraction", title="simulated lag, best layout")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "layout_plan.png"), dpi=110)


def main(a: Args):
    if a.out:
        leanrl.require_extra("--out (its plots)", "matplotlib", "plots")
    setup = layout.load_setup(build_config(a))
    if a.compare:
        if a.n_sample is None or a.slots is None:
            raise leanrl.UsageError("--compare needs --n-sample and --slots (the run's layout)")
        measured = layout.last_metrics(a.compare)
        pred = layout.predict(setup, a.n_sample, a.slots)
        print(f"{'quantity':<26}{'predicted':>12}{'measured':>12}{'error':>10}")
        for name, p, m, err in layout.compare(pred, measured, a.units_per_sequence):
            e = f"{err:+.1%}" if name.startswith("throughput") else f"{err:+.2f}"
            print(f"{name:<26}{p:>12.4g}{m:>12.4g}{e:>10}")
        return
    preds = layout.sweep(setup)
    if a.n_sample is not None:  # a given split (e.g. a naive 50/50): its best per-replica batch
        preds = [p for p in preds if p.n_sample == a.n_sample]
        if not preds:
            raise leanrl.UsageError(f"--n-sample {a.n_sample}: not a valid split; choose from {layout.splits(setup)}")
    shown = preds[:a.top]
    sims = {i: layout.simulate(setup, p.n_sample, p.slots, steps=a.sim_steps, warmup=a.sim_steps // 10)
            for i, p in enumerate(shown)} if a.simulate else {}
    best = shown[0]
    cap = layout.kv_cap(setup)
    print(f"{setup.total_gpus} x {setup.gpu.name}, {setup.model.params / 1e9:.3g}B parameters, mode {setup.mode}, "
          f"max_lag {setup.max_lag}; KV cap {cap} sequences per replica, roofline knee B* = {layout.knee(setup):.0f}")
    print(table(shown, sims))
    print(f"best: {best.n_sample} sampler GPUs ({best.n_sample // setup.tp} replicas of tp={setup.tp}) x "
          f"{best.slots} slots, {best.n_train} trainer GPUs: {best.tokens_per_s:.4g} tokens/s, lag "
          f"{best.lag_mean:.2f} ({best.bound}-bound)")
    if a.out:
        plots(setup, preds, sims.get(0), a.out)
        with open(os.path.join(a.out, "plan.json"), "w") as f:
            json.dump({"best": best.row(), "layouts": [p.row() for p in shown],
                       "simulated": [sims[i].row() for i in sorted(sims)]}, f, indent=1, default=float)


if __name__ == "__main__":
    with leanrl.clean_exit():  # bad input (leanrl.UsageError): its one-line message, no traceback
        main(tyro.cli(Args))
