"""How a command meets its user: bad input is one line on stderr (`UsageError`, `MissingExtra`: exit code 2), Ctrl-C
and SIGTERM end it with the shell's exit codes (`clean_exit`), and writes that must not be cut short hold signals off
(`signals_deferred`). Torch-free, like `leanrl/__init__`, so the commands that need no torch (`python -m
leanrl.plot`, `scripts/plan_layout.py`) start without paying its import."""

import atexit
import contextlib
import gc
import importlib
import importlib.util
import os
import signal
import sys
import threading


_said: set[str] = set()  # what say_once has printed in this process


def say_once(message: str):
    """Print `message` on stderr, once per process: a notice about the run's settings, not about each call."""
    if message not in _said:
        print(message, file=sys.stderr)
        _said.add(message)


class UsageError(ValueError):
    """Input a run cannot work with, named as the user gave it (a flag, a file or directory a flag names): a script
    prints its message alone, with exit code 2 (`clean_exit`), before anything long has started."""


class MissingExtra(UsageError, ImportError):
    """An optional part a run needs is not installed: the message says what to pip install (one line, exit code
    2, as any `UsageError`; still an ImportError to code that catches one)."""


def missing_extra(what: str, module: str, extra: str) -> MissingExtra:
    """The error for `what`, which needs `module`, a dependency of leanrl's optional `extra`. The pip line works
    wherever leanrl is installed from (pip keeps the installed leanrl and adds the extra's packages)."""
    return MissingExtra(f"{what} needs {module}: pip install 'leanrl[{extra}]'")


def require_extra(what: str, module: str, extra: str):
    """Raise `missing_extra(...)` unless `module` is installed (found, not imported): a check to run before
    anything is built."""
    if importlib.util.find_spec(module) is None:
        raise missing_extra(what, module, extra)


def import_user_module(name: str):
    """Import `name`, a module of the user's (a GRPO task, a gymnasium env's registration), from the Python path or
    else the directory the run was launched from: a script's own directory, not that one, heads sys.path."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # after the rest: nothing there shadows an installed package
    return importlib.import_module(name)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as a KeyboardInterrupt so a killed run takes the same exit path as Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def raise_on_sigterm():
    """Turn SIGTERM into `Terminated`. Returns the previous handler, for the caller to restore."""
    def handler(signum, frame):
        raise Terminated(signum)
    return signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def signals_deferred():
    """Inside it, Ctrl-C and SIGTERM wait and are raised again on exit. For code that talks to a thread through a
    queue (TensorBoard's writer): an exception raised in the middle of a queue's put can lose its wake-up, and
    the close that follows then hangs (measured: 2 of 20 SIGTERMs at random times, before this). Main thread only,
    where Python runs signal handlers; elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


@contextlib.contextmanager
def clean_exit():
    """Around a script's main: Ctrl-C and SIGTERM end it with no traceback and the shell's exit codes (130, 143;
    the run has saved its checkpoint and printed its summary), and bad input (`UsageError`: a flag, a model directory,
    a checkpoint it cannot resume) with its one-line error (exit code 2). Library code raises; scripts end cleanly.
    The objects that exist on entry (the imported modules, torch's above all) live until the process ends, so they
    are frozen out of Python's cyclic garbage collector, whose full collections would walk them again and again for
    nothing; unfrozen on the way out, for a teardown that runs to free them (left frozen, bindings such as ale-py's
    report leaks).
    When the `with` is the top level of a script the interpreter runs (not under cProfile, coverage or runpy, which
    have work left after it), a run that completes ends the process there: what Python does at exit runs
    (non-daemon threads joined, atexit handlers, stdout and stderr flushed), then `os._exit(0)` skips the
    interpreter's teardown, which frees every module's objects one by one (a noticeable part of a short run; see
    docs/performance.md). CPython's multiprocessing ends its child processes the same way."""
    script = sys._getframe(2).f_back is None  # frames: this generator, contextlib's __enter__, the `with`
    gc.freeze()
    previous = raise_on_sigterm()
    try:
        yield
    except KeyboardInterrupt as e:
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        gc.unfreeze()
    if script:
        threading._shutdown()  # Python's exit, in its order
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
