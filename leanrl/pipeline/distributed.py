"""Collectors and trainer as torch.distributed ranks, launched by torchrun: rank 0 trains, ranks 1..C
collect. Point-to-point messages only; no home-made networking.

Backends: gloo carries the batches and every control message. The weights go over NCCL, GPU to GPU, when
the run is on CUDA and every rank of a node has a GPU of its own (rank r of a node on GPU r), else over
gloo from host memory. They have a process group of their own: NCCL ignores tags, and one communicator
per direction cannot deadlock on the order in which two threads issue sends and receives.

gloo's point-to-point requests only complete inside `wait()`, so every receive runs in a thread of its
own: one per collector on the trainer (batches), one on each collector (weights, on a CUDA stream of its
own so that a receive still waiting for the next version never holds back the collector's kernels).

Tickets are a fixed schedule (collector c takes c, c + C, c + 2C, ...), so admission only needs the newest
version a collector has received. Weights: at every publish the trainer sends `[version, stop]` and
the flat parameters to every collector. Double buffer: the receiving thread writes a staging buffer and
files a copy under its version; the collector copies a filed version into its parameters, in place, only
at a step boundary, so a forward pass never sees a half-received version.
Batches: a header `[kind, ticket, seq, idle us, total us]`, then the batch's tensors (kind BATCH), a
traceback (ERROR) or nothing (DONE: the collector has stopped and sends no more).
"""

import os
import queue
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from leanrl.graph_threads import sync_cuda
from leanrl.cli import UsageError
from leanrl.data_parallel import init_torchrun_group
from leanrl.pipeline.core import Stats, Stopped, Trainer, check_settings

BATCH, ERROR, DONE = 0, 1, 2
BATCH_TAG, WEIGHT_TAG = 1, 2
ERROR_BYTES = 1 << 16


_weights_group = None  # the weights' own process group (set by join): NCCL on GPUs, else gloo


def directory_on_every_rank(path: str, visible=os.path.isdir) -> str:
    """Rank 0's directory `path` (a model: config, tokenizer, weights) as a local path on this rank; every rank
    calls it. A rank that does not see `path` (another node, no shared file system) receives the files over the
    default group into a folder of its own; where every rank sees it, nothing is sent. `visible(path)`: whether
    this rank sees it."""
    rank = dist.get_rank()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, bool(visible(path)))
    if all(seen):
        return path
    files = [{str(f.relative_to(path)): f.read_bytes() for f in Path(path).rglob("*") if f.is_file()}
             if rank == 0 else None]
    dist.broadcast_object_list(files, src=0)
    if seen[rank]:
        return path
    local = Path(tempfile.mkdtemp(prefix="leanrl-from-rank0-"))
    for name, data in files[0].items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    return str(local)


def join(num_collectors, device: torch.device) -> torch.device:
    """Join the torchrun group (every rank calls this first) and return this rank's device."""
    global _weights_group
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UsageError("--transport distributed: launch with torchrun, one rank per collector and one for the "
                             f"trainer: torchrun --nproc-per-node {num_collectors + 1} {shlex.join(sys.argv)}")
        init_torchrun_group("gloo")
    if dist.get_world_size() != num_collectors + 1:
        raise UsageError(f"--num-collectors {num_collectors} needs a world of {num_collectors + 1} ranks "
                         f"(one trainer), torchrun started {dist.get_world_size()}")
    nccl = False
    if device.type == "cuda":
        local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        nccl = torch.cuda.device_count() >= local_ranks  # NCCL cannot connect two ranks on one GPU
        if nccl:
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        elif dist.get_rank() == 0:
            print(f"--transport distributed: {local_ranks} ranks on this node share {torch.cuda.device_count()} "
                  "GPU(s); the collectors run on the CPU and the weights go over gloo (one GPU per rank puts "
                  "every rank on its own GPU and the weights on NCCL)", flush=True)
        else:
            device = torch.device("cpu")
    _weights_group = dist.new_group(backend="nccl" if nccl else "gloo")
    return device


def is_collector_rank() -> bool:
    return dist.get_rank() != 0


