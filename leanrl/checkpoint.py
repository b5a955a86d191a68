"""Checkpoints that resume a run exactly: state, every RNG the run draws from, and the run's flags, which a resume
compares with its own; on Ctrl-C or SIGTERM, a checkpoint saved before the run ends (`save_on_interrupt`)."""

import contextlib
import glob
import os
import random
import signal
import sys
import threading
from dataclasses import MISSING, asdict, fields

import numpy as np
import torch
from tensordict import is_tensor_collection
from tqdm import tqdm

from leanrl.cli import UsageError, raise_on_sigterm
from leanrl.config import HARMLESS_FLAGS
from leanrl.optim import load_optimizer_state


class CheckpointError(UsageError):
    """A checkpoint that cannot be read, or that this run cannot resume (another algorithm, other flags)."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(checkpoint: dict) -> None:
    """Continue the random streams a checkpoint saved (`load_checkpoint` reads them): called where the run that
    saved it drew its next number, so a resumed run draws what an uninterrupted one would."""
    set_rng_state(checkpoint["rng"])


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def algorithm_of(args) -> str:
    """The algorithm a run's arguments belong to: the module of its `Args` class (a script's subclass counts as
    the algorithm's), e.g. 'ppo_async', 'td3'."""
    module = next(c.__module__ for c in type(args).__mro__ if c.__module__ != "__main__")
    return module.rsplit(".", 1)[-1]


def state_of(parts: dict) -> dict:
    """A learner's checkpoint entries: `parts` {name: module, optimizer, TensorDict or tensor; None: absent}, each
    as its state dict (a TensorDict as a dict, a tensor detached)."""
    return {name: x if x is None else x.to_dict() if is_tensor_collection(x) else
            x.detach() if isinstance(x, torch.Tensor) else x.state_dict() for name, x in parts.items()}


@torch.no_grad()
def load_in_place(parts: dict, state: dict) -> None:
    """`state_of`'s entries back into the same `parts`, in place, so that every address a captured graph holds stays
    valid (an optimizer keeps its tensor learning rate: `load_optimizer_state`)."""
    for name, x in parts.items():
        if isinstance(x, torch.optim.Optimizer):
            load_optimizer_state(x, state[name])
        elif is_tensor_collection(x):
            x.update_(state[name])
        elif isinstance(x, torch.Tensor):
            x.copy_(state[name])
        elif x is not None:
            x.load_state_dict(state[name])


def save_checkpoint(path: str, state: dict, args=None) -> None:
    """Write atomically (a temporary file renamed over the old one: a kill mid-write never leaves a torn
    checkpoint). With `args` (a dataclass), the checkpoint also holds the flags and algorithm of the run."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args is not None:
        state = {**state, "args": asdict(args), "algorithm": algorithm_of(args)}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save({**state, "rng": rng_state()}, tmp)
        os.replace(tmp, path)
    finally:  # after a failed or interrupted write, only the torn temporary is gone
        if os.path.exists(tmp):
            os.remove(tmp)


def _defaults(args) -> dict:
    return {f.name: f.default if f.default_factory is MISSING else f.default_factory()
            for f in fields(args) if f.default is not MISSING or f.default_factory is not MISSING}


def check_resumable(path: str, state: dict, args, may_change=()) -> None:
    """Refuse a checkpoint of another algorithm, or of a run whose flags differ from `args` other than in
    HARMLESS_FLAGS and the algorithm's own `may_change`, in one line that lists the differences. A flag the
    checkpoint does not hold (written before the flag existed) counts as its default."""
    if "args" not in state:
        return  # written without flags: nothing to compare
    algorithm = algorithm_of(args)
    if state["algorithm"] != algorithm:
        raise CheckpointError(f"--resume {path}: a {state['algorithm']} checkpoint (run "
                              f"{state['args'].get('exp_name')!r}), not one of {algorithm}")
    # A flag added after the checkpoint was written: its run had the flag's default behaviour.
    saved, now = {**_defaults(args), **state["args"]}, asdict(args)
    changed = [k for k in sorted(set(now) | set(saved))
               if k not in HARMLESS_FLAGS | set(may_change) and now.get(k) != saved.get(k)]
    if not changed:
        return
    diffs = "; ".join(f"--{k.strip('_').replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
    if saved.get("exp_name") != now.get("exp_name"):
        raise CheckpointError(f"--resume {path}: a checkpoint of another script or experiment "
                              f"({saved.get('exp_name')!r} on {saved.get('env_id')!r}), not of {now.get('exp_name')!r} "
                              f"(flags that differ: {diffs})")
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    raise CheckpointError(f"--resume {path}: these flags differ from the checkpoint's run ({diffs}); resume with "
                          f"the run's flags (in {config}) or start a new run")


def find_checkpoint(args) -> str | None:
    """The checkpoint `--resume` names: its path, or with `--resume auto` the newest checkpoint of this experiment
    (its runs, `<run-dir>/*__<exp-name>__<seed>__*`), None while it has none: a job that torchrun starts again
    (`--max-restarts`) with the same flags continues where the last attempt saved."""
    if args.resume != "auto":
        return args.resume
    runs = os.path.join(glob.escape(args.run_dir), f"*__{glob.escape(args.exp_name)}__{args.seed}__*", "checkpoint.pt")
    return max(glob.glob(runs), key=os.path.getmtime, default=None)


def load_checkpoint(path: str, args=None, may_change=(), map_location="cpu") -> dict | None:
    """Load a checkpoint: its state, with the RNG states under "rng" (`restore_rng` continues them). With `args`,
    first check that this run may resume it (`check_resumable`: `may_change` names the flags this algorithm lets a
    resume change, e.g. total_timesteps where no schedule depends on it). Every failure is a one-line error naming
    the file: load it before building anything, so that the line is the run's only output. `path` "auto": as
    `find_checkpoint` finds it (with `args`); None when there is none yet."""
    if path == "auto" and (path := find_checkpoint(args)) is None:
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume {path}: no checkpoint at that path")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception:  # torch.load's errors for a torn or foreign file speak of its internals (pickle, zip, OS)
        raise CheckpointError(f"--resume {path}: not a readable checkpoint (cut short, or not a file leanrl "
                              "wrote)") from None
    if not isinstance(state, dict) or "rng" not in state:
        raise CheckpointError(f"--resume {path}: not a leanrl checkpoint (no RNG state in it)")
    if args is not None:
        check_resumable(path, state, args, may_change)
    return state


@contextlib.contextmanager
def save_on_interrupt(path: str, state_fn, args=None):
    """Inside it, SIGTERM raises KeyboardInterrupt; on Ctrl-C or SIGTERM, save `state_fn()` (with `args`) at
    `path`, say how to resume, and re-raise. The previous SIGTERM handler is restored on exit. (Signals reach only
    the main thread: elsewhere, e.g. in a collector thread, it only saves on a KeyboardInterrupt raised inside.)"""
    main = threading.current_thread() is threading.main_thread()
    previous = raise_on_sigterm() if main else None
    try:
        yield
    except KeyboardInterrupt:
        save_checkpoint(path, state_fn(), args)
        # on a line of its own, the progress bar cleared off it first
        tqdm.write(f"interrupted; checkpoint saved (resume with --resume {path})", file=sys.stdout)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
