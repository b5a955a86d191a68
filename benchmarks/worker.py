"""Measure one entry in the given modes, all in one process, and write the figures as JSON.

Each mode is built and warmed up on its own (its first calls give compile and capture time, and the
memory it grows by), then the timed samples of all modes are taken in turn, round robin: a load spike
from another process hits every mode alike, so the ratios between modes hold on a busy machine.

    python benchmarks/worker.py ppo_cartpole --modes eager,compile --device cpu --result out.json
"""

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import leanrl  # noqa: E402
from entries import ENTRIES, MODES, SCALING, build  # noqa: E402
from measure import gpu_busy, memory_growth_mb, memory_mark, sync, time_interleaved, timed  # noqa: E402

# CudaGraphModule runs `warmup - 1` plain calls (the first one compiles), then captures on the next.
WARMUP = inspect.signature(leanrl.accelerate).parameters["warmup"].default
# Seconds per mode spent timing each function and timing end-to-end training: enough samples for a
# stable median on a shared CPU; on GPU, short, to aim at the whole suite in one 10-minute call.
BUDGETS = {"cpu": dict(budget_s=4.0, measure_s=6.0), "cuda": dict(budget_s=1.0, measure_s=2.0),
           "quick": dict(budget_s=0.3, measure_s=0.3)}


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


class Run:
    """One mode of the entry: its algorithm and envs, the functions it hands out, its figures."""

    def __init__(self, name, mode, device, quick, run_dir, overrides):
        compile, cudagraphs = MODES[mode]
        self.device = device
        self.graphs = cudagraphs and device.type == "cuda"
        mark = memory_mark(device)
        self.algo, self.envs, self.args = build(name, mode, device, quick, **overrides)
        self.calls = self.algo.benchmark_calls()
        self.result = dict(status="ok", calls={})
        for fn_name, (fn, args) in self.calls.items():
            cache = dict(counters["inductor"])
            first = [timed(fn, args, device) for _ in range(WARMUP + 1)]
            c = self.result["calls"][fn_name] = dict(
                first_calls_s=first, input_shapes=[list(a.shape) for a in args if isinstance(a, torch.Tensor)])
            if compile:
                c["compile_s"] = first[0]  # dynamo and inductor run inside the first call
                c["inductor_cache"] = cache_state(cache)
            if self.graphs:
                c["capture_s"] = first[WARMUP - 1]
            log(f"  {name} {mode} {fn_name}: first calls " + ", ".join(f"{t:.3g}" for t in first) + " s")
        self.logger = leanrl.Logger(run_dir, {}, total_steps=0, progress=False, burn_in=1)
        # Off-policy, the buffer fills to learning_starts first; then the phases not in benchmark_calls
        # compile on their first call and are captured on call WARMUP.
        t = time.perf_counter()
        while self.algo.global_step <= getattr(self.args, "learning_starts", -1):
            self.iteration()
        for _ in range(WARMUP if self.graphs else 1):
            self.iteration()
        sync(device)
        self.result["burn_in_s"] = time.perf_counter() - t
        if (growth := memory_growth_mb(device, mark)) is not None:
            self.result["memory_growth_mb"] = growth
        self.seconds = self.steps = self.iterations = 0

    def iteration(self):
        """One training iteration, logged as `leanrl.run` logs it."""
        self.algo.train_iteration(self.logger)
        self.logger.end_iteration(self.algo.global_step)
        if self.algo.iteration % self.args.log_every == 0:
            self.logger.flush()  # the one device-to-host read of a log boundary

    def timed_block(self, block_s: float):
        """Iterations for `block_s` seconds (at least one), timed as a whole: no sync in between."""
        sync(self.device)
        t, step = time.perf_counter(), self.algo.global_step
        while time.perf_counter() - t < block_s:
            self.iteration()
            self.iterations += 1
        sync(self.device)
        self.seconds += time.perf_counter() - t
        self.steps += self.algo.global_step - step

    def close(self):
        self.logger.close()
        self.envs.close()


