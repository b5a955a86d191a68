"""Checkpoints that resume a run exactly: state plus every RNG the run draws from."""

import contextlib
import os
import random
import signal
import threading

import numpy as np
import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str, state: dict) -> None:
    """Write atomically (a crash mid-write never leaves a truncated checkpoint)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({**state, "rng": rng_state()}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Load a checkpoint and restore the RNG states it holds."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path!r}")
    state = torch.load(path, map_location=map_location, weights_only=False)
    set_rng_state(state.pop("rng"))
    return state


def _raise_on_sigterm():
    """Turn SIGTERM into KeyboardInterrupt so a killed run takes the same exit path as Ctrl-C.
    Returns the previous handler, for the caller to restore."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    return signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def save_on_interrupt(path: str, state_fn):
    """Inside it, SIGTERM raises KeyboardInterrupt; on Ctrl-C or SIGTERM, save `state_fn()` at `path`, say how to
    resume, and re-raise. The previous SIGTERM handler is restored on exit. (Signals reach only the main
    thread: elsewhere, e.g. in a collector thread, it only saves on a KeyboardInterrupt raised inside.)"""
    main = threading.current_thread() is threading.main_thread()
    previous = _raise_on_sigterm() if main else None
    try:
        yield
    except KeyboardInterrupt:
        save_checkpoint(path, state_fn())
        print(f"interrupted; checkpoint saved (resume with --resume {path})")
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
