"""Layout planner: how many GPUs sample and how many train, from first principles, checked by simulation.

A two-pool RL system: sampler replicas (tensor parallel over `tp` GPUs each, `B` sequences decoded together
with continuous batching) produce sequences; trainers consume `batch` sequences per optimizer step and
publish new weights. `predict` is the closed-form model, `simulate` a discrete-event simulation of the same
system, `sweep` the recommendation. Import as `leanrl.layout` (the command is scripts/plan_layout.py).

Symbols: P parameters, L layers, H_kv KV heads, d head dim, w / k bytes per weight / per KV element,
F peak dense FLOP/s and W HBM bytes/s per GPU, M GPU memory, tp GPUs per sampler replica, n = N_s / tp
replicas, B slots per replica, p prompt tokens, ℓ response length (a distribution), b sequences per step.

Sampler
  (1) KV bytes per token          kv = 2 · L · H_kv · d · k                        [Pope et al. 2022, §2]
  (2) KV cap on B                 B_max = ⌊(tp·M·u − P·w) / (kv · (p + ℓ_max))⌋     u: usable memory fraction
  (3) decode step (roofline)      t(B) = max((P·w + B·c̄·kv) / (tp·W), 2·P·B / (tp·F)) + t_0
                                  [Williams et al. 2009, roofline; Kaplan et al. 2020: 2P FLOPs per token]
      c̄ = p + E[ℓ²] / (2·E[ℓ]): the mean context of a slot under continuous batching (a slot is found in a
      sequence with probability ∝ ℓ, half-way through it on average). A measured curve (decode step time vs
      batch, benchmarks/sampler_latency.py) replaces (3); it is interpolated linearly in B.
  (4) knee of (3)                 B* = F·w / (2·W) (KV reads neglected): memory-bound below, compute above
  (5) prefill per sequence        t_pf = 2·P·p / (tp·F)        (compute-bound; 0 when p = 0), or a measured
                                  time per started sequence (`prefill_s`; 0 with a measured curve otherwise)
  (6) sampler rate                X_s = n / (E[ℓ]·t(B)/B + t_pf)   sequences/s, all slots busy
Trainer
  (7) FLOPs per trained token     6·P + 2·P·f      f: extra forward passes (reference model, proximal
                                  log-probs)     [Kaplan et al. 2020, C_train ≈ 6N per token]
  (8) optimizer step              T = b·(p + E[ℓ])·(6 + 2f)·P / (N_t·F·MFU), or b·(p + E[ℓ]) / (N_t·r) with a
                                  measured r tokens/s per GPU, or a measured T (`train_step_s`)
  (9) trainer rate                X_t = b / T
Pipelined (in-flight updates, admission: sequence i starts only if i < (max_lag + v + 1)·b at the version v
the samplers have [PipelineRL, Piché et al. 2025]; a pause π per weight update on the samplers; a handoff h per
optimizer step: the time from the trainer's step to the samplers having its weights, which stands for every
latency on the loop (batch and weight transport, wake-ups) and occupies neither pool; measured, 0 by default)
  (10) balance                    X = min(X_s·(1 − π·X/b), X_t, X_a): production = consumption
       closed-loop (admission)    X_a = (max_lag + 1)·b / (D + T + h),  D = E[ℓ]·t(B) + t_pf the mean sequence
                                  latency: at most (max_lag + 1)·b sequences are between admission and the
                                  arrival of the weights of their update (Little's law, L = λW [Little 1961])
       in ticket order            (the trainer takes batch v only once its every sequence is done, as leanrl's PPO
                                  takes rollouts in start order) Little's law on D misses the early finishers'
                                  wait: batch v starts when version v − max_lag reaches the samplers,
                                  C_{v−W} + h (C_v: the end of step v, W = max_lag + 1), is done after its slowest
                                  sequence, M_v (the longest of b draws of ℓ·t(B) + t_pf), and trains after step
                                  v − 1, so the gap between steps is G_v = max(h + T + M_v − Σ_{i=1}^{W−1} G_{v−i}, T)
                                  and X_a = b / E[G]. A max-plus linear recursion, whose cycle time has no closed
                                  form once M_v varies [Baccelli et al. 1992, ch. 7]: E[G] is its mean over
                                  up to TICKET_BATCHES batches (constant lengths: (D + T + h)/W, Little's law
                                  again). It gives every admitted sequence a slot; with fewer than W·b slots X_s
                                  caps it
  (11) lag per sequence           E[lag] = (X/b)·(D + T + h) when the samplers are the bottleneck: the versions
                                  published between a sequence's start and its consumption. With steps every
                                  Δ = b/X, a sequence that waits w for its batch sees ⌈(D + w + T + h)/Δ⌉ − 1
                                  publishes (version v reaches the samplers T + h after batch v − 1 is
                                  consumed); with w uniform over a step, E[w] = Δ/2, and a uniform phase, that is
                                  (D + T + h)/Δ [Little 1961 for the rate]. = max_lag when the trainer or the
                                  admission is
  (12) lag per token              the same count from the token's generation: a token at position j waits
                                  (ℓ − j)·t(B) for its sequence's end; averaged over tokens (a sequence
                                  weighs ℓ): E[lag_tok] = (X/b)·(t(B)·(E[ℓ²] + E[ℓ])/(2·E[ℓ]) + t_pf + T + h)
                                  when the samplers are the bottleneck, else max_lag − (X/b)·t(B)·(E[ℓ²] −
                                  E[ℓ])/(2·E[ℓ]) (a token is younger than its sequence by its position)
Sync (generate on all N GPUs, then train on all N) and one-step-off (separate pools, batch g generated by
version g − 1 while batch g − 1 trains)
  (13) generation of one batch    T_gen = m·t_pf + t(min(m, B))·S, m = ⌈b / n⌉ sequences per replica,
                                  S = E[max of m draws of ℓ] if m ≤ B (the straggler tail), else
                                  (m − B)·E[ℓ]/B + E[max of B] (full slots, then a last wave) [order
                                  statistics: E[max_m ℓ] = ∫₀¹ Q(u)·m·u^(m−1) du]
  (14) sync                       X = b / (T_gen(N) + T(N) + π),  lag 0
  (15) one-step-off               X = b / (max(T_gen(N_s), T(N_t)) + π),  lag 1
"""