def cache_state(before: dict) -> str:
    """Whether the graphs compiled since `before` (inductor's counters) came from its on-disk cache."""
    hits, misses = (counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
    return "cold" if not hits else "warm" if not misses else "partly warm"


def guarded(runs: dict, what: str, fn):
    """Call `fn(run)` for each run; a run that raises becomes an error result and leaves `runs`."""
    for mode, run in list(runs.items()):
        try:
            fn(run)
        except Exception as e:
            traceback.print_exc()
            run.result = dict(status="error", reason=f"{what}: {type(e).__name__}: {e}"[:500])
            del runs[mode]


def measure(name, modes, device, quick, repeats, **overrides) -> dict:
    """{mode: figures} for entry `name`."""
    budget = BUDGETS["quick" if quick else device.type]
    results, runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            try:
                runs[mode] = Run(name, mode, device, quick, os.path.join(tmp, mode), overrides)
            except Exception as e:
                traceback.print_exc()
                results[mode] = dict(status="error", reason=f"setup: {type(e).__name__}: {e}"[:500])
        alive = dict(runs)
        for fn_name in next(iter(alive.values())).calls if alive else ():
            stats = time_interleaved({m: r.calls[fn_name] for m, r in alive.items()}, device, repeats=repeats,
                                     budget_s=budget["budget_s"])
            for mode, s in stats.items():
                alive[mode].result["calls"][fn_name].update(s)
                log(f"  {name} {mode} {fn_name}: {s['median_ms']:.3g} ms/call")
        if device.type == "cuda":  # in every mode: eager's fraction shows what the graphs win back
            def busy(run):
                for fn_name, (fn, args) in run.calls.items():
                    c = run.result["calls"][fn_name]
                    fraction = gpu_busy(fn, args, device, calls=max(3, min(50, int(200 / c["median_ms"]))))
                    if fraction is not None:
                        c["gpu_busy"] = fraction
            guarded(alive, "GPU profile", busy)
        # Training in turns too, a block of iterations each, until every mode has trained `measure_s`.
        while alive and min(r.seconds for r in alive.values()) < budget["measure_s"]:
            guarded(alive, "training", lambda run: run.timed_block(budget["measure_s"] / 5))
        for mode, run in runs.items():
            if run.result["status"] == "ok":
                run.result.update(sps=run.steps / run.seconds, train_iterations=run.iterations)
                log(f"  {name} {mode}: {run.result['sps']:,.0f} env-steps/s")
            run.close()
            results[mode] = run.result
    return {m: results[m] for m in modes}


def measure_scaling(name, modes, device, quick, repeats) -> dict:
    """End-to-end env-steps/s and the policy's time per call at each number of parallel envs."""
    spec = SCALING[name]
    sizes = spec.sizes_quick if quick else spec.sizes_gpu if device.type == "cuda" else spec.sizes
    points, errors = {m: [] for m in modes}, {m: [] for m in modes}
    for num_envs in sizes:
        torch._dynamo.reset()  # each size compiles with static shapes, as a fresh run of that size would
        log(f"{name}: {num_envs} envs")
        for mode, r in measure(spec.entry, modes, device, quick, repeats, num_envs=num_envs,
                               **spec.overrides).items():
            if r["status"] == "ok":
                points[mode].append(dict(num_envs=num_envs, sps=r["sps"], policy_ms=r["calls"]["policy"]["median_ms"]))
            else:
                errors[mode].append(f"{num_envs} envs: {r['reason']}")
    return {m: dict(status="ok" if points[m] else "error", points=points[m],
                    **({"reason": "; ".join(errors[m])[:500]} if errors[m] else {})) for m in modes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=[*ENTRIES, *SCALING])
    p.add_argument("--modes", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--result", required=True)
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)  # before anything compiles: inductor sizes its OpenMP loops from it
    device, modes = torch.device(a.device), a.modes.split(",")
    if a.name in SCALING:
        results = measure_scaling(a.name, modes, device, a.quick, a.repeats)
    else:
        results = measure(a.name, modes, device, a.quick, a.repeats)
    with open(a.result, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
