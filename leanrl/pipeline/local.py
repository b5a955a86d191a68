"""Collectors and trainer in one machine: threads, or processes sharing memory (torch.multiprocessing).

Batches live in preallocated slots (`max_lag + 1` per collector, shared memory for processes); a message
carries only `(collector, sequence number, ticket)`, on a queue among threads, on a pipe of its own from each
collector process (a process killed mid-message breaks its own pipe, not the others'). The trainer trains from the
slot and the slot is reused only once its ticket is consumed: a collector's `max_lag + 2` latest tickets are
distinct and at most `version + max_lag`, so the oldest of them is below `version`, already consumed.

A collector that dies (it raised, or its process was killed) is started again, up to `max_restarts` times in a
run: the new one continues the dead one's sequence numbers and first produces the tickets it took and never
delivered (each collector logs its tickets in shared memory before they are handed out), with the newest weights.
Under --deterministic a collector that can say what its next batch starts from (`ctx.batches(..., state=)`) saves
it before it sends each batch, and the new one starts from the dead one's: it produces the very batch it owed.
"""

import os
import queue
from multiprocessing.connection import wait
import shutil
import signal
import sys
import tempfile
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
    collector_times: torch.Tensor  # per collector: [idle seconds, seconds since start]
    trainer_pid: int | None  # processes leave when their trainer is gone
    ticket_log: torch.Tensor  # per collector, the ticket of its batch number j at [j % (max_lag + 2)]
    taken: torch.Tensor  # per collector, the tickets it has taken
    state_dir: str | None  # --deterministic: where each collector saves what its next batch starts from


class Collector:
    """What a collector function sees: `for batch in ctx.batches(params): fill batch, tagging each step
    with ctx.step_boundary()` (the version it acts with, after picking up any newer weights in place)."""

    def __init__(self, rank: int, shared: Shared, outbox, first_seq: int = 0, owed: tuple = ()):
        self.rank, self.shared = rank, shared
        # (kind, collector, sequence number or traceback, ticket) to the trainer: a pipe's end, or a queue
        self.send = outbox.send if hasattr(outbox, "send") else outbox.put
        self._j, self._owed = first_seq, list(owed)  # a restarted collector's: what the dead one owed
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
        if self._owed:  # admitted already, taken by the collector this one replaces
            return self._owed.pop(0)
        if self.deterministic:  # a fixed schedule: ticket g always belongs to collector g % num_collectors
            g = self.rank + self._j * self.num_collectors
            self._wait(lambda: int(self.weights.latest) >= g - self.max_lag)
            self._log(g)
            return g
        while True:
            with self.shared.ticket_lock:
                g = int(self.shared.tickets)
                if g <= int(self.weights.latest) + self.max_lag:  # admission control: never exceed max_lag
                    self._log(g)  # before it is handed out: a restart knows every ticket this collector owes
                    self.shared.tickets += 1
                    return g
            self._wait(lambda: int(self.weights.latest) + self.max_lag >= int(self.shared.tickets))

    def _log(self, ticket: int):
        self.shared.ticket_log[self.rank, self._j % self.shared.ticket_log.shape[1]] = ticket
        self.shared.taken[self.rank] = self._j + 1

    def _state_path(self, seq: int) -> str:
        return os.path.join(self.shared.state_dir, f"collector{self.rank}_{seq % (self.max_lag + 3)}.pt")

    def batches(self, params: TensorDictBase, template: TensorDictBase, state=None):
        """Yield this collector's slots, one per batch, after admission; each yielded batch is sent when
        the loop body returns. The version at the batch's start is read before it is yielded. `template`
        (shapes of a batch) must match the trainer's: the slots are built from the trainer's copy. `state`:
        `(get, load)` of what a batch starts from (random streams, env state), so that under --deterministic a
        restarted collector produces exactly the batch the dead one owed (without it, one like it)."""
        self.params = params
        saves = state is not None and self.shared.state_dir is not None
        if saves and self._j > 0:  # a restart: from where the dead collector's batch started (a first batch
            # starts from the collector's seeded set-up, as before)
            state[1](torch.load(self._state_path(self._j), weights_only=False))
        while True:
            g = self._take_ticket()
            self.min_version = max(g - self.max_lag, 0)
            self.version = self._read(max(g - self.max_lag, 0) if self.deterministic else None)
            batch = self.slots[self.rank][self._j % self.slots[self.rank].shape[0]]
            yield batch
            sync_cuda()  # the batch is complete on this collector's stream before the trainer reads it
            if saves:  # before the batch is sent: whoever owes the next one can start where this one ends
                tmp = self._state_path(self._j + 1) + ".tmp"
                torch.save(state[0](), tmp)
                os.replace(tmp, self._state_path(self._j + 1))
            self._record()
            self.send(("batch", self.rank, self._j, g))
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


