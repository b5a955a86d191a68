"""Measure one entry in the given modes, all in one process, and write the figures as JSON.

Each mode is built on its own, its accelerated functions' first calls give compile and capture time; the timed
calls of all modes are taken in turn, round robin: a load spike from another process hits every mode alike, so
the ratios between modes hold on a busy machine. End to end, each mode runs the algorithm's own `train` (the
loop its script runs), in a thread of its own, for a few timed blocks after burn-in, through `train`'s
`on_iteration` hook; the modes' blocks alternate in the same way.

    python benchmarks/worker.py ppo_cartpole --modes eager,compile --device cpu --result out.json
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
from torch._dynamo.utils import counters

import leanrl
from entries import ENTRIES, MODES, SCALING, make_args
from measure import gpu_busy, memory_growth_mb, memory_mark, sync, time_interleaved, timed

# Seconds per mode spent timing each function and timing end-to-end training: enough samples for a
# stable median on a shared CPU; on GPU, short, to aim at the whole suite in one 10-minute call.
BUDGETS = {"cpu": dict(budget_s=4.0, measure_s=6.0), "cuda": dict(budget_s=1.0, measure_s=2.0),
           "quick": dict(budget_s=0.3, measure_s=0.3)}

# A compiled function past dynamo's recompile limit would run eagerly and be timed as compiled: an error instead.
torch._dynamo.config.fail_on_recompile_limit_hit = True


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


class MeasuredMode:
    """One mode of the entry: its args, envs and accelerated functions, and its figures."""

    def __init__(self, name, mode, device, quick, run_dir, overrides):
        compile, cudagraphs = MODES[mode]
        self.name, self.mode, self.device = name, mode, device
        self.graphs = cudagraphs and device.type == "cuda"
        self.entry = ENTRIES[name]
        # No checkpoints while timed; a horizon far enough that the timed blocks end the run, not the schedule.
        self.args = make_args(name, quick, compile=compile, cudagraphs=cudagraphs, device=str(device),
                              progress=False, run_dir=run_dir, checkpoint_every=0,
                              **{"total_timesteps": 10**10, **overrides})
        self.mark = memory_mark(device)
        leanrl.seed_everything(self.args.seed, self.args.torch_deterministic)
        self.envs = self.entry.envs(self.args, device)
        self.calls = self.entry.calls(self.args, self.envs, device)
        self.result = dict(status="ok", calls={})
        for fn_name, (fn, args) in self.calls.items():
            cache, graphs = dict(counters["inductor"]), counters["stats"]["unique_graphs"]
            loaded = counters["leanrl"]["traces_loaded"]
            first = [timed(fn, args, device) for _ in range(leanrl.WARMUP + 1)]
            c = self.result["calls"][fn_name] = dict(
                first_calls_s=first, input_shapes=[list(a.shape) for a in args if isinstance(a, torch.Tensor)])
            # compiled: the function itself, or graphs it calls (a CPU's one-graph gradient steps), traced now or
            # loaded from an earlier run (leanrl.precompiled: no new graph, no inductor counter moves)
            traced = counters["stats"]["unique_graphs"] > graphs
            trace_loaded = counters["leanrl"]["traces_loaded"] > loaded
            compiled = hasattr(getattr(fn, "fn", fn), "_torchdynamo_orig_callable") or traced or trace_loaded
            if compile and not compiled:
                c["kept_eager"] = True  # --compile keeps it eager on this device (see leanrl.wrap_flags)
            elif compile:
                c["compile_s"] = first[0]  # tracing and compiling, or loading a trace, happen in the first call
                c["inductor_cache"] = "trace loaded" if trace_loaded and not traced else cache_state(cache)
            if self.graphs:
                c["capture_s"] = first[leanrl.WARMUP - 1]
            log(f"  {name} {mode} {fn_name}: first calls " + ", ".join(f"{t:.3g}" for t in first) + " s")

    def train(self, measure_s: float, blocks: int = 5, handover=lambda: None):
        """The algorithm's `train`, timed in `blocks` blocks of `measure_s / blocks` seconds after burn-in (off
        policy the buffer fills to learning_starts first; then every phase compiles on its first call and is
        captured on call WARMUP), with no sync inside a block; ends the run when timed. `handover()` runs
        before each block, untimed (another mode's block runs inside it)."""
        learning_starts = getattr(self.args, "learning_starts", -1)
        # the iterations in which every learner variant runs once (DQN updates every train_frequency env steps,
        # TD3's and SAC's actors every policy_frequency): all have compiled and been captured before the clock starts
        period = max(-(-getattr(self.args, "train_frequency", 1) // self.args.num_envs),
                     getattr(self.args, "policy_frequency", 1))
        burn_in = ((leanrl.WARMUP if self.graphs else 1) + 1) * period
        state = dict(after=None, t=None, step=None, seconds=0.0, steps=0, iterations=0, blocks=0)
        t_start = time.perf_counter()

        def on_iteration(iteration, global_step):
            if state["after"] is None:  # burning in
                if global_step > learning_starts:
                    state["after"] = iteration + burn_in
                return
            if iteration < state["after"]:
                return
            if state["t"] is None:
                sync(self.device)
                if "burn_in_s" not in self.result:
                    self.result["burn_in_s"] = time.perf_counter() - t_start
                handover()
                state.update(t=time.perf_counter(), step=global_step, n=iteration)
                return
            if time.perf_counter() - state["t"] >= measure_s / blocks:
                sync(self.device)
                state["seconds"] += time.perf_counter() - state["t"]
                state["steps"] += global_step - state["step"]
                state["iterations"] += iteration - state["n"]
                state["blocks"] += 1
                if state["blocks"] == blocks:
                    return True  # ends the run
                handover()
                state.update(t=time.perf_counter(), step=global_step, n=iteration)

        self.entry.algorithm.train(self.args, self.envs, self.device, on_iteration=on_iteration)
        if (growth := memory_growth_mb(self.device, self.mark)) is not None:
            self.result["memory_growth_mb"] = growth
        self.result.update(sps=state["steps"] / state["seconds"], train_iterations=state["iterations"])
        log(f"  {self.name} {self.mode}: {self.result['sps']:,.0f} env-steps/s")

    def close(self):
        self.envs.close()


class Baton:
    """Whose turn it is among modes running in threads: one runs, the others wait."""

    def __init__(self, modes):
        self.modes, self.turn, self.cv = list(modes), 0, threading.Condition()

    def wait(self, mode):
        with self.cv:
            self.cv.wait_for(lambda: self.modes[self.turn] == mode)

    def pass_on(self, mode, done=False):
        with self.cv:
            i = self.modes.index(mode)
            if done:
                self.modes.remove(mode)
                self.turn = i % len(self.modes) if self.modes else 0
            else:
                self.turn = (i + 1) % len(self.modes)
            self.cv.notify_all()


def train_interleaved(runs: dict, measure_s: float):
    """End to end in turns: each mode's `train` runs in a thread of its own and hands over to the next mode
    before each timed block, so a change in the machine's load falls on every mode alike (one mode after the
    other, two identical runs on a shared machine can differ by a fifth). A run that raises becomes an error
    result and leaves `runs`."""
    baton = Baton(runs)

    def run_in_turn(mode, run):
        baton.wait(mode)
        try:
            run.train(measure_s, handover=lambda: (baton.pass_on(mode), baton.wait(mode)))
        except Exception as e:
            traceback.print_exc()
            run.result = dict(status="error", reason=f"training: {type(e).__name__}: {e}"[:500])
        finally:
            baton.pass_on(mode, done=True)

    threads = [threading.Thread(target=run_in_turn, args=item) for item in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mode in [m for m, r in runs.items() if r.result.get("status") == "error"]:
        del runs[mode]


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
                runs[mode] = MeasuredMode(name, mode, device, quick, os.path.join(tmp, mode), overrides)
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
        # End to end: each mode is its own `train` run; their timed blocks alternate.
        train_interleaved(alive, budget["measure_s"])
        for mode, run in runs.items():
            run.close()
            results[mode] = run.result
    return {m: results[m] for m in modes}


def measure_scaling(name, modes, device, quick, repeats, threads) -> dict:
    """End-to-end env-steps/s and the policy's time per call at each number of parallel envs."""
    spec = SCALING[name]
    sizes = spec.sizes_quick if quick else spec.sizes_gpu if device.type == "cuda" else spec.sizes
    points, errors = {m: [] for m in modes}, {m: [] for m in modes}
    for num_envs in sizes:
        torch._dynamo.reset()  # each size compiles with static shapes, as a fresh run of that size would
        log(f"{name}: {num_envs} envs")
        for mode, r in measure(spec.entry, modes, device, quick, repeats, num_envs=num_envs, threads=threads,
                               **spec.overrides).items():
            if r["status"] == "ok":
                points[mode].append(dict(num_envs=num_envs, sps=r["sps"], policy_ms=r["calls"]["act"]["median_ms"]))
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
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leanrl.set_threads' choice)")
    a = p.parse_args()
    # Ctrl-C reaches the worker with its parent: nothing here is kept but the result file, so end at once (the
    # training threads would otherwise run on until their timed blocks end)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
    device, modes = torch.device(a.device), a.modes.split(",")
    if a.name in SCALING:
        results = measure_scaling(a.name, modes, device, a.quick, a.repeats, a.threads)
    else:
        results = measure(a.name, modes, device, a.quick, a.repeats, threads=a.threads)
    with open(a.result, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
