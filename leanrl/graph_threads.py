"""CUDA graphs among threads: the async split runs collectors and the trainer as threads of one process, each
replaying or capturing graphs. CUDA forbids, while one stream captures, what would wait on it in any thread; these
keep the captures and the replays out of each other's way, and `sync_cuda` waits for this thread's stream only."""

import threading

import torch
from tensordict.nn import CudaGraphModule


def sync_cuda(device=None):
    """Wait for this thread's CUDA stream (on `device`, when given: a CPU one has nothing to wait for): what it wrote
    is complete before another thread or role reads it, or a clock reads the time. Never the whole device: that is an
    error while another thread captures a CUDA graph."""
    on_cuda = device is None or torch.device(device).type == "cuda"
    if on_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream(device).synchronize()


class _ThreadLocalCapture(torch.cuda.graph):
    """`torch.cuda.graph` capturing in CUDA's thread-local mode, as inductor's own CUDA graphs do."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="thread_local", **kwargs):
        super().__init__(cuda_graph, pool, stream, capture_error_mode, **kwargs)


class _CaptureLock:
    """Shared by the calls of CUDA-graphed functions, held alone by a capture. While a stream captures, CUDA forbids
    in every thread, whatever the capture mode, what would wait on that stream: a device-wide synchronize, which
    CudaGraphModule does before every replay, and a compile's autotuning in a warm-up call: async GRPO failed so on
    a GPU, a collector replaying its cache copy while the other captured. Calls in several threads run
    together; a capture waits for the calls in flight, and calls that come meanwhile wait for it (else two threads
    replaying in turn could keep it out for ever). A thread inside already passes, not to wait for itself (no
    graphed function here calls another; a capture inside a capture is torch's error to raise)."""

    def __init__(self):
        self._changed = threading.Condition(threading.Lock())
        self._calls = 0  # calls running
        self._captures = 0  # captures running or waiting
        self._capturing = False
        self._held = threading.local()

    def acquire(self, capture: bool) -> bool:
        """Whether this took the lock (False when the thread holds it already)."""
        if getattr(self._held, "yes", False):
            return False
        with self._changed:
            if capture:
                self._captures += 1
                self._changed.wait_for(lambda: not self._calls and not self._capturing)
                self._capturing = True
            else:
                if self._captures:
                    self._changed.wait_for(lambda: not self._captures)
                self._calls += 1
        self._held.yes = True
        return True

    def release(self, capture: bool):
        self._held.yes = False
        with self._changed:
            if capture:
                self._captures -= 1
                self._capturing = False
                self._changed.notify_all()
            else:
                self._calls -= 1
                if self._captures and not self._calls:
                    self._changed.notify_all()


_graph_lock = _CaptureLock()


class GraphedAmongThreads:
    """A CudaGraphModule whose calls take `_graph_lock`, and whose capture (its `warmup`-th call) also takes CUDA's
    thread-local capture mode. CudaGraphModule captures in torch's default, global mode, in which a cudaMalloc in
    any other thread is an error: async GRPO's second collector thread, warming up while the first captured,
    failed with "operation not permitted when stream is capturing". Thread-local mode lets other threads
    allocate (the allocator keeps their memory out of the graph's pool)."""

    def __init__(self, graphed: CudaGraphModule, warmup: int):
        self.graphed, self.warmup_calls_left, self.captured = graphed, warmup - 1, False

    def __call__(self, *args, **kwargs):
        capture = not (self.captured or self.warmup_calls_left)
        self.warmup_calls_left -= bool(self.warmup_calls_left)
        took = _graph_lock.acquire(capture)
        try:
            if not capture:
                return self.graphed(*args, **kwargs)
            graph, torch.cuda.graph = torch.cuda.graph, _ThreadLocalCapture  # where CudaGraphModule looks
            try:
                out = self.graphed(*args, **kwargs)
            finally:
                torch.cuda.graph = graph
            self.captured = True
            return out
        finally:
            if took:
                _graph_lock.release(capture)
