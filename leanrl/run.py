"""What every run shares: its arguments and their checks, seeding, device and run directory."""

import itertools
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from leanrl.checkpoint import algorithm_of, find_checkpoint
from leanrl.cli import UsageError


@dataclass
class RunArgs:
    exp_name: str = ""
    """the name of this experiment, in the run directory's name (default: the algorithm's, e.g. ppo)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    device: str = "auto"
    """torch device of the learner: `auto` picks cuda when available, else cpu"""
    total_timesteps: int = 1_000_000
    """total environment steps of the experiment"""
    compile: bool = False
    """torch.compile the policy and update functions"""
    cudagraphs: bool = False
    """capture the policy and update functions in CUDA graphs (needs fixed shapes; CUDA only)"""
    threads: int = 0
    """torch's CPU threads (0: one for a small model, every core for a large one; the run says which)"""
    track: bool = False
    """log to Weights and Biases"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of wandb's project"""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode when tracking: offline by default, `online` to upload"""
    run_dir: str = "runs"
    """where run directories (metrics.jsonl, checkpoints, wandb files) are created"""
    log_every: int = 1
    """read metrics to the host every this many iterations"""
    checkpoint_every: int = 50
    """save a checkpoint every this many iterations (0: only at exit)"""
    resume: str | None = None
    """path of a checkpoint to resume from; `auto`: this experiment's newest checkpoint under --run-dir if it has
    one, else a fresh start (the flag for a job torchrun restarts: `torchrun --max-restarts N`)"""
    progress: bool = True
    """show a tqdm progress bar"""

    def __post_init__(self):
        if not self.exp_name:
            self.exp_name = algorithm_of(self)


@dataclass
class EvalArgs:
    """The evaluation of an env algorithm's policy (`leanrl.evaluate`): its own envs, the same start states each time,
    the algorithm's evaluation policy (its docstring says which)."""
    eval_every: int = 0
    """evaluate the policy (charts/eval_return) every this many env steps, and once at the end (0: never)"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the evaluation env)"""
    capture_video: bool = False
    """record the evaluation episodes of the first evaluation env to `<run dir>/videos` (evaluates at the end
    even without --eval-every; resuming a finished run with it records the trained agent)"""


def check_flags(args, positive=(), non_negative=(), unit_interval=()) -> None:
    """Bad numbers are errors naming their flag, raised before anything is built: `positive` fields must be > 0,
    `non_negative` >= 0, `unit_interval` in [0, 1] (NaN fails every rule). RunArgs' and EvalArgs' own counts are
    always checked."""
    evaluation = isinstance(args, EvalArgs)
    rules = [(("total_timesteps", "log_every", *positive, *(("eval_episodes",) if evaluation else ())),
              lambda v: v > 0, "> 0"),
             (("checkpoint_every", "threads", *non_negative, *(("eval_every",) if evaluation else ())),
              lambda v: v >= 0, ">= 0"),
             (unit_interval, lambda v: 0 <= v <= 1, "in [0, 1]")]
    for names, ok, rule in rules:
        for name in names:
            if not ok(getattr(args, name)):
                raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be {rule}")


def resolve_device(name: str) -> torch.device:
    """`--device`: `auto` (CUDA when available, else the CPU) or a torch device this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"--device {name}: not a torch device (auto, cpu, cuda, cuda:1, ...)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    count = torch.cuda.device_count()
    if device.type == "cuda" and (device.index or 0) >= count:
        raise UsageError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = deterministic


def restore_envs(envs, env_state, saved_obs, seed: int):
    """Restore `envs` from a checkpoint and return the observation to continue from: the saved one for an
    on-device env (its simulation state was restored, so episodes continue where they were), fresh episodes for
    a host simulator (gymnasium, ALE), which cannot be restored beyond its normalization statistics."""
    envs.load_state_dict(env_state)
    if getattr(envs, "on_device", False):
        return saved_obs.to(envs.device)
    return envs.reset(seed=seed)


def path_safe(name: str) -> str:
    """`name` as one component of a path: `ALE/Breakout-v5` -> `ALE-Breakout-v5`, `module:Class` -> `module.Class`."""
    return name.replace("/", "-").replace(":", ".")


def make_run_dir(args: RunArgs, env_id: str) -> str:
    """`runs/<env>__<exp>__<seed>__<time>`, created here, or the directory of the checkpoint being resumed. Runs
    that start in the same second with the same name (a sweep launched in parallel) each get a directory of their
    own: `<time>-2`, `<time>-3`, ... (before, they shared one: interleaved metrics, one checkpoint)."""
    if args.resume and (checkpoint := find_checkpoint(args)):
        return os.path.dirname(os.path.abspath(checkpoint))
    base = os.path.join(args.run_dir, f"{path_safe(env_id)}__{args.exp_name}__{args.seed}__{int(time.time())}")
    os.makedirs(args.run_dir, exist_ok=True)
    for n in itertools.count(1):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)  # atomic: of two runs that pick the same name, one gets it
            return path
        except FileExistsError:
            pass