def broadcast_from_rank_zero(obj=None):
    """Rank 0's `obj` (picklable) on every rank; every rank calls this."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _flat(params):
    """The parameters as one buffer: on their GPU when the weights go over NCCL, in host memory for gloo."""
    leaves = list(params.values(True, True))
    if len({t.dtype for t in leaves}) != 1:
        raise ValueError("--transport distributed sends the weights as one flat buffer: all parameters must "
                         "share a dtype")
    flat = torch.cat([t.detach().reshape(-1) for t in leaves])
    return leaves, flat if dist.get_backend(_weights_group) == "nccl" else flat.cpu()


def _receiving_stream(device):
    if device.type != "cuda":
        return nullcontext()
    torch.cuda.set_device(device)  # the current device is per thread
    return torch.cuda.stream(torch.cuda.Stream(device))


def _leaves(batch):
    return [batch[k] for k in sorted(batch.keys(True, True), key=str)]


class DistCollector:
    def __init__(self, num_collectors, max_lag, deterministic):
        self.rank = dist.get_rank() - 1
        self.num_collectors, self.max_lag, self.deterministic = num_collectors, max_lag, deterministic
        self.version, self.stopped = -1, threading.Event()
        self.min_version = 0  # the oldest version the batch being filled may hold (ticket - max_lag)
        self.received = OrderedDict()  # version -> flat weights, the newest max_lag + 2
        self.lock = threading.Lock()
        self.t_start, self.idle = time.perf_counter(), 0.0

    def _receive_weights(self, staging):
        header = torch.zeros(2, dtype=torch.int64)
        with _receiving_stream(staging.device):
            self._receive_loop(header, staging)

    def _receive_loop(self, header, staging):
        while True:
            try:
                dist.recv(header, 0, tag=WEIGHT_TAG)
                dist.recv(staging, 0, group=_weights_group, tag=WEIGHT_TAG)
            except RuntimeError:  # the trainer's connection closed (it was killed): leave instead of waiting forever
                self.stopped.set()
                return
            version, stop = header.tolist()
            if stop:
                self.stopped.set()
                return
            received = staging.clone()
            sync_cuda()  # received and copied before it is filed
            with self.lock:
                self.received[version] = received
                while len(self.received) > self.max_lag + 2:
                    self.received.popitem(last=False)

    def _newest(self):
        with self.lock:
            return next(reversed(self.received)) if self.received else -1

    def _wait(self, ready):
        t0 = time.perf_counter()
        while not ready():
            if self.stopped.is_set():
                raise Stopped
            time.sleep(2e-4)
        self.idle += time.perf_counter() - t0

    def _load(self, version):
        with self.lock:
            flat = self.received[version]
        torch._foreach_copy_(self.leaves, [c.view_as(t) for c, t in zip(flat.split(self.sizes), self.leaves)])
        self.version = version

    def batches(self, params, template, state=None):
        """As `leanrl.pipeline.local.Collector.batches`; `state` goes unused: a rank that dies stops the job,
        which restarts from its checkpoint (docs/async.md)."""
        self.leaves, flat = _flat(params)
        self.sizes = [t.numel() for t in self.leaves]
        threading.Thread(target=self._receive_weights, args=(torch.zeros_like(flat),), daemon=True).start()
        batch = template.clone()
        j = 0
        while True:
            g = self.rank + j * self.num_collectors
            want = self.min_version = max(g - self.max_lag, 0)
            if self.deterministic:
                self._wait(lambda: want in self.received)
                self._load(want)
            else:
                self._wait(lambda: self._newest() >= want)
                self._load(self._newest())
            yield batch
            self.send_header(BATCH, g, j)
            for t in _leaves(batch):
                dist.send(t.cpu(), 0, tag=BATCH_TAG)
            j += 1

    def send_header(self, kind, g=-1, j=-1):
        times = [int(self.idle * 1e6), int((time.perf_counter() - self.t_start) * 1e6)]
        dist.send(torch.tensor([kind, g, j, *times]), 0, tag=BATCH_TAG)

    def step_boundary(self):
        if self.stopped.is_set():
            raise Stopped
        if not self.deterministic and self._newest() > self.version:
            self._load(self._newest())
        return self.version


class WeightSender:
    """The trainer's weight sends: one buffer per collector, reused once its previous send completed."""

    def __init__(self, params, num_collectors):
        _, flat = _flat(params)
        self.buffers = [(torch.zeros(2, dtype=torch.int64), flat.clone()) for _ in range(num_collectors)]
        self.work = [[] for _ in range(num_collectors)]

    def publish(self, params, version, stop=0):
        _, flat = _flat(params)
        for c, (header, buf) in enumerate(self.buffers):
            for w in self.work[c]:
                w.wait()
            header.copy_(torch.tensor([version, stop]))
            buf.copy_(flat)
            self.work[c] = [dist.isend(header, c + 1, tag=WEIGHT_TAG),
                            dist.isend(buf, c + 1, group=_weights_group, tag=WEIGHT_TAG)]


