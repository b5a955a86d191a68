"""leanrl: small-model RL at the speed of the hardware. A toolbox: the algorithm files own their loops and call
these tools (nothing here calls back into an algorithm)."""

from leanrl.acceleration import (WARMUP, ScannableAdam, ShapeChangeError, ShapeGuard, accelerate, compiling_on_cpu,
                                 gradient_step, load_optimizer_state, make_adam, sync_cuda, wrap_flags)
from leanrl.checkpoint import CheckpointError, clean_exit, load_checkpoint, save_checkpoint, save_on_interrupt
from leanrl.evaluation import crossings, evaluate
from leanrl.gym_adapter import TorchVectorEnv
from leanrl.logger import Logger
from leanrl.run import (MissingExtra, RunArgs, UsageError, check_flags, make_run_dir, resolve_device, restore_envs,
                        seed_everything)

__all__ = [
    "WARMUP", "accelerate", "compiling_on_cpu", "gradient_step", "make_adam", "sync_cuda", "wrap_flags",
    "load_optimizer_state", "ScannableAdam", "ShapeChangeError", "ShapeGuard", "Logger", "TorchVectorEnv", "RunArgs",
    "UsageError", "MissingExtra", "check_flags", "load_checkpoint", "save_checkpoint", "save_on_interrupt",
    "CheckpointError", "clean_exit", "crossings", "evaluate", "make_run_dir", "resolve_device", "restore_envs",
    "seed_everything",
]
