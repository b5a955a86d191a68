"""Collectors and trainer in one machine: threads, or processes sharing memory (torch.multiprocessing).

Batches live in preallocated slots (`max_lag + 1` per collector, shared memory for processes); a queue
carries only `(collector, sequence number, ticket)`. The trainer trains from the slot and the slot is
reused only once its ticket is consumed: a collector's `max_lag + 2` latest tickets are distinct and at
most `version + max_lag`, so the oldest of them is below `version`, already consumed.
"""

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from tensordict import TensorDictBase

from leanrl.graph_threads import sync_cuda
from leanrl.pipeline.core import CollectorError, Stats, Stopped, Trainer, check_settings
from leanrl.pipeline.weights import WeightRing


@dataclass
class Shared:
    """What the trainer and its collectors share (in shared memory for processes)."""
    num_collectors: int
    max_lag: int
    deterministic: bool
    weights: WeightRing  # the published versions; its `latest` and `stop` flags
    slots: list  # per collector, max_lag + 1 batch slots
    tickets: torch.Tensor  # the next ticket to hand out
    ticket_lock: object
    messages: object  # (kind, collector, sequence number or traceback, ticket) to the trainer
    collector_times: torch.Tensor  # per collector: [idle seconds, seconds since start]
    trainer_pid: int | None  # processes leave when their trainer is gone


class Collector:
    """What a collector function sees: `for batch in ctx.batches(params): fill batch, tagging each step
    with ctx.step_boundary()` (the version it acts with, after picking up any newer weights in place)."""

    def __init__(self, rank: int, shared: Shared):
        self.rank, self.shared = rank, shared
        self.num_collectors, self.max_lag = shared.num_collectors, shared.max_lag
        self.deterministic = shared.deterministic
        self.weights, self.slots = shared.weights, shared.slots
        self.version = -1
        self.min_version = 0  # the oldest version the batch being filled may hold (ticket - max_lag)
        self.params = None
        self.t_start, self.idle = time.perf_counter(), 0.0

    def alive(self) -> bool:
        # A collector leaves when told to stop, or when its trainer process is gone (never an orphan).
        parent = self.shared.trainer_pid
        return not int(self.weights.stop) and (parent is None or os.getppid() == parent)

    def _wait(self, ready):
        t0 = time.perf_counter()
        while not ready():
            if not self.alive():
                raise Stopped
            time.sleep(2e-4)
        self.idle += time.perf_counter() - t0

    def _take_ticket(self) -> int:
        if self.deterministic:  # a fixed schedule: ticket g always belongs to collector g % num_collectors
            g = self.rank + self._j * self.num_collectors
            self._wait(lambda: int(self.weights.latest) >= g - self.max_lag)
            return g
        while True:
            with self.shared.ticket_lock:
                g = int(self.shared.tickets)
                if g <= int(self.weights.latest) + self.max_lag:  # admission control: never exceed max_lag
                    self.shared.tickets += 1
                    return g
            self._wait(lambda: int(self.weights.latest) + self.max_lag >= int(self.shared.tickets))

    def batches(self, params: TensorDictBase, template: TensorDictBase):
        """Yield this collector's slots, one per batch, after admission; each yielded batch is sent when
        the loop body returns. The version at the batch's start is read before it is yielded. `template`
        (shapes of a batch) must match the trainer's: the slots are built from the trainer's copy."""
        self.params = params
        self._j = 0
        while True:
            g = self._take_ticket()
            self.min_version = max(g - self.max_lag, 0)
            self.version = self._read(max(g - self.max_lag, 0) if self.deterministic else None)
            batch = self.slots[self.rank][self._j % self.slots[self.rank].shape[0]]
            yield batch
            sync_cuda()  # the batch is complete on this collector's stream before the trainer reads it
            self._record()
            self.shared.messages.put(("batch", self.rank, self._j, g))
            self._j += 1

    def step_boundary(self) -> int:
        """Pick up newer weights in place (not in deterministic mode: a batch is one version there)."""
        if not self.deterministic and int(self.weights.latest) > self.version:
            self.version = self._read(None)
        if not self.alive():
            raise Stopped
        return self.version

    def _read(self, version):
        t0 = time.perf_counter()
        v = self.weights.read_into(self.params, version, self.alive)
        self.idle += time.perf_counter() - t0
        return v

    def _record(self):
        elapsed = time.perf_counter() - self.t_start
        self.shared.collector_times[self.rank] = torch.tensor([self.idle, elapsed], dtype=torch.float64)


