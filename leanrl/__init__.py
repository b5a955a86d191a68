"""leanrl: small-model RL at the speed of the hardware."""

from leanrl.acceleration import ShapeChangeError, ShapeGuard, accelerate, make_adam
from leanrl.checkpoint import load_checkpoint, raise_on_sigterm, save_checkpoint
from leanrl.logger import Logger
from leanrl.run import RunArgs, make_run_dir, mode_name, resolve_device, restore_envs, run, seed_everything

__all__ = [
    "accelerate", "make_adam", "ShapeChangeError", "ShapeGuard", "Logger", "RunArgs", "load_checkpoint",
    "save_checkpoint", "raise_on_sigterm", "make_run_dir", "mode_name", "run", "resolve_device",
    "restore_envs", "seed_everything",
]
