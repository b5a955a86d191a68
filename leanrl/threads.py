"""How many CPU threads torch computes with: `--threads N`, or a default chosen by the model's size and the cores
nobody else is using.

Every op split over threads ends at a barrier, and on a machine shared with other jobs an OpenMP thread waits there
for a peer the OS has descheduled: with another job on one of two cores, two threads were slower than one for every
model measured, from a 9k-parameter MLP to a 135M-parameter LM, and small-model runs under heavier load were many
times slower. On free cores, threads pay off for large models (convolutions, big matrix products) and barely for
small ones. So: one thread below MANY_THREADS_FROM parameters; above, one per core other jobs leave free now.
`benchmarks/threads.py` measures it; its table is benchmarks/results/<machine>/threads.md.
"""

import os

import psutil
import torch

from leanrl.cli import say_once

# Parameters from which a model computes on every free core this process may use; below, on one thread.
MANY_THREADS_FROM = 1_000_000
# How long free_cores watches the cores: a job computing now keeps its core busy over any such window.
BUSY_WINDOW_S = 0.2


def free_cores(processes: int = 1) -> int:
    """The cores this process may run on that other jobs leave free now (their use over BUSY_WINDOW_S while this
    process waits), shared among `processes` processes of one run on this machine (its collectors and trainer;
    torchrun's ranks of this node, LOCAL_WORLD_SIZE), at least one. Not the load average: for a minute it still
    counts a job that has ended, such as the command run just before."""
    processes = max(processes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cores = os.sched_getaffinity(0)
    use = psutil.cpu_percent(BUSY_WINDOW_S, percpu=True)
    busy = sum(use[c] for c in cores if c < len(use)) / 100
    return max(1, (len(cores) - round(busy)) // processes)


def count_parameters(*models) -> int:
    return sum(p.numel() for m in models for p in m.parameters())


def set_threads(requested: int, *models, processes: int = 1, quiet: bool = False) -> int:
    """Set torch's CPU threads for a run of `models` and return them: `requested` when it is not 0 (`--threads`),
    else OMP_NUM_THREADS when it is set, else one thread for a model smaller than MANY_THREADS_FROM parameters and
    `free_cores(processes)` for a larger one. Says once what it chose, unless `quiet` (a collector)."""
    params = count_parameters(*models)
    if requested:
        threads, why = requested, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    elif params < MANY_THREADS_FROM:
        threads, why = 1, f"a model of {params:,} parameters; --threads N to choose"
    else:
        threads = free_cores(processes)
        why = (f"a model of {params:,} parameters, {threads} of {len(os.sched_getaffinity(0))} cores free for it; "
               "--threads N to choose")
    torch.set_num_threads(threads)
    if not quiet:
        say_once(f"leanrl: torch computes on {threads} CPU thread{'s' * (threads > 1)} ({why})")
    return threads