def run_collector(rank, shared, fn, fn_args, is_process):
    ctx = Collector(rank, shared)
    if is_process:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops everyone
        torch.set_num_threads(1)
    try:
        fn(ctx, *fn_args)
    except Stopped:
        pass
    except BaseException:
        shared.messages.put(("error", rank, traceback.format_exc(), None))


class LocalTrainer(Trainer):
    """Trainer-side handle of collectors run as threads or processes; a context manager that stops and
    joins them on exit (on an error or Ctrl-C too)."""

    def __init__(self, transport, num_collectors, collector_fn, fn_args, batch_template, params, *, max_lag,
                 deterministic=False, timeout=None, publish_every=1):
        check_settings(transport, num_collectors, max_lag, deterministic, publish_every)
        is_process = transport == "processes"
        template = batch_template.cpu() if is_process else batch_template
        slots = [torch.stack([template.clone() for _ in range(max_lag + 1)]) for _ in range(num_collectors)]
        if is_process:
            for s in slots:
                s.share_memory_()
            mpctx = mp.get_context("spawn")  # a fork of the trainer could inherit locks held by its threads
            tickets, lock, messages = torch.zeros((), dtype=torch.int64).share_memory_(), mpctx.Lock(), mpctx.Queue()
        else:
            tickets, lock, messages = torch.zeros((), dtype=torch.int64), threading.Lock(), queue.Queue()
        ring = WeightRing(params, max_lag + 1, shared=is_process)
        stats = torch.zeros(num_collectors, 2, dtype=torch.float64)
        if is_process:
            stats.share_memory_()
        super().__init__(ring, slots, Stats(max_lag, stats), params, max_lag, timeout, publish_every)
        self.messages = messages
        ring.publish(params, 0)  # version 0: the initial weights
        # Kept on self: Process.start() drops its arguments, and a lock collected here would be unlinked
        # before a spawned child unpickles it.
        self.shared = shared = Shared(num_collectors, max_lag, deterministic, ring, slots, tickets, lock, messages,
                                      stats, os.getpid() if is_process else None)
        if is_process:  # not daemonic, so that a collector may start processes (vLLM's engine); close() joins
            # them, and a collector whose trainer is gone leaves by itself (Collector.alive)
            self.workers = [mpctx.Process(target=run_collector, args=(r, shared, collector_fn, fn_args, True))
                            for r in range(num_collectors)]
        else:
            self.workers = [threading.Thread(target=run_collector_thread, args=(r, shared, collector_fn, fn_args),
                                             daemon=True) for r in range(num_collectors)]
        for w in self.workers:
            w.start()

    def _poll(self, timeout):
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            for r, w in enumerate(self.workers):
                if getattr(w, "exitcode", None) not in (None, 0):
                    raise CollectorError(f"collector {r} died with exit code {w.exitcode} and no traceback")
            return None

    def close(self):
        self.weights.stop.fill_(1)
        for w in self.workers:
            w.join(timeout=10)
        for w in self.workers:
            if isinstance(w, threading.Thread):
                continue
            if w.is_alive():  # a collector stuck in an env step: not left behind
                w.kill()
                w.join()
        if hasattr(self.messages, "close"):
            self.messages.close()
            self.messages.join_thread()


def run_collector_thread(rank, shared, fn, fn_args):
    """On a GPU, each collector thread runs on its own CUDA stream (the trainer keeps the default one)."""
    if torch.cuda.is_available():
        with torch.cuda.stream(torch.cuda.Stream()):
            run_collector(rank, shared, fn, fn_args, False)
    else:
        run_collector(rank, shared, fn, fn_args, False)
