"""Data-parallel training over torchrun's ranks: every rank holds the whole model, samples and trains on its own
share of each batch, and the ranks' gradients are summed before every optimizer step (what DDP does at the end of
a `no_sync` gradient accumulation), so an update equals one process's update on the whole batch when the loss is
normalised by whole-batch totals (`total`). The all-reduce runs between the compiled (and captured) functions,
in place on the gradients they read, so nothing is recompiled or recaptured.

Launch: `torchrun --nproc-per-node N script.py ...` (rank r of a node on GPU r; NCCL for CUDA tensors, gloo for
CPU ones). Without torchrun, `from_torchrun` is a world of one and nothing is communicated.
"""

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from leanrl.checkpoint import save_on_interrupt
from leanrl.logger import Logger

# Metrics that add up over the ranks' shares of a batch (counts, throughputs); `*_max`/`*_min` take the extreme,
# every other metric is the mean over ranks.
SUMMED = ("lag/token_hist_", "lag/sequence_hist_", "async/lag_hist_", "charts/zero_variance_groups",
          "perf/sampled_tokens_per_s", "perf/trained_tokens_per_s")



def init_torchrun_group(backend: str):
    """Join the process group of the ranks torchrun started. A job torchrun starts again (`--max-restarts`) meets
    the previous attempt's addresses in torchrun's store, which it keeps: each attempt's keys stay apart."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"leanrl/attempt_{attempt}", store), rank=rank,
                            world_size=world)

class DataParallel:
    def __init__(self, device: torch.device, world: int = 1, rank: int = 0):
        self.device, self.world, self.rank = device, world, rank

    @staticmethod
    def torchrun_world() -> int:
        """How many ranks torchrun started (1 without torchrun), known before joining them."""
        return int(os.environ.get("WORLD_SIZE", 1))

    @classmethod
    def from_torchrun(cls, device: torch.device) -> "DataParallel":
        """The ranks torchrun started (joined here), or a world of one. On CUDA, `device` becomes this rank's GPU."""
        world = cls.torchrun_world()
        if world == 1:
            return cls(device)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            init_torchrun_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        return cls(device, world, dist.get_rank())

    def logging(self, args, run_dir: str, total_steps: int, start_step: int, checkpoint: str, state_fn, **kwargs):
        """This rank's Logger (`Logger.from_args(..., **kwargs)`) and save-on-interrupt guard. Rank 0 logs the world's
        metrics in run_dir and keeps the one checkpoint (the ranks' weights are equal); rank r > 0 logs its own share
        under run_dir/rank<r> (its sample times show a straggler), quietly."""
        if self.rank == 0:
            logger = Logger.from_args(args, run_dir, total_steps, start_step=start_step, checkpoint=checkpoint, **kwargs)
            return logger, save_on_interrupt(checkpoint, state_fn, args)
        quiet = dataclasses.replace(args, track=False, progress=False)
        kwargs.pop("return_metric", None)
        return (Logger.from_args(quiet, os.path.join(run_dir, f"rank{self.rank}"), total_steps, start_step=start_step,
                                 summary=False, **kwargs), contextlib.nullcontext())

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (a new tensor)."""
        if self.world == 1:
            return x
        x = x.clone()
        dist.all_reduce(x)
        return x

    def all_reduce_grads_(self, params) -> None:
        """Sum the ranks' gradients, in place, in one flat all-reduce."""
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def reduce_metrics(self, metrics: dict) -> dict:
        """The world's metrics from each rank's (device tensors or numbers): summed, extreme or mean, by name."""
        if self.world == 1:
            return metrics
        names = list(metrics)
        values = torch.stack([torch.as_tensor(metrics[k], device=self.device).float().reshape(()) for k in names])
        total, high, low = values.clone(), values.clone(), values.clone()
        dist.all_reduce(total)
        dist.all_reduce(high, dist.ReduceOp.MAX)
        dist.all_reduce(low, dist.ReduceOp.MIN)
        return {k: high[i] if k.endswith("_max") else low[i] if k.endswith("_min")
                else total[i] if k.startswith(SUMMED) else total[i] / self.world for i, k in enumerate(names)}

    def from_rank_zero(self, fn):
        """`fn()`, called on rank 0 only, on every rank (e.g. the run directory rank 0 creates)."""
        if self.world == 1:
            return fn()
        box = [fn() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def in_turns(self, fn):
        """`fn()` on rank 0, then on each other node's first rank, then on the rest, a barrier between turns:
        the first to run builds a cache on its disk (a shared one, or its node's), the later ones load it."""
        turn = 0 if self.rank == 0 else 1 if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 2
        for t in range(3):
            if t == turn:
                result = fn()
            if self.world > 1:
                dist.barrier()
        return result

    def close(self):
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