import dataclasses
import functools
import heapq
import json
import math
import os
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from leanrl.cli import UsageError
from leanrl.metrics import read_metrics

MODES = ("sync", "one_step_off", "pipelined")


def read_json(path: str, what: str):
    """A JSON file the user named: a missing or malformed one is a UsageError that starts with `what`."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise UsageError(f"{what}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{what}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class GPU:
    name: str
    flops: float
    """peak dense bf16 FLOP/s (no sparsity)"""
    bandwidth: float
    """HBM bytes/s"""
    memory: float
    """bytes"""


# The vendors' datasheet figures (dense bf16 FLOP/s; the SXM parts for H100, H200 and A100 80GB). "CPU" is a nominal
# small server (fp32): pass a measured latency curve there.
GPUS = {
    "H100": GPU("H100", 989e12, 3.35e12, 80e9),
    "H200": GPU("H200", 989e12, 4.8e12, 141e9),
    "A100": GPU("A100", 312e12, 2.039e12, 80e9),
    "L40S": GPU("L40S", 362e12, 0.864e12, 48e9),
    "CPU": GPU("CPU", 0.1e12, 20e9, 16e9),
}

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Model:
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: int = 2
    kv_bytes: int = 2

    @property
    def kv_per_token(self) -> float:  # (1)
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    @classmethod
    def from_dir(cls, path: str, weight_bytes: int | None = None, kv_bytes: int | None = None) -> "Model":
        """From a local model directory's config.json (Llama/Qwen/Mistral layout); parameters counted from it."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise UsageError(f"model dir {path!r}: no config.json there")
        c = read_json(cfg_path, f"model dir {path!r}: config.json")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in c]
        if missing:
            raise UsageError(f"model dir {path!r}: config.json lacks {missing}")
        h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
        kv_heads, head_dim = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        params = layers * (attn + 3 * h * c["intermediate_size"]) + c["vocab_size"] * h * (
            1 if c.get("tie_word_embeddings", False) else 2)
        wb = weight_bytes or DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2)
        return cls(params, layers, kv_heads, head_dim, wb, kv_bytes or wb)


@dataclass(frozen=True)
class Lengths:
    """Response lengths in tokens: "lognormal" (median, sigma, capped at `cap`), "constant" (median), or
    "empirical" (values)."""
    kind: str = "lognormal"
    median: float = 512
    sigma: float = 1.0
    cap: int = 4096
    values: tuple = ()

    def __post_init__(self):
        if self.kind not in ("lognormal", "constant", "empirical"):
            raise UsageError(f"lengths.kind {self.kind!r}: choose lognormal, constant or empirical")
        if self.kind == "empirical" and not self.values:
            raise UsageError("lengths.values: an empirical distribution needs at least one length")
        if self.kind != "empirical" and not 1 <= self.median <= self.cap:
            raise UsageError(f"lengths.median {self.median}: must be between 1 and lengths.cap {self.cap}")

    @functools.cached_property
    def _grid(self):  # quantiles at 4096 mid-points: every moment and E[max] below from one grid
        u = (np.arange(4096) + 0.5) / 4096
        if self.kind == "constant":
            return u, np.full_like(u, float(self.median))
        if self.kind == "empirical":
            v = np.sort(np.asarray(self.values, dtype=float))
            return u, v[np.minimum((u * len(v)).astype(int), len(v) - 1)]
        z = np.array([NormalDist().inv_cdf(x) for x in u])
        return u, np.clip(np.round(self.median * np.exp(self.sigma * z)), 1, self.cap)

    @property
    def max(self) -> float:
        return float(self._grid[1].max())

    def moment(self, k: int) -> float:
        return float(np.mean(self._grid[1] ** k))

    def expected_max(self, m: int) -> float:  # (13)
        u, q = self._grid
        return float(np.mean(q * m * u ** (m - 1)))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant":
            return np.full(n, int(self.median))
        if self.kind == "empirical":
            return rng.choice(np.asarray(self.values, dtype=np.int64), n)
        return np.clip(np.round(self.median * np.exp(self.sigma * rng.standard_normal(n))), 1, self.cap).astype(int)


