"""leanrl: small-model RL at the speed of the hardware. A toolbox: the algorithm files own their loops and call
these tools (nothing here calls back into an algorithm).

Each name loads its module on first use, so the commands that need no torch (`python -m leanrl.plot`,
`scripts/plan_layout.py`) start without waiting for torch's and tensordict's imports."""

import importlib

_MODULE_OF = {
    **dict.fromkeys(["ONE_GRAPH", "WARMUP", "Acceleration", "ShapeChangeError", "ShapeGuard", "accelerate"], "graphs"),
    "sync_cuda": "graph_threads",
    **dict.fromkeys(["FunctionalAdam", "functional_step", "load_optimizer_state", "make_adam"], "optim"),
    **dict.fromkeys(["scan_env_steps", "scan_gradient_steps"], "scan"),
    "EvalArgs": "run", "Replay": "replay", "restore_replay": "replay",
    **dict.fromkeys(["EnvBuffers", "VectorEnv", "no_step"], "env"),
    **dict.fromkeys(["categorical", "diagonal_gaussian"], "distributions"),
    "effective_sample_size": "importance",
    **dict.fromkeys(["CheckpointError", "load_checkpoint", "load_in_place", "restore_rng", "save_checkpoint",
                     "save_on_interrupt", "state_of"], "checkpoint"),
    **dict.fromkeys(["MissingExtra", "UsageError", "clean_exit", "import_user_module", "require_extra"], "cli"),
    **dict.fromkeys(["crossings", "evaluate", "open_eval_envs"], "evaluation"),
    "TorchVectorEnv": "gym_adapter",
    "set_threads": "threads",
    "Logger": "logger",
    **dict.fromkeys(["RunArgs", "check_flags", "make_run_dir", "path_safe", "resolve_device", "restore_envs",
                     "seed_everything"], "run"),
}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'leanrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"leanrl.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
