"""What a run's flags mean beyond their own help: which of them change what the run computes (a resume may change
the others, `leanrl.checkpoint`, and `leanrl.plot` draws runs that differ only in them as one curve), and which mean
nothing to a run without `--async` (its config.json leaves them out). Torch-free."""

import dataclasses

# They decide how a run is watched, saved, accelerated or spread over threads, not what it computes.
HARMLESS_FLAGS = frozenset({
    "resume", "run_dir", "log_every", "checkpoint_every", "progress", "track", "wandb_project_name", "wandb_entity",
    "wandb_mode", "device", "compile", "cudagraphs", "threads", "eval_every", "eval_episodes", "eval_prompts",
    "capture_video", "save_buffer", "max_restarts",
})


def computing_flags(flags) -> set[str]:
    """Those of `flags` (names) that change what a run computes: all but HARMLESS_FLAGS and the seed."""
    return set(flags) - HARMLESS_FLAGS - {"seed"}


# A field's metadata, `dataclasses.field(default=..., metadata=ASYNC_ONLY)`: the flag means nothing without --async.
ASYNC_ONLY = {"leanrl": "async only"}


def config_of(args) -> dict:
    """A run's flags (a dataclass) as its config.json holds them: every one, but the async-only ones of a run without
    --async."""
    config = dataclasses.asdict(args)
    if not getattr(args, "async_", False):
        for f in dataclasses.fields(args):
            if f.metadata.get("leanrl") == ASYNC_ONLY["leanrl"]:
                del config[f.name]
    return config
