"""The async collector/trainer split (PipelineRL style): in-flight weight updates, bounded staleness.

`start(transport, ...)` returns the trainer's handle (`next_batch`, `publish`, `stats`); collector
functions receive a context (`batches(params)`, `step_boundary()`). See core.py for the version and
admission protocol, weights.py for the torn-read-free weight transfer.
"""

from leanrl.pipeline.core import AsyncArgs, CollectorError, Trainer, check_settings


def start(transport, num_collectors, collector_fn, fn_args, batch_template, params, *, max_lag,
          deterministic=False, timeout=None, publish_every=1, max_restarts=0):
    """Start collectors running `collector_fn(ctx, *fn_args)` and return the trainer's handle (a context
    manager). With "distributed", call it on every torchrun rank: rank 0 gets the handle, collector
    ranks run `collector_fn` until the trainer stops them and get None. `max_restarts`: collectors that die
    are started again up to this many times in all (threads and processes; a dead torchrun rank stops the job)."""
    if transport == "distributed":
        from leanrl.pipeline.distributed import start_distributed
        return start_distributed(num_collectors, collector_fn, fn_args, batch_template, params, max_lag=max_lag,
                                 deterministic=deterministic, timeout=timeout, publish_every=publish_every)
    from leanrl.pipeline.local import LocalTrainer
    return LocalTrainer(transport, num_collectors, collector_fn, fn_args, batch_template, params, max_lag=max_lag,
                        deterministic=deterministic, timeout=timeout, publish_every=publish_every,
                        max_restarts=max_restarts)


__all__ = ["AsyncArgs", "CollectorError", "Trainer", "check_settings", "start"]
