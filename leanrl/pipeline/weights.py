"""Weights from the trainer to collectors, copied in place, never torn.

The protocol is a seqlock over a ring of `slots` weight buffers in shared memory (threads share them
directly, processes through torch's shared memory). Slot `v % slots` holds version `v`, with a header
`[seq, version]`:

  writer (the trainer only):  seq += 1 (odd: writing) -> copy weights -> version = v -> seq += 1 (even)
  reader (a collector):       s1 = seq (retry while odd) -> check version -> copy into its own params
                              -> s2 = seq; the copy is valid iff s1 == s2, else copy again

A collector copies into its *own* parameters, in place, at a step boundary, in its own thread, so its
forward pass only ever runs on a validated copy (never a mix of two versions) and a captured CUDA graph
keeps reading the same addresses. The ring (max_lag + 1 slots) lets deterministic mode read the exact
version it needs while newer ones are published: the slot of version v is only overwritten by v + slots,
which the trainer cannot publish before the batch that needed v is consumed.
"""

import time

import torch
from tensordict import TensorDictBase

from leanrl.graph_threads import sync_cuda
from leanrl.pipeline.core import Stopped


class WeightRing:
    def __init__(self, params: TensorDictBase, slots: int, shared: bool):
        self.slots = slots
        self.weights = torch.stack([params.detach().clone().cpu() if shared else params.detach().clone()
                                    for _ in range(slots)])
        self.header = torch.full((slots, 2), -1, dtype=torch.int64)  # [seq, version]; version -1: empty
        self.header[:, 0] = 0
        self.latest = torch.full((1,), -1, dtype=torch.int64)  # newest published version
        self.stop = torch.zeros(1, dtype=torch.int64)  # set by the trainer: collectors leave their loops
        if shared:
            self.weights.share_memory_()
            for t in (self.header, self.latest, self.stop):
                t.share_memory_()

    def publish(self, params: TensorDictBase, version: int):
        sync_cuda()  # the update's kernels are done before seq says the slot is complete
        slot = version % self.slots
        self.header[slot, 0] += 1
        self.weights[slot].update_(params.detach())
        self.header[slot, 1] = version
        self.header[slot, 0] += 1
        self.latest.fill_(version)

    def read_into(self, params: TensorDictBase, version: int | None = None, alive=lambda: True) -> int:
        """Copy version `version` (None: the newest) into `params` in place; return the version copied."""
        while True:
            v = int(self.latest) if version is None else version
            slot = v % self.slots
            s1 = int(self.header[slot, 0])
            if v < 0 or s1 % 2 or int(self.header[slot, 1]) != v:
                if version is not None and int(self.header[slot, 1]) > v:
                    raise RuntimeError(f"weights of version {v} were overwritten before this collector read them")
                if not alive():
                    raise Stopped
                time.sleep(1e-4)  # being written, or not yet published
                continue
            params.update_(self.weights[slot])
            sync_cuda()
            if int(self.header[slot, 0]) == s1:
                return v
