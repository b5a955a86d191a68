"""The measurements: time per call, GPU busy fraction, end-to-end SPS, peak memory, the machine."""

import ctypes
import gc
import math
import os
import platform
import re
import statistics
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version

import torch


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args, device, n=1) -> float:
    """Seconds for `n` back-to-back calls, the device drained before and after."""
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    sync(device)
    return time.perf_counter() - t


def time_interleaved(calls: dict, device, *, repeats: int, budget_s: float, min_sample_s: float = 1e-3) -> dict:
    """Median and quartiles of the steady time per call of each of `calls` {mode: (fn, args)}.

    The modes' samples are taken in turn (round robin), so a load spike from another process hits them
    alike and their ratios hold on a busy machine. A call shorter than `min_sample_s` is timed in a
    group of back-to-back calls, so the clock and the sync are not what gets measured. `budget_s` per
    mode caps the number of samples of slow calls (at least 5), `repeats` caps it for all."""
    inner, cost = {}, 0.0
    for mode, (fn, args) in calls.items():
        estimate = statistics.median(timed(fn, args, device) for _ in range(3))
        inner[mode] = max(1, min(1000, math.ceil(min_sample_s / estimate)))
        cost += estimate * inner[mode]
    n = min(repeats, max(5, int(budget_s * len(calls) / cost)))
    samples = {mode: [] for mode in calls}
    for _ in range(n):
        for mode, (fn, args) in calls.items():
            samples[mode].append(timed(fn, args, device, inner[mode]) / inner[mode])
    out = {}
    for mode, s in samples.items():
        q1, median, q3 = statistics.quantiles(s, n=4, method="inclusive")
        out[mode] = dict(median_ms=median * 1e3, p25_ms=q1 * 1e3, p75_ms=q3 * 1e3, iqr_ms=(q3 - q1) * 1e3,
                         repeats=n, calls_per_sample=inner[mode])
    return out


def gpu_busy(fn, args, device, calls: int) -> float | None:
    """Fraction of the wall time of `calls` back-to-back calls during which the GPU runs a kernel, copy
    or memset (the union of their intervals, as torch.profiler sees them; None if it saw none)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_us = timed(fn, args, device, calls) * 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, -math.inf
    for start, stop in spans:  # union of intervals: overlapping streams count once
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / wall_us if busy > 0 else None


def memory_mark(device) -> float | None:
    """Start a peak-memory window; returns what is resident now (MiB), None where it cannot be measured.
    On CPU, memory freed by what ran before is first handed back to the OS (so it is not lent to this
    window), then the kernel's RSS high-water mark is reset: the peak is this window's, not the process's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc
        with open("/proc/self/clear_refs", "w") as f:  # Linux
            f.write("5")
    except (OSError, AttributeError):
        return None
    return _proc_status_mb("VmRSS")


def memory_growth_mb(device, mark: float | None) -> float | None:
    """Peak memory since `memory_mark` over what was resident then: GPU allocated, or CPU RSS."""
    if mark is None:
        return None
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20 - mark
    return _proc_status_mb("VmHWM") - mark


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024  # kB


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_details() -> str | None:
    """What tells apart two hosts whose CPUs report the same model name (a VM's "AMD EPYC" covers several):
    family, model and stepping, the L3 cache, the TSC clock (BogoMIPS / 2, fixed at boot; "cpu MHz" varies)."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}
    parts = [" ".join(f"{k.split()[-1]} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)]
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            parts.append(f"L3 {f.read().strip()}")
    except OSError:
        pass
    if "bogomips" in fields:
        parts.append(f"{float(fields['bogomips']) / 2000:.2f} GHz TSC")
    return ", ".join(p for p in parts if p) or None


def cpu_line(machine: dict) -> str:
    """The CPU as tables name it: model name, and the details that tell apart hosts of one name (older results
    lack them)."""
    details = machine.get("cpu_details")
    return f"{machine['cpu']} ({details})" if details else machine["cpu"]


def machine_info(device) -> dict:
    cpu, cores = cpu_model(), os.cpu_count()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if gpu:
        slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    else:
        model = re.sub(r"\((r|tm)\)|\b(processor|cpu)\b|@", "", cpu.lower())
        slug = f"cpu-{cores}core-" + re.sub(r"[^a-z0-9]+", "-", model).strip("-")
    return dict(slug=slug, cpu=cpu, cpu_details=cpu_details(), cores=cores, gpu=gpu,
                cuda=torch.version.cuda if gpu else None, python=platform.python_version(),
                platform=platform.platform(),
                **{pkg: installed_version(pkg) for pkg in ("torch", "tensordict", "torchrl", "gymnasium")},
                commit=git_commit())


def installed_version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:  # an optional extra (torchrl comes with leanrl[dev])
        return None


def git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty.strip() else "")
