"""Where an env step's time goes: per env step in steady state, the Python function calls made around it and its wall
time split into env stepping, accelerated calls and everything else, for each entry of benchmarks/entries.py and
each mode this machine runs.

Each (entry, mode) is the algorithm's own `train`, in a process of its own, at the entry's sizes; once the run is in
steady state (learning started, every function compiled and captured), two windows of iterations are measured:
- calls: every Python-level and built-in call of the process's main thread (what cProfile counts as calls, from a
  `sys.setprofile` counter), per env step. Machine-independent: the same code makes the same calls anywhere.
- time: the wall time of a window without the counter, split by timers around the env's `step`, `send` and `recv`
  (the env stepping the loop waits for: with env buffers, what steps in the background while the policy acts is not
  counted) and around every callable `leanrl.accelerate` returned (the accelerated calls: compiled and/or
  CUDA-graphed, or in eager mode the same functions uncompiled); the rest is host work around them (storing,
  sampling, bookkeeping).
An env step is one step of every env: `num_envs` transitions.
Writes step_costs.json and step_costs.md to benchmarks/results/<machine>/ (or --out) and prints the table.

    python benchmarks/step_costs.py [--algos td3_continuous,ppo_atari] [--modes eager,compile] [--steps 1000]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from entries import ENTRIES, MODES, make_args
from measure import machine_info, sync

HERE = os.path.dirname(os.path.abspath(__file__))


class Timed:
    """A callable that adds its wall time to `totals[kind]`; a call inside another timed call counts once, in the
    outer one (an accelerated function that calls accelerated functions). While calls are counted it only passes
    the call on, and its own frame is not counted."""
    depth = 0
    counting = False

    def __init__(self, fn, totals: dict, kind: str, device):
        self.fn, self.totals, self.kind, self.device = fn, totals, kind, device

    def __call__(self, *args, **kwargs):
        if Timed.depth or Timed.counting:
            return self.fn(*args, **kwargs)
        Timed.depth += 1
        t = time.perf_counter()
        try:
            out = self.fn(*args, **kwargs)
            if self.device.type == "cuda":
                sync(self.device)
        finally:
            Timed.depth -= 1
        self.totals[self.kind] += time.perf_counter() - t
        return out

    def __getattr__(self, name):
        return getattr(self.fn, name)


def measure_one(name: str, mode: str, device, steps: int) -> dict:
    """The figures of one entry in one mode, in this process."""
    import leanrl

    totals = {"env": 0.0, "accelerated": 0.0}
    accelerate = leanrl.accelerate

    def timed_accelerate(fn, **kwargs):  # every accelerated function of the run, timed
        return Timed(accelerate(fn, **kwargs), totals, "accelerated", device)

    for module in [m for n, m in sys.modules.items() if n == "leanrl" or n.startswith("leanrl.")]:
        if getattr(module, "accelerate", None) is accelerate:  # the toolbox's modules that call it
            module.accelerate = timed_accelerate
    entry = ENTRIES[name]
    compile, cudagraphs = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        args = make_args(name, False, compile=compile, cudagraphs=cudagraphs, device=str(device), progress=False,
                         run_dir=tmp, checkpoint_every=0, total_timesteps=10**10)
        leanrl.seed_everything(args.seed, args.torch_deterministic)
        envs = entry.envs(args, device)
        for env in (envs, *getattr(envs, "buffers", ())):
            for method in ("step", "send", "recv"):
                if hasattr(env, method):
                    setattr(env, method, Timed(getattr(env, method), totals, "env", device))
        # learning started and every function compiled and captured: a few iterations (PPO) or updates (off-policy)
        steady = getattr(args, "learning_starts", 0) + 8 * args.num_envs * getattr(args, "num_steps", 8)
        state = dict(phase="burn-in", calls=0)
        windows = {}

        def count(frame, event, arg):
            if event == "c_call" or event == "call" and frame.f_code is not Timed.__call__.__code__:
                state["calls"] += 1

        class Done(Exception):
            pass

        def on_iteration(iteration, global_step):
            phase = state["phase"]
            if phase == "burn-in" and global_step >= steady:
                sync(device)
                state.update(phase="time", step=global_step, t=time.perf_counter(), **{k: totals[k] for k in totals})
            elif phase == "time" and global_step - state["step"] >= steps * args.num_envs:
                sync(device)
                windows["time"] = dict(steps=(global_step - state["step"]) / args.num_envs,
                                       wall=time.perf_counter() - state["t"],
                                       **{k: totals[k] - state[k] for k in totals})
                state.update(phase="calls", step=global_step, calls=0)
                Timed.counting = True
                sys.setprofile(count)
            elif phase == "calls" and global_step - state["step"] >= steps * args.num_envs:
                sys.setprofile(None)
                windows["calls"] = dict(steps=(global_step - state["step"]) / args.num_envs, calls=state["calls"])
                raise Done

        try:
            entry.algorithm.train(args, envs, device, on_iteration=on_iteration)
        except Done:
            pass
        finally:
            sys.setprofile(None)
            envs.close()
    t, c = windows["time"], windows["calls"]
    return dict(status="ok", env_ms=t["env"] / t["steps"] * 1e3, accelerated_ms=t["accelerated"] / t["steps"] * 1e3,
                other_ms=(t["wall"] - t["env"] - t["accelerated"]) / t["steps"] * 1e3,
                total_ms=t["wall"] / t["steps"] * 1e3, calls=c["calls"] / c["steps"], steps=t["steps"],
                num_envs=args.num_envs, env_buffers=getattr(args, "num_env_buffers", 1),
                threads=torch.get_num_threads())


def markdown(result: dict) -> str:
    lines = [f"# Per env step, in steady state ({result['machine']['slug']}: {result['machine']['cpu']}"
             f"{', ' + result['machine']['gpu'] if result['machine']['gpu'] else ''})", "",
             f"Commit {result['machine']['commit']}, torch {result['machine']['torch']}, tensordict "
             f"{result['machine']['tensordict']}, {result['created']}. Command: "
             "`python benchmarks/step_costs.py`. An env step is one step of every env (`num_envs` transitions). "
             "Calls: Python-level and built-in function calls of the main thread (machine-independent, but not "
             "version-independent: they follow the torch and tensordict versions). The wall "
             "time is split into env stepping, the accelerated calls (what `leanrl.accelerate` returned: compiled "
             "and/or graphed, or in eager mode the same functions) and the rest: the host work around them. Threads: "
             "torch's, as the run chose them (`leanrl.set_threads`; `OMP_NUM_THREADS=N` fixes them).", "",
             "| entry | mode | envs | threads | calls / step | ms / step | env ms | accelerated ms | other ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, modes in result["entries"].items():
        for mode, r in modes.items():
            if r["status"] != "ok":
                lines.append(f"| {name} | {mode} | | | {r['status']}: {r.get('reason', '')[:80]} | | | | |")
                continue
            lines.append(f"| {name} | {mode} | {r['num_envs']} | {r['threads']} | {r['calls']:,.0f} | "
                         f"{r['total_ms']:.3f} | {r['env_ms']:.3f} | {r['accelerated_ms']:.3f} | {r['other_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default=",".join(ENTRIES), help=f"comma-separated subset of {','.join(ENTRIES)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=1000, help="env steps (each a step of every env) per window")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="results folder (default: benchmarks/results/<machine>)")
    p.add_argument("--one", nargs=2, metavar=("ENTRY", "MODE"), help=argparse.SUPPRESS)  # a worker's own job
    a = p.parse_args()
    import leanrl

    device = leanrl.resolve_device(a.device)
    if a.one:
        print(json.dumps(measure_one(*a.one, device, a.steps)))
        return
    names, modes = a.algos.split(","), [m for m in MODES if m in a.modes.split(",")]
    for n in names:
        if n not in ENTRIES:
            p.error(f"unknown entry {n!r}; known: {', '.join(ENTRIES)}")
    machine = machine_info(device)
    out = a.out or os.path.join(HERE, "results", machine["slug"])
    result = dict(machine=machine, created=time.strftime("%Y-%m-%d %H:%M"), steps=a.steps, entries={})
    for name in names:
        result["entries"][name] = {}
        for mode in modes:
            if MODES[mode][1] and device.type != "cuda":
                continue  # no CUDA graphs here: the same as the mode without them
            proc = subprocess.run([sys.executable, __file__, "--one", name, mode, "--steps", str(a.steps),
                                   "--device", str(device)], capture_output=True, text=True)
            try:
                r = json.loads(proc.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                r = dict(status="error", reason=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?")
            result["entries"][name][mode] = r
            print(f"{name} {mode}: " + (f"{r['calls']:,.0f} calls, {r['total_ms']:.3f} ms per step" if r["status"] ==
                                        "ok" else r["reason"]), file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "step_costs.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(out, "step_costs.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