def lengths_from_metrics(path: str, cap: int | None = None) -> Lengths:
    """A log-normal fitted to a run's logged response lengths (charts/response_length_mean and _p90 averaged
    over its rows, cap from _max): p90 / mean = exp(1.2816·σ − σ²/2) solved for σ, median = mean / exp(σ²/2)."""
    rows = read_metrics(path)
    means = [r["charts/response_length_mean"] for r in rows if "charts/response_length_mean" in r]
    p90s = [r["charts/response_length_p90"] for r in rows if "charts/response_length_p90" in r]
    if not means or not p90s:
        raise UsageError(f"lengths from {path!r}: no charts/response_length_mean and _p90 logged")
    mean, ratio = float(np.mean(means)), float(np.mean(p90s)) / float(np.mean(means))
    z = NormalDist().inv_cdf(0.9)
    grid = np.linspace(0.0, z, 2001)  # exp(zσ − σ²/2) rises on [0, z]
    sigma = float(grid[np.argmin(np.abs(np.exp(z * grid - grid ** 2 / 2) - max(ratio, 1.0)))])
    top = cap or int(max(r.get("charts/response_length_max", 0) for r in rows) or 8 * mean)
    return Lengths("lognormal", median=max(mean / math.exp(sigma ** 2 / 2), 1.0), sigma=sigma, cap=max(top, 1))


@dataclass(frozen=True)
class LatencyCurve:
    """Measured decode step time (s) vs batch; linear in between, linear extrapolation past the last point."""
    batches: tuple
    step_times: tuple

    def __call__(self, b: float) -> float:
        x, y = self.batches, self.step_times
        if b <= x[-1] or len(x) == 1:
            return float(np.interp(b, x, y))
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return y[-1] + slope * (b - x[-1])

    @classmethod
    def from_file(cls, path: str, mode: str = "eager") -> "LatencyCurve":
        data = read_json(path, f"latency curve {path!r}")
        if "points" not in data:
            raise UsageError(f"latency curve {path!r}: no 'points' (written by benchmarks/sampler_latency.py)")
        pts = sorted((p["batch"], p["step_time_s"]) for p in data["points"] if p.get("mode") == mode)
        if not pts:
            modes = sorted({p.get("mode") for p in data["points"]})
            raise UsageError(f"latency curve {path!r}: no points for mode {mode!r}; it has {modes}")
        return cls(tuple(b for b, _ in pts), tuple(t for _, t in pts))


@dataclass(frozen=True)
class Setup:
    """Everything the planner needs; see the module docstring for the symbols."""
    total_gpus: int
    model: Model
    gpu: GPU
    lengths: Lengths = Lengths()
    prompt_len: int = 0
    batch: int = 512
    """sequences per optimizer step (prompts x group size)"""
    group_size: int = 1
    max_lag: int = 2
    mode: str = "pipelined"
    tp: int = 1
    """GPUs per sampler replica"""
    gpus_per_trainer: int = 1
    """trainer GPUs come in multiples of this (the data-parallel unit)"""
    mfu: float = 0.4
    train_tokens_per_s: float | None = None
    """measured trained tokens/s per GPU; replaces the MFU"""
    train_step_s: float | None = None
    """measured seconds per optimizer step; replaces both (fixed trainer pool, e.g. a CPU run)"""
    extra_forwards: int = 0
    prefill_s: float | None = None
    """measured seconds per started sequence (its prefill and admission); replaces (5)"""
    overhead_s: float = 0.0
    """t_0: fixed time per decode step (launches, sampling)"""
    pause_s: float | None = None
    """sampler pause per weight update (default: P·w bytes at 50 GB/s)"""
    handoff_s: float = 0.0
    """h, pipelined: seconds from the end of an optimizer step to the samplers having its weights (every latency
    on the loop, measured; benchmarks/layout_validation.py measures it for its processes transport)"""
    mem_util: float = 0.9
    latency: LatencyCurve | None = None
    consume: str = "finish"
    """the trainer takes sequences in "finish" order (PipelineRL) or "ticket" (start) order (leanrl PPO)"""

    def __post_init__(self):
        check(self)

    @property
    def pause(self) -> float:
        return self.model.params * self.model.weight_bytes / 50e9 if self.pause_s is None else self.pause_s


