"""Collector functions for tests/test_async.py (module level: spawned processes import them by name)."""

import random
import time

import torch
from tensordict import TensorDict

STEPS, WIDTH = 4, 3


def template():
    return TensorDict(x=torch.zeros(STEPS, WIDTH), version=torch.zeros(STEPS, dtype=torch.int64),
                      batch_size=[STEPS])


def params():
    return TensorDict(w=torch.zeros(WIDTH), b=torch.zeros(WIDTH))


def toy_collector(ctx, delay_seed, max_delay, fail_at=None):
    """Acts with its copy of the weights: x = w + b + noise from a per-collector generator; sleeps a random
    (seeded by `delay_seed`, so different per run) time per step."""
    local = params()
    sleeps = random.Random(delay_seed * 100 + ctx.rank)
    noise = torch.Generator().manual_seed(1000 + ctx.rank)
    for j, batch in enumerate(ctx.batches(local, template())):
        if j == fail_at:
            raise ValueError(f"collector {ctx.rank} fails on batch {j} at {time.time()}")
        for t in range(STEPS):
            batch["version"][t] = ctx.step_boundary()
            time.sleep(sleeps.uniform(0, max_delay))
            batch["x"][t] = local["w"] + local["b"] + torch.rand(WIDTH, generator=noise)


def toy_update(weights, batch):
    """A deterministic 'optimizer step' that depends on everything in the batch."""
    weights["w"].mul_(0.9).add_(batch["x"].mean(0))
    weights["b"].copy_(batch["x"].std(0))


def slow_start_collector(ctx, start_s):
    """Starts `start_s` late (as a collector that builds envs and compiles), then fills its batches at once."""
    time.sleep(start_s)
    local = params()
    for batch in ctx.batches(local, template()):
        for t in range(STEPS):
            batch["version"][t] = ctx.step_boundary()
            batch["x"][t] = local["w"]


def receive_directory(rank, world, port, path, out, rank_zero_only):
    """Rank `rank` of a gloo world: rank 0's `path` on this rank, every rank seeing it or (`rank_zero_only`) only
    rank 0 (as on two nodes without a shared file system); writes where this rank got it to `out`/rank<r>.json."""
    import json
    import os

    import torch.distributed as dist

    from leanrl.pipeline.distributed import directory_on_every_rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    visible = (lambda p: rank == 0) if rank_zero_only else os.path.isdir
    local = directory_on_every_rank(path, visible)
    files = {os.path.relpath(os.path.join(r, n), local): open(os.path.join(r, n), "rb").read().hex()
             for r, _, names in os.walk(local) for n in names}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dict(local=local, files=files), f)
    dist.destroy_process_group()


def failing_once_collector(ctx, flag_path, fail_at):
    """`toy_collector`'s batches; the first collector to reach its batch `fail_at` raises there, once in the run
    (the flag file says it has)."""
    import os

    local = params()
    noise = torch.Generator().manual_seed(1000 + ctx.rank)
    for j, batch in enumerate(ctx.batches(local, template())):
        if j == fail_at and not os.path.exists(flag_path):
            open(flag_path, "w").close()
            raise ValueError(f"collector {ctx.rank}'s env fails at its batch {j}")
        for t in range(STEPS):
            batch["version"][t] = ctx.step_boundary()
            batch["x"][t] = local["w"] + local["b"] + torch.rand(WIDTH, generator=noise)
