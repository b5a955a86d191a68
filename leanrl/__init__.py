"""leanrl: small-model RL at the speed of the hardware. A toolbox: the algorithm files own their loops and call
these tools (nothing here calls back into an algorithm)."""

from leanrl.acceleration import (WARMUP, ShapeChangeError, ShapeGuard, accelerate, load_optimizer_state, make_adam,
                                 wrap_flags)
from leanrl.checkpoint import load_checkpoint, save_checkpoint, save_on_interrupt
from leanrl.gym_adapter import TorchVectorEnv
from leanrl.logger import Logger
from leanrl.run import RunArgs, make_run_dir, resolve_device, restore_envs, seed_everything

__all__ = [
    "WARMUP", "accelerate", "make_adam", "wrap_flags", "load_optimizer_state", "ShapeChangeError", "ShapeGuard",
    "Logger", "TorchVectorEnv", "RunArgs", "load_checkpoint", "save_checkpoint", "save_on_interrupt",
    "make_run_dir", "resolve_device", "restore_envs", "seed_everything",
]