def check(s: Setup):
    """Inconsistent input raises a ValueError naming the input."""
    pos = dict(total_gpus=s.total_gpus, batch=s.batch, group_size=s.group_size, tp=s.tp,
               gpus_per_trainer=s.gpus_per_trainer, params=s.model.params, layers=s.model.layers)
    for name, v in pos.items():
        if not isinstance(v, (int, float)) or v <= 0:
            raise UsageError(f"{name} {v!r}: must be a positive number")
    if s.mode not in MODES:
        raise UsageError(f"mode {s.mode!r}: choose one of {MODES}")
    if s.max_lag < 0:
        raise UsageError(f"max_lag {s.max_lag}: cannot be negative")
    if s.handoff_s < 0:
        raise UsageError(f"handoff_s {s.handoff_s}: cannot be negative")
    if s.mode == "pipelined" and s.max_lag == 0:
        raise UsageError("max_lag 0 with mode pipelined: nothing may be generated while the trainer trains; use "
                         "mode sync, or max_lag >= 1")
    if s.batch % s.group_size:
        raise UsageError(f"batch {s.batch}: must be a multiple of group_size {s.group_size}")
    if s.consume not in ("finish", "ticket"):
        raise UsageError(f"consume {s.consume!r}: choose finish or ticket")
    if not 0 < s.mfu <= 1:
        raise UsageError(f"mfu {s.mfu}: must be in (0, 1]")
    if s.mode != "sync" and s.total_gpus < s.tp + s.gpus_per_trainer and s.train_step_s is None:
        raise UsageError(f"total_gpus {s.total_gpus}: a split needs at least tp + gpus_per_trainer = "
                         f"{s.tp + s.gpus_per_trainer}")
    if s.latency is None and s.model.params * s.model.weight_bytes > s.tp * s.gpu.memory * s.mem_util:
        raise UsageError(f"model: {s.model.params * s.model.weight_bytes / 1e9:.1f} GB of weights do not fit in "
                         f"tp={s.tp} x {s.gpu.name} ({s.gpu.memory / 1e9:.0f} GB, {s.mem_util:.0%} usable); "
                         "raise tp")


