"""The LeanRL trick in one place: compile inside, CUDA graph outside, shapes guarded. `Acceleration` is a run's
--compile and --cudagraphs on its device, the one object an algorithm's loop asks how to run each of its phases."""

import dataclasses
import functools
import os

import torch
from tensordict import TensorDictBase
from tensordict.nn import CudaGraphModule

from leanrl import torch_fixes
from leanrl.cli import say_once
from leanrl.graph_threads import GraphedAmongThreads
from leanrl.precompiled import Precompiled

# Calls before the steady state: CudaGraphModule's warm-up calls before capture (the first one compiles), and the
# Logger's burn-in iterations before its SPS clock starts. Read everywhere from here.
WARMUP = 2


# `compile_kwargs` of a function a CPU compiles whole (an off-policy learner's step): one graph (`fullgraph`), its
# kernels called from inductor's C++ wrapper, with no Python between them (torch 2.13's, which the tests run it on).
ONE_GRAPH = dict(fullgraph=True, **(dict(options=dict(cpp_wrapper=True)) if torch_fixes.TORCH >= "2.13" else {}))

def accelerate(fn, *, compile: bool = False, cudagraphs: bool = False, device="cpu", warmup: int = WARMUP,
               compile_kwargs: dict | None = None, name: str | None = None):
    """Return `fn` compiled and/or captured in a CUDA graph; the only place the repo does either.

    `compile` uses torch.compile's default mode, so the four modes (eager, compile, cudagraphs, both)
    measure four distinct things; `compile_kwargs` are more of its keywords, for a function that needs its own.
    On a CPU a one-graph compile (`fullgraph=True`) saves its trace for the next run to load (`leanrl.precompiled`).
    `cudagraphs` needs fixed shapes: every later call must pass tensors of the shape, dtype and device of
    the first call, or a `ShapeChangeError` is raised (even on CPU, where no graph is captured, so a run
    behaves the same on every machine).
    """
    name = name or getattr(fn, "__name__", "fn")
    device = torch.device(device)
    if compile:
        torch_fixes.raise_recompile_limit()
        if device.type == "cpu":
            torch_fixes.trust_vec_isa_probed_before()
        compile_kwargs = compile_kwargs or {}
        if device.type == "cpu" and compile_kwargs.get("fullgraph"):
            fn = Precompiled(fn, compile_kwargs, name)
        else:
            fn = torch.compile(fn, **compile_kwargs)
        if device.type == "cuda":
            fn = torch_fixes.compiles_in_any_thread(fn)
    if not cudagraphs:
        return fn
    if device.type == "cuda":
        fn = GraphedAmongThreads(CudaGraphModule(fn, warmup=warmup, device=device), warmup)
    else:
        # CudaGraphModule would still clone every input on CPU: not wrapping is both faster and honest.
        say_once("leanrl: --cudagraphs needs a CUDA device; running without CUDA graphs.")
    return ShapeGuard(fn, name)


@dataclasses.dataclass(frozen=True)
class Acceleration:
    """How a run computes: `accel(fn, name=...)` is `accelerate(fn, ...)` with the run's flags; `flags` the keywords
    of `make_adam`. `cpu_compile`: compiling on a CPU, where no CUDA graph removes what each call costs (Dynamo's
    guards, Python), so there an algorithm makes fewer, larger compiled calls."""

    compile: bool = False
    cudagraphs: bool = False
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, args, device) -> "Acceleration":
        """From a run's `--compile` and `--cudagraphs`."""
        return cls(args.compile, args.cudagraphs, torch.device(device))

    @property
    def flags(self) -> dict:
        return dict(compile=self.compile, cudagraphs=self.cudagraphs, device=self.device)

    @property
    def cpu_compile(self) -> bool:
        return self.compile and self.device.type == "cpu"

    def __call__(self, fn, name: str | None = None, **kwargs):
        return accelerate(fn, **{**self.flags, "name": name, **kwargs})

    def replace(self, **changes) -> "Acceleration":
        return dataclasses.replace(self, **changes)

    def eager_on_cpu(self, what: str, why: str) -> "Acceleration":
        """This acceleration, but with `what` kept eager on a CPU under --compile because `why` (compiling it does
        not pay there), said once; --compile is never a slowdown. LEANRL_COMPILE_ON_CPU=1 compiles it anyway (to
        measure it again, and in tests)."""
        if not self.cpu_compile or os.environ.get("LEANRL_COMPILE_ON_CPU") == "1":
            return self
        say_once(f"leanrl: on a CPU, --compile keeps {what} eager: {why} (LEANRL_COMPILE_ON_CPU=1 compiles it "
                 "anyway).")
        return self.replace(compile=False)


class ShapeChangeError(ValueError):
    """An input to a captured function changed shape, dtype or device."""


def _spec(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device)
    if isinstance(x, TensorDictBase):
        return tuple(sorted(((k if isinstance(k, str) else ".".join(k)), _spec(v))
                            for k, v in x.items(include_nested=True, leaves_only=True)))
    return None  # non-tensor arguments are baked into the graph; CudaGraphModule documents this


def _named_specs(name: str, x) -> list:
    """(name, spec) of `x`, and of each value in it by its path where it is a dict, tuple or list."""
    if isinstance(x, dict):
        return [spec for k, v in x.items() for spec in _named_specs(f"{name}[{k!r}]", v)]
    if isinstance(x, (tuple, list)):
        return [spec for i, v in enumerate(x) for spec in _named_specs(f"{name}[{i}]", v)]
    return [(name, _spec(x))]


class ShapeGuard:
    """Fix the input signature at the first call. CudaGraphModule silently broadcasts a smaller
    input into the captured buffers (wrong results, no error); this raises instead."""

    def __init__(self, fn, name):
        self.fn, self.name, self.specs = fn, name, None
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        specs = [spec for n, a in named for spec in _named_specs(n, a)]
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
