"""Eager vs compile vs CUDA graphs, side by side, on this machine: `python benchmarks/run.py`.

For every entry of benchmarks/entries.py and every mode the machine supports, a worker process measures
the time per call of each accelerated function of the algorithm (its entry's `calls`, identical inputs in
every mode), compile and capture time, end-to-end env-steps/s of the algorithm's own `train` after burn-in, and
peak memory; on GPU also
the fraction of the wall time the GPU is busy. It writes to benchmarks/results/<machine>/: results.json
(machine, settings, every figure, the targets), a markdown table and a PNG chart per entry, summary.md;
the summary is printed at the end. Entries measured by an earlier run into the same folder are kept, so
a long suite can be split across calls with --algos. `python benchmarks/docs_tables.py` links each machine's
summary from docs/performance.md.

`--quick` is a first look in about a minute: one entry per family (PPO on the on-device CartPole, DQN, TD3) at tiny
sizes with short timings, written to a temporary folder unless --out names one (its figures are not the tables').
Ctrl-C stops the run; what was measured until then stays in the folder.
"""

import argparse
import collections
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


import targets
from entries import ENTRIES, MODES, SCALING, make_args
from leanrl import resolve_device
from measure import machine_info
from report import summary_markdown, write_all

NO_CUDA = dict(status="n/a", label="no CUDA", reason="no CUDA device: --cudagraphs falls back to eager plus a "
               "shape guard here, so this machine has no CUDA-graph figure")
QUICK_ENTRIES = ("ppo_cartpole", "dqn_cartpole", "td3_continuous")  # one per family, the cheapest to compile


def spawn(name: str, modes: list, device, a, cache_dir: str | None) -> dict:
    """Run a worker for `modes` of entry `name`, echoing its progress; an error result if it dies."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(HERE, "worker.py"), name, "--modes", ",".join(modes), "--device",
               str(device), "--repeats", str(a.repeats), "--result", result, *(["--quick"] if a.quick else []),
               "--threads", str(a.threads)]
        env = {**os.environ, **({"TORCHINDUCTOR_CACHE_DIR": cache_dir} if cache_dir else {})}
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        tail = collections.deque(maxlen=5)
        try:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.strip())
        except KeyboardInterrupt:  # the worker got the terminal's Ctrl-C too: let it end, then stop here
            proc.send_signal(signal.SIGINT)
            proc.wait()
            raise
        if proc.wait() == 0 and os.path.isfile(result):
            with open(result) as f:
                return json.load(f)
    reason = f"worker exited with code {proc.returncode}: {tail[-1] if tail else ''}"[:500]
    return {m: dict(status="error", reason=reason) for m in modes}


def measure_entry(name: str, modes: list, device, a, cache_dir: str | None, commit: str | None) -> dict:
    """The figures of every mode of entry `name`, and what they were measured with."""
    t = time.perf_counter()
    runnable = [m for m in modes if device.type == "cuda" or not MODES[m][1]]
    measured = {m: NO_CUDA for m in modes if m not in runnable}
    if runnable:
        print(f"{name}: {', '.join(runnable)}", file=sys.stderr, flush=True)
        measured.update(spawn(name, runnable, device, a, cache_dir))
    if name in SCALING:
        args = make_args(SCALING[name].entry, a.quick, **SCALING[name].overrides)
    else:
        args = make_args(name, a.quick)
    print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return dict(env_id=args.env_id, num_envs=args.num_envs, device=str(device), commit=commit,
                threads=threads_setting(a.threads), wall_s=time.perf_counter() - t,
                measured_at=time.strftime("%Y-%m-%d %H:%M"), modes={m: measured[m] for m in modes})


def threads_setting(threads: int):
    """What a results file records of --threads: the number, or how the runs chose theirs."""
    return threads or "leanrl.set_threads (by model size)"


def bad_numbers(obj, path="") -> list:
    """Paths of figures that are not positive and finite (a harness bug: a figure is either real or absent)."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in bad_numbers(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in bad_numbers(v, f"{path}[{i}]")]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and not (math.isfinite(obj) and obj > 0):
        return [f"{path} = {obj}"]
    return []