# ----------------------------------------------------------------------------------------------- the model
def kv_cap(s: Setup) -> int:  # (2)
    free = s.tp * s.gpu.memory * s.mem_util - s.model.params * s.model.weight_bytes
    return max(int(free // (s.model.kv_per_token * (s.prompt_len + s.lengths.max))), 0)


def knee(s: Setup) -> float:  # (4)
    return s.gpu.flops * s.model.weight_bytes / (2 * s.gpu.bandwidth)


def mean_context(s: Setup) -> float:
    return s.prompt_len + s.lengths.moment(2) / (2 * s.lengths.moment(1))


@functools.lru_cache(maxsize=4096)
def step_time(s: Setup, b: float) -> float:  # (3), or the measured curve
    if s.latency is not None:
        return s.latency(b)
    m, g = s.model, s.gpu
    mem = (m.params * m.weight_bytes + b * mean_context(s) * m.kv_per_token) / (s.tp * g.bandwidth)
    return max(mem, 2 * m.params * b / (s.tp * g.flops)) + s.overhead_s


def prefill_time(s: Setup) -> float:  # (5)
    if s.prefill_s is not None:
        return s.prefill_s
    return 2 * s.model.params * s.prompt_len / (s.tp * s.gpu.flops) if s.latency is None else 0.0


def train_step_time(s: Setup, n_train: int) -> float:  # (8)
    if s.train_step_s is not None:
        return s.train_step_s
    tokens = s.batch * (s.prompt_len + s.lengths.moment(1))
    if s.train_tokens_per_s is not None:
        return tokens / (n_train * s.train_tokens_per_s)
    return tokens * (6 + 2 * s.extra_forwards) * s.model.params / (n_train * s.gpu.flops * s.mfu)


def check_batch(s: Setup, b: int):
    cap = kv_cap(s)
    if s.latency is None and b > cap:
        raise UsageError(f"per-replica batch {b}: above the KV-cache cap {cap} for {s.model.kv_per_token:.0f} "
                         f"bytes/token x {s.prompt_len + s.lengths.max:.0f} tokens on tp={s.tp} x {s.gpu.name}")
    if b < 1:
        raise UsageError(f"per-replica batch {b}: must be at least 1")


@dataclass
class Prediction:
    mode: str
    n_sample: int
    n_train: int
    slots: int
    seqs_per_s: float
    tokens_per_s: float
    lag_mean: float
    lag_max: float
    token_lag_mean: float
    sampler_idle: float
    trainer_idle: float
    bound: str
    lag_hist: list = field(default_factory=list)
    token_lag_hist: list = field(default_factory=list)
    restarts: float = 0.0
    """sequences restarted per consumed sequence (finish order: the lag bound's cost; simulated only)"""

    def row(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.endswith("hist")}


def _generation_time(s: Setup, replicas: int, b: int) -> tuple[float, float]:  # (13): batch time, busy time
    m = math.ceil(s.batch / replicas)
    active = min(m, b)
    t = step_time(s, active)
    # all m at once: the longest of m; in waves: the first m - b at the full rate, then a last wave of b
    steps = s.lengths.expected_max(m) if m <= b else (m - b) * s.lengths.moment(1) / b + s.lengths.expected_max(b)
    return m * prefill_time(s) + t * steps, m * prefill_time(s) + t * m * s.lengths.moment(1) / active


TICKET_BATCHES = 8192  # the ticket-order recursion (10) is iterated over: its mean within ~0.5 % at b = 1


@functools.lru_cache(maxsize=8)
def _longest_of_batches(lengths: Lengths, batch: int) -> np.ndarray:
    """The longest of each batch's `batch` lengths, for up to TICKET_BATCHES batches (at most 4M draws: a large
    batch's longest varies less), the same draws every call: a sweep compares layouts, not noise."""
    n = min(TICKET_BATCHES, max(512, (1 << 22) // batch))
    return lengths.sample(np.random.default_rng(0), n * batch).reshape(n, batch).max(1)


def _ticket_gap(s: Setup, t: float, T: float) -> float:  # (10), ticket order: E[G]
    ready = s.handoff_s + T + _longest_of_batches(s.lengths, s.batch) * t + prefill_time(s)
    gaps = [0.0] * s.max_lag  # G_v, after W − 1 zeros
    for r in ready:
        gaps.append(max(r - sum(gaps[-s.max_lag:]), T))
    return float(np.mean(gaps[s.max_lag + len(ready) // 2:]))  # the first half is the transient


def predict(s: Setup, n_sample: int, b: int) -> Prediction:
    """The closed-form model at a split (n_sample GPUs sample, the rest train; sync: all do both) and B = b."""
    check_batch(s, b)
    if s.mode != "sync" and n_sample % s.tp:
        raise UsageError(f"n_sample {n_sample}: must be a multiple of tp {s.tp}")
    n_train = s.total_gpus if s.mode == "sync" else s.total_gpus - n_sample
    if s.mode != "sync" and s.train_step_s is None and (n_train < 1 or n_train % s.gpus_per_trainer):
        raise UsageError(f"n_train {n_train}: must be a positive multiple of gpus_per_trainer {s.gpus_per_trainer}")
    replicas = (s.total_gpus if s.mode == "sync" else n_sample) // s.tp
    T, El, El2 = train_step_time(s, n_train), s.lengths.moment(1), s.lengths.moment(2)
    tok = s.lengths.moment(1)
    if s.mode in ("sync", "one_step_off"):
        gen, busy = _generation_time(s, replicas, b)
        period = gen + T + s.pause if s.mode == "sync" else max(gen, T) + s.pause
        X = s.batch / period
        lag = 0.0 if s.mode == "sync" else 1.0
        bound = "serial" if s.mode == "sync" else ("sampler" if gen >= T else "trainer")
        return Prediction(s.mode, n_sample if s.mode != "sync" else s.total_gpus, n_train, b, X, X * tok, lag, lag,
                          lag, 1 - busy / period, 1 - T / period, bound)
    t = step_time(s, b)
    D = El * t + prefill_time(s)
    Xs = replicas / (El * t / b + prefill_time(s))
    Xs_eff = Xs / (1 + s.pause * Xs / s.batch)  # X = Xs·(1 − π·X/b) solved for X
    loop = T + s.handoff_s  # from a batch's consumption to its weights at the samplers
    Xt = s.batch / T
    Xa = s.batch / _ticket_gap(s, t, T) if s.consume == "ticket" else (s.max_lag + 1) * s.batch / (D + loop)
    X = min(Xs_eff, Xt, Xa)
    bound = "sampler" if X == Xs_eff else "trainer" if X == Xt else "admission"
    steps = X / s.batch
    if bound == "sampler":
        lag = min(steps * (D + loop), s.max_lag)
        lag_max = min(math.ceil(steps * (s.lengths.max * t + prefill_time(s) + loop)), s.max_lag)
    else:
        lag, lag_max = float(s.max_lag), float(s.max_lag)
    if bound == "sampler":
        token_lag = min(steps * (t * (El2 + El) / (2 * El) + prefill_time(s) + loop), s.max_lag)
    else:
        token_lag = max(lag - steps * t * (El2 - El) / (2 * El), 0.0)
    return Prediction("pipelined", n_sample, n_train, b, X, X * tok, lag, lag_max, token_lag, 1 - X / Xs_eff,
                      1 - X / Xt, bound)


# ------------------------------------------------------------------------------------------- the simulator
def simulate(s: Setup, n_sample: int, b: int, steps: int = 200, warmup: int = 20, seed: int = 0,
             trace: dict | None = None) -> Prediction:
    """Discrete-event simulation: per-replica continuous batching at t(active) per decode step, lengths drawn
    from the distribution, admission control, in-flight updates between decode steps (pipelined) or at batch
    boundaries (sync, one-step-off), a pause per weight update. Statistics over optimizer steps after `warmup`.
    Lag is what leanrl's runs log: the trainer's version when it consumes a sequence (or token) minus the version
    of the weights that started it (that sampled it), at most max_lag. In finish order a sequence that could only
    be consumed later than that (its batch is complete after the bound has moved past it) is restarted from its
    prompt, running or finished, as leanrl's sampler restarts it (a fresh draw of its length); Prediction.restarts
    counts them per consumed sequence. `trace`, when given, receives each started sequence's start version (its
    last start) and consumption version (-1: never)."""
    check_batch(s, b)
    rng = np.random.default_rng(seed)
    pipelined = s.mode == "pipelined"
    n_train = s.total_gpus if s.mode == "sync" else s.total_gpus - n_sample
    R = (s.total_gpus if s.mode == "sync" else n_sample) // s.tp
    T, t_pf, width = train_step_time(s, n_train), prefill_time(s), s.max_lag + 2
    t_step = [step_time(s, n) for n in range(b + 1)]  # by active sequences: a list index, not a cache's hash of s
    total = (steps + s.max_lag + 2) * s.batch
    length = s.lengths.sample(rng, total)
    start_ver = np.zeros(total, dtype=np.int64)
    tok = np.zeros((total, width), dtype=np.int64)  # tokens generated at start version + j
    finish = np.full(total, np.inf)
    consumed_at = np.full(total, -1, dtype=np.int64)
    # replica state: the time of its last step boundary, its active sequences and their remaining tokens
    t0 = np.zeros(R)
    active = [np.zeros(0, dtype=np.int64) for _ in range(R)]
    rem = [np.zeros(0, dtype=np.int64) for _ in range(R)]
    cur_ver = np.zeros(R, dtype=np.int64)  # the weights each replica decodes with
    stamp = np.zeros(R, dtype=np.int64)
    busy_slots = np.zeros(R)  # slot-seconds decoding, for the idle fraction
    events = []  # (time, order, kind, replica, stamp)
    order = 0
    # version: the trainer's; visible: the samplers' (pipelined: `handoff_s` behind; else the same)
    state = dict(started=0, version=0, visible=0, trainer_busy=False, finished_fifo=[])
    restarts = []  # sequences to start again, before any new one
    window = dict(t_start=None, t_end=None, train_busy=0.0, busy0=None, restarts=0)
    seq_lags, tok_lags = np.zeros(width, dtype=np.int64), np.zeros(width, dtype=np.int64)
    consumed_tokens, consumed_seqs = 0, 0

    def push(time, kind, r=-1):
        nonlocal order
        order += 1
        heapq.heappush(events, (time, order, kind, r, stamp[r] if r >= 0 else 0))

    def advance(r, k, dt):  # k decode steps on replica r
        ids = active[r]
        if len(ids) and k > 0:
            rem[r] -= k
            tok[ids, np.minimum(cur_ver[r] - start_ver[ids], width - 1)] += k
            busy_slots[r] += len(ids) * k * dt

    def schedule(r):
        stamp[r] += 1
        if len(active[r]):
            push(t0[r] + int(rem[r].min()) * t_step[len(active[r])], "finish", r)

    def finish_step(q, now):  # replica q finishes the decode step it is in at `now`
        if len(active[q]):
            dt = t_step[len(active[q])]
            k = max(math.ceil((now - t0[q]) / dt - 1e-9), 0)
            advance(q, k, dt)
            t0[q] += k * dt
            done = rem[q] <= 0
            for i in active[q][done]:
                finish[i] = t0[q]
                state["finished_fifo"].append(int(i))
            active[q], rem[q] = active[q][~done], rem[q][~done]

    def arrive(now):  # in-flight update: each replica finishes its current step, then pauses
        state["visible"] += 1
        for q in range(R):
            finish_step(q, now)
            t0[q] = max(t0[q], now) + s.pause
            cur_ver[q] = state["visible"]
            schedule(q)

    def restart_stale(now):  # finish order: what the trainer at `version` may never consume starts again
        oldest = state["version"] - s.max_lag
        stale = []
        for r in range(R):
            gone = start_ver[active[r]] < oldest
            if gone.any():  # between two decode steps, as the sampler restarts them
                finish_step(r, now)
                gone = start_ver[active[r]] < oldest
                stale += active[r][gone].tolist()
                active[r], rem[r] = active[r][~gone], rem[r][~gone]
                schedule(r)
        fifo = state["finished_fifo"]
        stale += [i for i in fifo if start_ver[i] < oldest]
        if stale:
            state["finished_fifo"] = [i for i in fifo if start_ver[i] >= oldest]
            length[stale] = s.lengths.sample(rng, len(stale))
            tok[stale], finish[stale] = 0, np.inf
            restarts.extend(stale)
            if state["version"] > warmup:
                window["restarts"] += len(stale)

    def next_start():  # the sequence to start next, if any may start now
        if restarts:
            return restarts[0]
        return state["started"] if may_start(state["started"]) else None

    def may_start(i):
        if i >= total:
            return False
        if pipelined:
            return i < (s.max_lag + state["visible"] + 1) * s.batch
        g = i // s.batch
        off = 1 if s.mode == "one_step_off" else 0
        prev_done = g == 0 or np.isfinite(finish[(g - 1) * s.batch:g * s.batch]).all()
        return state["visible"] >= g - off and prev_done

    def admit(now):
        if next_start() is None:  # most events start nothing
            return
        changed = set()
        count = [len(ids) for ids in active]
        started = [[] for _ in range(R)]  # joins `active` at the end: one concatenation per replica, not one per id
        while (i := next_start()) is not None:
            free = [r for r in range(R) if count[r] < b]
            if not free:
                break
            r = min(free, key=count.__getitem__)
            if not pipelined and i % s.batch == 0 and i > 0:  # new weights load at a batch boundary
                for q in range(R):
                    t0[q] = max(t0[q], now) + s.pause
                    cur_ver[q] = state["visible"]
                    changed.add(q)
            if not count[r]:
                t0[r] = max(t0[r], now)
            start_ver[i] = cur_ver[r] if not pipelined else state["visible"]
            if pipelined:
                cur_ver[r] = state["visible"]
            started[r].append(i)
            count[r] += 1
            t0[r] += t_pf
            busy_slots[r] += t_pf
            if restarts and restarts[0] == i:
                restarts.pop(0)
            else:
                state["started"] += 1
            changed.add(r)
        for r in changed:
            if started[r]:
                active[r] = np.concatenate([active[r], started[r]])
                rem[r] = np.concatenate([rem[r], length[started[r]]])
            schedule(r)

    def try_train(now):
        nonlocal consumed_tokens, consumed_seqs
        if state["trainer_busy"]:
            return
        v = state["version"]
        if s.consume == "finish":
            if len(state["finished_fifo"]) < s.batch:
                return
            ids = np.array(state["finished_fifo"][:s.batch])
            del state["finished_fifo"][:s.batch]
        else:
            ids = np.arange(v * s.batch, (v + 1) * s.batch)
            if not np.isfinite(finish[ids]).all():
                return
        if v == steps:  # the window ends where the batch of step `steps` is consumed: whole periods
            window["t_end"] = now
            return
        consumed_at[ids] = v
        if v == warmup:
            window["t_start"], window["busy0"] = now, busy_slots.sum()
        if warmup <= v < steps:
            lags = v - start_ver[ids]
            np.add.at(seq_lags, np.minimum(lags, width - 1), 1)
            for j in range(width):
                np.add.at(tok_lags, np.clip(lags - j, 0, width - 1), tok[ids, j])
            consumed_seqs += len(ids)
            consumed_tokens += int(length[ids].sum())
            window["train_busy"] += T
        state["trainer_busy"] = True
        push(now + T, "trained")

    now = 0.0
    admit(0.0)
    while events and window["t_end"] is None:
        now, _, kind, r, st = heapq.heappop(events)
        if kind == "finish":
            if st != stamp[r]:
                continue
            dt = t_step[len(active[r])]
            k = int(rem[r].min())
            advance(r, k, dt)
            t0[r] = now
            done = rem[r] <= 0
            for i in active[r][done]:
                finish[i] = now
                state["finished_fifo"].append(int(i))
            active[r], rem[r] = active[r][~done], rem[r][~done]
            schedule(r)
            try_train(now)
            admit(now)
        elif kind == "trained":  # the trainer finished step v: publish v + 1
            state["trainer_busy"] = False
            state["version"] += 1
            if s.consume == "finish" and pipelined:
                restart_stale(now)
            if pipelined:
                push(now + s.handoff_s, "arrived")
            else:
                state["visible"] = state["version"]
            try_train(now)
            admit(now)
        else:  # the weights of the oldest publish in flight reach the samplers
            arrive(now)
            try_train(now)
            admit(now)
    if trace is not None:
        trace.update(start_version=start_ver[:state["started"]].copy(), consumed_at=consumed_at[:state["started"]])
    if window["t_start"] is None or window["t_end"] is None:
        raise RuntimeError("simulation stalled before reaching steady state: check the admission settings")
    span = window["t_end"] - window["t_start"]
    X = consumed_seqs / span
    slot_time = R * b * span
    hist = seq_lags / max(seq_lags.sum(), 1)
    thist = tok_lags / max(tok_lags.sum(), 1)
    lags = np.arange(width)
    return Prediction(s.mode, n_sample if s.mode != "sync" else s.total_gpus, n_train, b, float(X),
                      consumed_tokens / span, float((hist * lags).sum()), float(lags[seq_lags > 0].max()),
                      float((thist * lags).sum()), _fraction(1 - (busy_slots.sum() - window["busy0"]) / slot_time),
                      _fraction(1 - window["train_busy"] / span), "simulated", hist.tolist(), thist.tolist(),
                      window["restarts"] / consumed_seqs)


def _fraction(x: float) -> float:
    """An idle fraction: rounding of sums of event times leaves some a few ulps outside [0, 1]."""
    return float(min(max(x, 0.0), 1.0))


# ------------------------------------------------------------------------------------------ the sweep
def candidate_batches(s: Setup) -> list[int]:
    cap = kv_cap(s) if s.latency is None else max(s.latency.batches)
    out = sorted({2 ** k for k in range(int(math.log2(max(cap, 1))) + 1)} | {cap})
    return [b for b in out if b >= 1]


def splits(s: Setup) -> list[int]:
    if s.mode == "sync":
        return [s.total_gpus]
    return [n for n in range(s.tp, s.total_gpus, s.tp)
            if (s.total_gpus - n) % s.gpus_per_trainer == 0 and s.total_gpus - n >= s.gpus_per_trainer]


def sweep(s: Setup, batches: list[int] | None = None) -> list[Prediction]:
    """Every split and per-replica batch under the KV cap, best first (throughput, then lower lag)."""
    if s.latency is None and kv_cap(s) < 1:
        raise UsageError(f"model: no KV-cache room on tp={s.tp} x {s.gpu.name} for one sequence of "
                         f"{s.prompt_len + s.lengths.max:.0f} tokens")
    out = [predict(s, n, b) for n in splits(s) for b in (batches or candidate_batches(s))]
    if not out:
        raise UsageError(f"total_gpus {s.total_gpus}: no split into tp={s.tp} samplers and trainers of "
                         f"{s.gpus_per_trainer}")
    return sorted(out, key=lambda p: (-round(p.seqs_per_s, 9), p.lag_mean, p.slots))


# ------------------------------------------------------------------------------------------- --compare
def last_metrics(path: str) -> dict:
    """The last logged value of each key of a run's metrics.jsonl (and the run's response lengths when it
    logged them)."""
    last = {}
    for row in read_metrics(path):
        last.update(row)
    if not last:
        raise UsageError(f"metrics {path!r}: empty")
    return last


def compare(pred: Prediction, measured: dict, seqs_per_unit: float = 1.0) -> list[tuple]:
    """(quantity, predicted, measured, relative or absolute error) for what the run logged. `seqs_per_unit`:
    the run's throughput unit per planner sequence (env steps per collector batch for PPO)."""
    rows = []
    sps = measured.get("charts/SPS")
    if sps is not None:
        p = pred.seqs_per_s * seqs_per_unit
        rows.append(("throughput (run units/s)", p, sps, (p - sps) / sps))
    for key, name, val in (("async/lag_mean", "lag mean", pred.lag_mean), ("async/lag_max", "lag max", pred.lag_max),
                           ("async/trainer_idle_frac", "trainer idle", pred.trainer_idle),
                           ("async/collector_idle_frac", "sampler idle", pred.sampler_idle)):
        if key in measured:
            rows.append((name, val, measured[key], val - measured[key]))
    if not rows:
        raise UsageError("metrics: none of charts/SPS, async/lag_mean, async/trainer_idle_frac, "
                         "async/collector_idle_frac logged")
    return rows


def load_setup(cfg: dict) -> Setup:
    """A Setup from a dict (a YAML/JSON file or the command's flags): model, gpu, lengths as sub-dicts."""
    cfg = dict(cfg)
    hints = dict(total_gpus="--total-gpus N",
                 gpu=f"--gpu ({', '.join(GPUS)}) or --gpu-flops, --gpu-bandwidth, --gpu-memory",
                 model="--model-dir DIR or --params/--layers/--kv-heads/--head-dim")
    missing = [key for key in hints if cfg.get(key) is None]
    if missing:  # all of them at once: a first try with no flags should not take three
        raise UsageError(f"missing {', '.join(missing)} (needed by the planner): "
                         f"{'; '.join(hints[k] for k in missing)}; or these keys in a --config file")
    model = cfg.pop("model")
    if isinstance(model, str):
        model = Model.from_dir(model)
    elif isinstance(model, dict):
        need = [k for k in ("params", "layers", "kv_heads", "head_dim") if k not in model]
        if need:
            raise UsageError(f"model: missing {need}")
        model = dict(model)
        for k in ("weight_bytes", "kv_bytes"):
            if isinstance(model.get(k), str):
                model[k] = DTYPE_BYTES[model[k]]
        model = Model(**{k: model[k] for k in ("params", "layers", "kv_heads", "head_dim", "weight_bytes",
                                              "kv_bytes") if k in model})
    gpu = cfg.pop("gpu")
    if isinstance(gpu, str):
        if gpu.upper() not in GPUS:
            raise UsageError(f"gpu {gpu!r}: not in the table {sorted(GPUS)}; give flops, bandwidth, memory")
        gpu = GPUS[gpu.upper()]
    elif isinstance(gpu, dict):
        need = [k for k in ("flops", "bandwidth", "memory") if k not in gpu]
        if need:
            raise UsageError(f"gpu: missing {need}")
        gpu = GPU(gpu.get("name", "custom"), gpu["flops"], gpu["bandwidth"], gpu["memory"])
    lengths = cfg.pop("lengths", {})
    if isinstance(lengths, dict):
        lengths = Lengths(**{**lengths, "values": tuple(lengths.get("values", ()))})
    latency = cfg.pop("latency_curve", None)
    mode = cfg.pop("latency_mode", "eager")
    if isinstance(latency, str):
        latency = LatencyCurve.from_file(latency, mode)
    unknown = set(cfg) - {f.name for f in dataclasses.fields(Setup)}
    if unknown:
        raise UsageError(f"unknown planner inputs {sorted(unknown)}")
    return Setup(model=model, gpu=gpu, lengths=lengths, latency=latency, **cfg)
