"""What a run's flags mean beyond their own help: which of them change what the run computes. A resume may change
the others (`leanrl.checkpoint`), and `leanrl.plot` draws runs that differ only in them as one curve. Torch-free."""

# They decide how a run is watched, saved, accelerated or spread over threads, not what it computes.
HARMLESS_FLAGS = frozenset({
    "resume", "run_dir", "log_every", "checkpoint_every", "progress", "track", "wandb_project_name", "wandb_entity",
    "wandb_mode", "device", "compile", "cudagraphs", "threads", "eval_every", "eval_episodes", "eval_prompts",
    "capture_video", "save_buffer",
})


def computing_flags(flags) -> set[str]:
    """Those of `flags` (names) that change what a run computes: all but HARMLESS_FLAGS and the seed."""
    return set(flags) - HARMLESS_FLAGS - {"seed"}