def run_collector(rank, shared, outbox, fn, fn_args, is_process, first_seq=0, owed=()):
    ctx = Collector(rank, shared, outbox, first_seq, owed)
    if is_process:
        os.setpgid(0, 0)  # a group of its own, with the processes it starts: stopped with it (end_group)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which stops everyone
        torch.set_num_threads(1)
    try:
        fn(ctx, *fn_args)
    except Stopped:
        pass
    except BaseException:
        ctx.send(("error", rank, traceback.format_exc(), None))


class LocalTrainer(Trainer):
    """Trainer-side handle of collectors run as threads or processes; a context manager that stops and
    joins them on exit (on an error or Ctrl-C too)."""

    def __init__(self, transport, num_collectors, collector_fn, fn_args, batch_template, params, *, max_lag,
                 deterministic=False, timeout=None, publish_every=1, max_restarts=0):
        check_settings(transport, num_collectors, max_lag, deterministic, publish_every, max_restarts)
        is_process = transport == "processes"
        mpctx = mp.get_context("spawn")  # a fork of the trainer could inherit locks held by its threads
        template = batch_template.cpu() if is_process else batch_template
        slots = [torch.stack([template.clone() for _ in range(max_lag + 1)]) for _ in range(num_collectors)]
        if is_process:
            for s in slots:
                s.share_memory_()
            tickets, lock = torch.zeros((), dtype=torch.int64).share_memory_(), mpctx.Lock()
        else:
            tickets, lock = torch.zeros((), dtype=torch.int64), threading.Lock()
        self.messages = None if is_process else queue.Queue()  # processes: `inboxes`, a pipe from each
        ring = WeightRing(params, max_lag + 1, shared=is_process)
        stats = torch.zeros(num_collectors, 2, dtype=torch.float64)
        ticket_log = torch.full((num_collectors, max_lag + 2), -1, dtype=torch.int64)
        taken = torch.zeros(num_collectors, dtype=torch.int64)
        if is_process:
            for t in (stats, ticket_log, taken):
                t.share_memory_()
        super().__init__(ring, slots, Stats(max_lag, stats), params, max_lag, timeout, publish_every)
        ring.publish(params, 0)  # version 0: the initial weights
        # Kept on self: Process.start() drops its arguments, and a lock collected here would be unlinked
        # before a spawned child unpickles it.
        self.state_dir = tempfile.mkdtemp(prefix="leanrl-collectors-") if deterministic else None
        self.shared = Shared(num_collectors, max_lag, deterministic, ring, slots, tickets, lock, stats,
                             os.getpid() if is_process else None, ticket_log, taken, self.state_dir)
        self.collector_fn, self.fn_args, self.is_process, self.mpctx = collector_fn, fn_args, is_process, mpctx
        self.max_restarts = max_restarts
        self.inboxes = [None] * num_collectors
        self.workers = [self._start(r) for r in range(num_collectors)]

    def _start(self, rank, first_seq=0, owed=()):
        if self.is_process:  # not daemonic, so that a collector may start processes (vLLM's engine); close() joins
            # them, and a collector whose trainer is gone leaves by itself (Collector.alive)
            self.inboxes[rank], outbox = self.mpctx.Pipe(duplex=False)
            worker = self.mpctx.Process(target=run_collector, args=(rank, self.shared, outbox, self.collector_fn,
                                                                    self.fn_args, True, first_seq, owed))
            worker.start()
            outbox.close()  # the child's end, only in the child: its death ends the pipe
            return worker
        worker = threading.Thread(target=run_collector_thread, daemon=True, args=(
            rank, self.shared, self.messages, self.collector_fn, self.fn_args, first_seq, owed))
        worker.start()
        return worker

    def _poll(self, timeout):
        if not self.is_process:
            try:
                return self.messages.get(timeout=timeout)
            except queue.Empty:
                return None
        for inbox in wait(self.inboxes, timeout):  # a message, or the end of a process's pipe
            rank = self.inboxes.index(inbox)
            try:
                return inbox.recv()
            except (EOFError, OSError):  # gone, after what it sent: a killed process leaves its exit code only
                worker = self.workers[rank]
                worker.join(timeout=10)
                code = worker.exitcode
                why = f"exit code {code}" + (f", {signal.Signals(-code).name}" if code is not None and code < 0 else "")
                return "died", rank, f"died with {why} and no traceback", None
        return None

    def _restart(self, rank: int, error: str) -> bool:
        """Start collector `rank` again, unless the run's `max_restarts` are spent: it continues the dead one's
        sequence numbers and first produces the tickets the dead one took and the trainer never received."""
        if self.stats.restarts >= self.max_restarts:
            return False
        dead = self.workers[rank]
        dead.join(timeout=10)
        if self.is_process:
            if dead.is_alive():  # it reported an error and hangs on its way out
                dead.kill()
                dead.join()
            end_group(dead.pid)
            self.inboxes[rank].close()
            # Killed inside the few lines that hand out a ticket, it holds their lock for good; a live collector
            # holds it for microseconds. Held for a second, it is the dead one's: released here either way.
            self.shared.ticket_lock.acquire(timeout=1.0)
            self.shared.ticket_lock.release()
        first_seq, taken = self.next_seq[rank], int(self.shared.taken[rank])
        log = self.shared.ticket_log[rank]
        owed = [int(log[j % log.shape[0]]) for j in range(first_seq, taken)]
        owed = [g for g in owed if g >= self.version and g not in self.ready]
        self.stats.restarts += 1
        reason = error.strip().splitlines()[-1] if error.strip() else "no reason given"
        print(f"leanrl: collector {rank} {reason if reason.startswith('died') else 'raised ' + reason}; started "
              f"again from the newest weights, version {int(self.weights.latest)}, owing tickets {owed} "
              f"(restart {self.stats.restarts} of --max-restarts {self.max_restarts})", file=sys.stderr, flush=True)
        self.workers[rank] = self._start(rank, first_seq, tuple(owed))
        return True

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
            end_group(w.pid)
        for inbox in self.inboxes:
            if inbox is not None:
                inbox.close()
        if self.state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def end_group(pgid: int, grace: float = 5.0):
    """Stop what a collector process left behind in its process group (a vLLM engine outlives a collector that
    was killed): SIGTERM, which lets an engine shut its workers down, then SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + grace
        try:
            os.killpg(pgid, sig)
            while time.monotonic() < deadline:
                time.sleep(0.05)
                os.killpg(pgid, 0)
        except ProcessLookupError:  # the group is empty
            return


def run_collector_thread(rank, shared, outbox, fn, fn_args, first_seq=0, owed=()):
    """On a GPU, each collector thread runs on its own CUDA stream (the trainer keeps the default one)."""
    if torch.cuda.is_available():
        with torch.cuda.stream(torch.cuda.Stream()):
            run_collector(rank, shared, outbox, fn, fn_args, False, first_seq, owed)
    else:
        run_collector(rank, shared, outbox, fn, fn_args, False, first_seq, owed)
