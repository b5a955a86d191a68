"""The LeanRL trick in one place: compile inside, CUDA graph outside, shapes guarded."""

import functools
import os
import sys

import torch
from tensordict import TensorDictBase
from tensordict.nn import CudaGraphModule

# Calls before the steady state: CudaGraphModule's warm-up calls before capture (the first one compiles), and the
# Logger's burn-in iterations before its SPS clock starts. Read everywhere from here.
WARMUP = 2

_said: set[str] = set()  # messages printed once per process


def accelerate(fn, *, compile: bool = False, cudagraphs: bool = False, device="cpu", warmup: int = WARMUP,
               compile_kwargs: dict | None = None, name: str | None = None):
    """Return `fn` compiled and/or captured in a CUDA graph; the only place the repo does either.

    `compile` uses torch.compile's default mode, so the four modes (eager, compile, cudagraphs, both)
    measure four distinct things; `compile_kwargs` are more of its keywords, for a function that needs its own.
    `cudagraphs` needs fixed shapes: every later call must pass tensors of the shape, dtype and device of
    the first call, or a `ShapeChangeError` is raised (even on CPU, where no graph is captured, so a run
    behaves the same on every machine).
    """
    name = name or getattr(fn, "__name__", "fn")
    if compile:
        fn = torch.compile(fn, **(compile_kwargs or {}))
    if not cudagraphs:
        return fn
    if torch.device(device).type == "cuda":
        fn = CudaGraphModule(fn, warmup=warmup, device=torch.device(device))
    else:
        # CudaGraphModule would still clone every input on CPU: not wrapping is both faster and honest.
        _say_once("leanrl: --cudagraphs needs a CUDA device; running without CUDA graphs.")
    return ShapeGuard(fn, name)


def make_adam(params, lr: float, *, compile: bool, cudagraphs: bool, device, **kwargs) -> torch.optim.Adam:
    """Adam with a tensor learning rate, so an annealed or restored rate reaches a captured graph (it is changed
    in place). Eager runs the fused kernel (about 3x the default on CPU); compile generates its own; graphs
    without compile need `capturable`."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), capturable=cudagraphs and not compile,
                            fused=not compile, **kwargs)


def wrap_flags(args, device, eager_on_cpu: str | None = None) -> dict:
    """The acceleration keywords of `accelerate` and `make_adam`, from a run's `--compile` / `--cudagraphs`.

    `eager_on_cpu`: what of the algorithm compiling does not pay for on a CPU, and why (a measurement). There
    `--compile` keeps it eager (with fused Adam) and says so once: `--compile` is never a slowdown.
    LEANRL_COMPILE_ON_CPU=1 compiles it anyway (to measure it again, and in tests)."""
    compile, on_cpu = args.compile, torch.device(device).type == "cpu"
    if compile and eager_on_cpu and on_cpu and os.environ.get("LEANRL_COMPILE_ON_CPU") != "1":
        _say_once(f"leanrl: --compile keeps {eager_on_cpu} eager on CPU (LEANRL_COMPILE_ON_CPU=1 compiles anyway).")
        compile = False
    return dict(compile=compile, cudagraphs=args.cudagraphs, device=device)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore an optimizer made by `make_adam` in place (before any capture), keeping its tensor learning rate
    object (a captured graph reads its address) and copying the saved rate into it."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr.copy_(group["lr"])


def _say_once(message: str):
    if message not in _said:
        print(message, file=sys.stderr)
        _said.add(message)


class ShapeChangeError(ValueError):
    """An input to a captured function changed shape, dtype or device."""


def _spec(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device)
    if isinstance(x, TensorDictBase):
        return tuple(sorted(((k if isinstance(k, str) else ".".join(k)), _spec(v))
                            for k, v in x.items(include_nested=True, leaves_only=True)))
    return None  # non-tensor arguments are baked into the graph; CudaGraphModule documents this


class ShapeGuard:
    """Fix the input signature at the first call. CudaGraphModule silently broadcasts a smaller
    input into the captured buffers (wrong results, no error); this raises instead."""

    def __init__(self, fn, name):
        self.fn, self.name, self.specs = fn, name, None
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        specs = [(n, _spec(a)) for n, a in named]
        if self.specs is None:
            self.specs = specs
        elif specs != self.specs:
            self._raise(specs)
        return self.fn(*args, **kwargs)

    def _raise(self, specs):
        for (name, got), (_, want) in zip(specs, self.specs):
            if got != want:
                raise ShapeChangeError(
                    f"{self.name}: {name} changed after capture: captured {_fmt(want)}, got {_fmt(got)}. "
                    "A CUDA-graphed function needs inputs of fixed shape, dtype and device.")
        raise ShapeChangeError(f"{self.name}: called with {len(specs)} arguments, captured with {len(self.specs)}.")


def _fmt(spec):
    if spec and isinstance(spec[0], tuple) and isinstance(spec[0][0], str):  # TensorDict
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in spec) + "}"
    if spec is None:
        return "a non-tensor"
    shape, dtype, device = spec
    return f"shape {list(shape)} {str(dtype).removeprefix('torch.')} on {device}"
