"""Rank functions for tests/test_grpo.py (module level: spawned processes import them by name)."""

import copy
import os

import torch

from leanrl.algorithms import grpo
from leanrl.data_parallel import DataParallel


def data_parallel_update(rank, world, port, model, batch, rewards, args, out):
    """Rank `rank` of `world` (gloo): one GRPO update per rewards vector on this rank's contiguous share of the
    batch (whole groups); saves its parameters and the world's metrics of the last update."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    data_parallel = DataParallel.from_torchrun(torch.device("cpu"))
    model = copy.deepcopy(model)  # the spawned ranks received one shared-memory copy of the weights
    learner = grpo.Learner(model, args, torch.device("cpu"), data_parallel=data_parallel)
    share = batch.shape[0] // world
    rows = slice(rank * share, (rank + 1) * share)
    for version, r in enumerate(rewards):
        metrics = learner.update(batch[rows], r[rows], version)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save((params, data_parallel.reduce_metrics(metrics)), os.path.join(out, f"rank{rank}.pt"))
    data_parallel.close()