class DistTrainer(Trainer):
    def __init__(self, num_collectors, batch_template, params, max_lag, timeout, publish_every):
        slots = [[batch_template.cpu().clone() for _ in range(max_lag + 1)] for _ in range(num_collectors)]
        super().__init__(WeightSender(params, num_collectors), slots, Stats(max_lag, torch.zeros(
            num_collectors, 2, dtype=torch.float64)), params, max_lag, timeout, publish_every)
        self.messages = queue.Queue()
        self.consumed_seq = [-1] * num_collectors
        self.closing = False
        self.receivers = [threading.Thread(target=self._receive_batches, args=(c,), daemon=True)
                          for c in range(num_collectors)]
        for r in self.receivers:
            r.start()
        self.weights.publish(params, 0)

    def _receive_batches(self, c):
        header, j = torch.zeros(5, dtype=torch.int64), 0
        while True:
            # Slot j % (max_lag + 1) is free once batch j - max_lag - 1 is consumed (see local.py).
            while not self.closing and j - (self.max_lag + 1) > self.consumed_seq[c]:
                time.sleep(2e-4)
            dist.recv(header, c + 1, tag=BATCH_TAG)
            kind, g, seq, idle_us, total_us = header.tolist()
            self.stats.collector_times[c] = torch.tensor([idle_us, total_us], dtype=torch.float64) / 1e6
            if kind == DONE:
                return
            if kind == ERROR:
                text = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
                dist.recv(text, c + 1, tag=BATCH_TAG)
                self.messages.put(("error", c, bytes(text.tolist()).rstrip(b"\0").decode(), None))
                return
            for t in _leaves(self.slots[c][j % (self.max_lag + 1)]):
                dist.recv(t, c + 1, tag=BATCH_TAG)
            self.messages.put(("batch", c, seq, g))
            j += 1

    def _slot(self, rank, seq):
        return self.slots[rank][seq % (self.max_lag + 1)]

    def publish(self, params=None):
        self.consumed_seq[self.consumed[-1][1]] = self.consumed[-1][2]
        super().publish(params)

    def _poll(self, timeout):
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self):
        """Stop every collector, take in what they still send, and leave the group together."""
        self.closing = True
        self.weights.publish(self.params, self.version + 1, stop=1)
        for works in self.weights.work:
            for w in works:
                w.wait()
        sync_cuda()  # the last weights are out before NCCL's group is destroyed
        for r in self.receivers:
            r.join()
        dist.barrier()
        dist.destroy_process_group()


def start_distributed(num_collectors, collector_fn, fn_args, batch_template, params, *, max_lag,
                      deterministic=False, timeout=None, publish_every=1):
    check_settings("distributed", num_collectors, max_lag, deterministic, publish_every)
    if _weights_group is None:
        join(num_collectors, torch.device("cpu"))
    if not is_collector_rank():
        return DistTrainer(num_collectors, batch_template, params, max_lag, timeout, publish_every)
    # torchrun passes SIGTERM (and a terminal's Ctrl-C) to every rank: a collector leaves the shutdown to the
    # trainer, which saves its checkpoint and then stops every collector between two messages.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = DistCollector(num_collectors, max_lag, deterministic)
    try:
        collector_fn(ctx, *fn_args)
    except Stopped:
        ctx.send_header(DONE)
    except BaseException:
        tb = traceback.format_exc().encode()[: ERROR_BYTES - 1]
        text = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
        text[: len(tb)] = torch.tensor(list(tb), dtype=torch.uint8)
        ctx.send_header(ERROR)
        dist.send(text, 0, tag=BATCH_TAG)
        ctx.stopped.wait()  # the trainer raises, then stops every role
        raise
    finally:
        dist.barrier()
        dist.destroy_process_group()
