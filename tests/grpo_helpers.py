"""What the GRPO tests share: runs on the task their args name, as the script builds it, and rank functions (module
level: spawned processes import them by name)."""

import copy
import functools
import os

import torch

from leanrl.algorithms import grpo, grpo_async
from leanrl.data_parallel import DataParallel
from leanrl.envs.llm_tasks import make_task
from leanrl.llm.warm_start import load_policy


def train(args):
    """A sync GRPO run on the task `args.task` names, as scripts/grpo_arith.py builds it."""
    return grpo.train(args, functools.partial(make_task, args.task))


def train_async(args, **kwargs):
    return grpo_async.train(args, functools.partial(make_task, args.task), **kwargs)


def load(args, device=torch.device("cpu")):
    """The task, model, tokenizer and model directory a run of `args` starts from."""
    task = make_task(args.task)
    return (task, *load_policy(args, task, device))


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
