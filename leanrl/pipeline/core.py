"""What every transport shares: the async settings, the trainer's side of the protocol, the metrics.

Versions: the trainer is at version v after v optimizer iterations; it consumes exactly one batch per
version, batch number g ("ticket" g) at version g, and then publishes version g + 1. A collector takes
ticket g only once the trainer has published version >= g - max_lag, and acts with that version or a
newer one, so every transition of ticket g is at most max_lag versions old when it is consumed: the
bound holds by construction (admission control), and the trainer checks it on every batch anyway.
"""

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import tyro

from leanrl.cli import UsageError
from leanrl.config import ASYNC_ONLY

TRANSPORTS = ("threads", "processes", "distributed")


@dataclass
class AsyncArgs:
    async_: Annotated[bool, tyro.conf.arg(name="async")] = False
    """run collectors and the trainer concurrently (weights updated in flight, bounded staleness)"""
    num_collectors: int = field(default=2, metadata=ASYNC_ONLY)
    """number of collector roles (with --transport distributed: the torchrun world size minus one)"""
    max_lag: int = field(default=2, metadata=ASYNC_ONLY)
    """hard bound on trainer version minus behaviour version of any consumed transition"""
    publish_every: int = field(default=1, metadata=ASYNC_ONLY)
    """send the weights to the collectors every this many trainer versions (one version per consumed batch);
    at most max_lag + 1, so that the collectors can always be admitted"""
    deterministic: bool = field(default=False, metadata=ASYNC_ONLY)
    """batch i is produced exactly by version i - max_lag: bitwise reproducible whatever the speeds"""
    transport: Literal["threads", "processes", "distributed"] = field(default="threads", metadata=ASYNC_ONLY)
    """threads in one process, processes sharing memory, or torch.distributed ranks launched by torchrun"""
    max_restarts: int = field(default=3, metadata=ASYNC_ONLY)
    """restart a collector that died (an exception, a killed process) from the newest weights, at most this many
    times in a run, before the run stops with the collector's error (0: stop at the first; threads and processes:
    under torchrun, torchrun's own --max-restarts with --resume auto, docs/async.md)"""


def check_settings(transport, num_collectors, max_lag, deterministic, publish_every=1, max_restarts=0):
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts}: cannot be negative")
    if transport not in TRANSPORTS:
        raise UsageError(f"--transport {transport!r}: choose one of {TRANSPORTS}")
    if num_collectors < 1:
        raise UsageError(f"--num-collectors {num_collectors}: needs at least one collector")
    if max_lag < 0:
        raise UsageError(f"--max-lag {max_lag}: the lag bound cannot be negative")
    if not 1 <= publish_every <= max_lag + 1:
        # The trainer at version g waits for ticket g, which is admitted once version g - max_lag is published.
        raise UsageError(f"--publish-every {publish_every}: must be between 1 and max_lag + 1 = {max_lag + 1}, or "
                         "the trainer would wait for a batch that no collector may start")
    if deterministic and publish_every != 1:
        raise UsageError("--deterministic needs --publish-every 1: batch i is produced by version i - max_lag exactly")
    if deterministic and transport == "threads":
        raise UsageError("--deterministic needs --transport processes or distributed: collector threads share "
                         "torch's global random generator, so their draws interleave differently run to run")


class CollectorError(RuntimeError):
    """A collector raised; the message holds its traceback."""


class Stopped(Exception):
    """Raised inside a collector when the trainer has asked every role to stop (its loop ends quietly)."""


