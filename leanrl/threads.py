"""How many CPU threads torch computes with: `--threads N`, or a default chosen by the model's size.

A small model's ops are too short to split: every extra thread adds a barrier per op, and on a machine shared with
other jobs an OpenMP thread waits for a peer the OS has descheduled, which made small-model runs many times slower
than with one thread. A large model's ops (convolutions, big matrix products) do gain from more cores.
`benchmarks/threads.py` measures both, idle and with another job on the machine; its table, in
benchmarks/results/<machine>/threads.md, is where MANY_THREADS_FROM comes from.
"""

import os

import torch

from leanrl.cli import say_once

# Parameters from which a model computes on every core this process may use; below, on one thread.
MANY_THREADS_FROM = 20_000_000


def usable_cores(processes: int = 1) -> int:
    """The cores this process may run on, shared among `processes` processes of one run on this machine (its
    collectors and trainer; torchrun's ranks of this node, LOCAL_WORLD_SIZE)."""
    processes = max(processes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, len(os.sched_getaffinity(0)) // processes)


def count_parameters(*models) -> int:
    return sum(p.numel() for m in models for p in m.parameters())


def set_threads(requested: int, *models, processes: int = 1, quiet: bool = False) -> int:
    """Set torch's CPU threads for a run of `models` and return them: `requested` when it is not 0 (`--threads`),
    else OMP_NUM_THREADS when it is set, else one thread for a model smaller than MANY_THREADS_FROM parameters and
    `usable_cores(processes)` for a larger one. Says once what it chose, unless `quiet` (a collector)."""
    params = count_parameters(*models)
    if requested:
        threads, why = requested, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        threads = 1 if params < MANY_THREADS_FROM else usable_cores(processes)
        why = f"a model of {params:,} parameters; --threads N to choose"
    torch.set_num_threads(threads)
    if not quiet:
        say_once(f"leanrl: torch computes on {threads} CPU thread{'s' * (threads > 1)} ({why})")
    return threads