def previous(out: str, machine: dict, quick: bool) -> dict:
    """The entries an earlier run of the same kind on this machine saved in `out`. A CPU host whose CPU reports
    the same model name as another's but differs in its details writes the same folder: their entries are not
    mixed into one table. (A GPU machine is named by its GPU, and its entries are kept across hosts.)"""
    try:
        with open(os.path.join(out, "results.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return dict(algos={}, scaling={})
    if old["machine"]["slug"] != machine["slug"] or old["settings"]["quick"] != quick:
        return dict(algos={}, scaling={})
    if machine["gpu"] is None and old["machine"].get("cpu_details") != machine["cpu_details"]:
        print(f"not keeping the entries in {out}: another host measured them (CPU "
              f"{old['machine'].get('cpu_details') or 'details not recorded'}; this one: {machine['cpu_details']})",
              file=sys.stderr)
        return dict(algos={}, scaling={})
    return dict(algos=old["algos"], scaling=old["scaling"])


def main():
    available = [*ENTRIES, *SCALING]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", help=f"comma-separated entries (default: all of {','.join(available)}; with --quick: "
                   f"{','.join(QUICK_ENTRIES)})")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=50, help="most timed samples per function (fewer for slow ones)")
    p.add_argument("--quick", action="store_true", help="a first look in about a minute: one entry per family, tiny "
                   "sizes, short timings, into a temporary folder")
    p.add_argument("--out", help="results folder (default: benchmarks/results/<machine>; with --quick a temporary "
                   "one)")
    p.add_argument("--cold-compile", action="store_true",
                   help="start from an empty inductor cache, so compile times are those of a new machine")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: what a run of the entry's script "
                   "takes, leanrl.set_threads' choice for its model's size)")
    a = p.parse_args()
    algos = a.algos or ",".join(QUICK_ENTRIES if a.quick else available)
    names, modes = algos.split(","), [m for m in MODES if m in a.modes.split(",")]
    for n in names:
        if n not in ENTRIES and n not in SCALING:
            p.error(f"unknown entry {n!r}; known: {', '.join([*ENTRIES, *SCALING])}")
    if not modes or len(modes) != len(set(a.modes.split(","))):
        p.error(f"--modes {a.modes!r}: choose from {', '.join(MODES)}")
    device = resolve_device(a.device)
    machine = machine_info(device)
    out = a.out or (tempfile.mkdtemp(prefix="leanrl-benchmark-quick-") if a.quick else
                    os.path.join(HERE, "results", machine["slug"]))
    os.makedirs(out, exist_ok=True)
    results = previous(out, machine, a.quick)
    kept = [n for n in [*results["algos"], *results["scaling"]] if n not in names]
    t0, load = time.perf_counter(), os.getloadavg()[0]
    if load > os.cpu_count() - 0.5 and a.threads > 1 and device.type == "cpu":
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores: timings with several torch threads "
              "will be noisy; consider --threads 1", file=sys.stderr)
    def save():
        """Write everything measured so far: after every entry, so a run cut short keeps what it measured."""
        settings = dict(quick=a.quick, repeats=a.repeats, device=str(device),
                        threads=threads_setting(a.threads),
                        inductor_cache="empty at start (--cold-compile)" if a.cold_compile else "torch's default",
                        load_average=f"{load:.2f} at start, {os.getloadavg()[0]:.2f} at end")  # text: 0.00 is real
        full = dict(machine=machine, created=time.strftime("%Y-%m-%d %H:%M"), settings=settings, **results)
        full["targets"] = targets.check(full)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(full, f, indent=1)
        write_all(full, out)
        return full

    # --cold-compile: an empty inductor cache for the run, so every first compile is cold, as on a new
    # machine. Otherwise torch's own cache, and each compile time says whether it came from it.
    final = None
    with tempfile.TemporaryDirectory(prefix="leanrl-inductor-") as fresh:
        try:
            for name in names:
                group = "scaling" if name in SCALING else "algos"
                results[group][name] = measure_entry(name, modes, device, a, fresh if a.cold_compile else None,
                                                     machine["commit"])
                final = save()
        except KeyboardInterrupt:
            done = ", ".join(n for n in names if n in results["algos"] or n in results["scaling"]) or "none"
            print(f"interrupted; the entries measured ({done}) are in {out}", file=sys.stderr)
            sys.exit(130)

    print(summary_markdown(final))
    if kept:
        print(f"kept from an earlier run into {out}: {', '.join(kept)}")
    print(f"{time.perf_counter() - t0:.0f} s; results in {out}")
    errors = [f"{n} {m}: {r['reason']}" for group in ("algos", "scaling") for n, e in final[group].items()
              for m, r in e["modes"].items() if r["status"] == "error"]
    bad = bad_numbers(final)
    for problem in errors + [f"not positive and finite: {b}" for b in bad]:
        print(f"ERROR {problem}", file=sys.stderr)
    sys.exit(1 if errors or bad else 0)


if __name__ == "__main__":
    main()