class Stats:
    """Lag histogram, idle fractions and queue depth, read on the host once per batch (the lag check
    needs the versions anyway). The trainer's idle clock starts at its first batch: the wait for that one is the
    collectors' start-up (processes, envs, models, compiles), not idleness."""

    def __init__(self, max_lag, collector_times):
        self.hist = torch.zeros(max_lag + 1, dtype=torch.int64)
        self.collector_times = collector_times  # per collector: [idle seconds, seconds since start]
        self.t_start, self.trainer_idle, self.depth_sum, self.n = time.perf_counter(), 0.0, 0, 0
        self.restarts = 0  # collectors restarted after they died

    def summary(self) -> dict:
        n = max(int(self.hist.sum()), 1)
        lags = torch.arange(len(self.hist))
        out = {"async/lag_mean": float((self.hist * lags).sum()) / n,
               "async/lag_max": float(lags[self.hist > 0].max()) if self.hist.any() else 0.0,
               "async/trainer_idle_frac": self.trainer_idle / max(time.perf_counter() - self.t_start, 1e-9),
               "async/queue_depth": self.depth_sum / max(self.n, 1),
               "async/collector_restarts": float(self.restarts)}
        times = self.collector_times
        if times[:, 1].sum() > 0:
            out["async/collector_idle_frac"] = float(times[:, 0].sum() / times[:, 1].sum())
        out.update({f"async/lag_hist_{k}": float(c) for k, c in enumerate(self.hist.tolist())})
        return out


class Trainer:
    """The trainer's side: `batch = trainer.next_batch()` (ticket `trainer.version`, in order), train on it,
    then `trainer.publish(params)`. The batch is only valid until that publish. `weights` sends the published
    weights (`weights.publish(params, version)`). Subclasses provide `_poll(timeout)` (a message or None)
    and may provide `_restart(rank, error)`, which brings a collector that died back (True) or declines (False)."""

    def __init__(self, weights, slots, stats, params, max_lag, timeout, publish_every=1):
        self.weights, self.slots, self.stats, self.params = weights, slots, stats, params
        self.max_lag, self.timeout, self.publish_every = max_lag, timeout, publish_every
        self.version = 0
        self.ready = {}  # ticket -> (collector, sequence number), arrived ahead of its turn
        self.next_seq = defaultdict(int)
        self.consumed = []  # (ticket, collector, sequence number, lag), in consumption order

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _restart(self, rank, error: str) -> bool:
        return False

    def _slot(self, rank, seq):
        slots = self.slots[rank]
        return slots[seq % slots.shape[0]]

    def next_batch(self):
        g, t0 = self.version, time.perf_counter()
        while g not in self.ready:
            msg = self._poll(0.05)
            if self.timeout is not None and time.perf_counter() - t0 > self.timeout:
                raise TimeoutError(f"no batch for ticket {g} in {self.timeout} s")
            if msg is None:
                continue
            kind, rank, a, b = msg
            if kind in ("error", "died"):  # a traceback, or how a process without one ended
                if self._restart(rank, a):
                    continue
                spent = f" (after {self.stats.restarts} restarts: --max-restarts)" if self.stats.restarts else ""
                raise CollectorError((f"collector {rank} raised{spent}:\n{a}" if kind == "error" else
                                      f"collector {rank} {a}{spent}") + "\nthe run stops here; resume it from its "
                                     "last checkpoint (--resume auto)")
            # Sequence numbers: each collector's batches arrive numbered 0, 1, 2, ...; a gap is a lost
            # batch, a repeat a duplicate, and a ticket already seen would be consumed twice.
            if a != self.next_seq[rank]:
                raise RuntimeError(f"collector {rank}: batch {a} arrived, expected {self.next_seq[rank]}")
            if b < g or b in self.ready:
                raise RuntimeError(f"ticket {b} from collector {rank} was already consumed or queued")
            self.next_seq[rank] += 1
            self.ready[b] = (rank, a)
        if self.stats.n:
            self.stats.trainer_idle += time.perf_counter() - t0
        else:
            self.stats.t_start = time.perf_counter()
        rank, seq = self.ready.pop(g)
        batch = self._slot(rank, seq)
        lag = g - int(batch["version"].min())
        if not 0 <= lag <= self.max_lag:
            raise RuntimeError(f"ticket {g}: lag {lag} outside [0, max_lag={self.max_lag}]; a collector did not "
                               "tag its steps with ctx.step_boundary()")
        self.stats.hist[lag] += 1
        self.stats.depth_sum += len(self.ready)
        self.stats.n += 1
        self.consumed.append((g, rank, seq, lag))
        return batch

    def publish(self, params=None):
        """End this version; the collectors get the new weights every `publish_every` versions."""
        self.version += 1
        if self.version % self.publish_every == 0:
            self.weights.publish(self.params if params is None else params, self.version)
