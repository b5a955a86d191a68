"""The LeanRL trick in one place: compile inside, CUDA graph outside, shapes guarded."""

import collections
import functools
import os
import threading

import torch
from tensordict import TensorDictBase
from tensordict.nn import CudaGraphModule
from torch.optim.adam import adam  # the functional Adam: a scan's body traces it (torch.optim.adam.adam does not)

from leanrl.cli import say_once
from leanrl.precompiled import Precompiled

# Calls before the steady state: CudaGraphModule's warm-up calls before capture (the first one compiles), and the
# Logger's burn-in iterations before its SPS clock starts. Read everywhere from here.
WARMUP = 2


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
    if compile:
        _raise_recompile_limit()
        if torch.device(device).type == "cpu":
            _trust_vec_isa_probed_before()
        compile_kwargs = compile_kwargs or {}
        if torch.device(device).type == "cpu" and compile_kwargs.get("fullgraph"):
            fn = Precompiled(fn, compile_kwargs, name)
        else:
            fn = torch.compile(fn, **compile_kwargs)
        if torch.device(device).type == "cuda":
            fn = _compiles_in_any_thread(fn)
    if not cudagraphs:
        return fn
    if torch.device(device).type == "cuda":
        fn = _GraphedAmongThreads(CudaGraphModule(fn, warmup=warmup, device=torch.device(device)), warmup)
    else:
        # CudaGraphModule would still clone every input on CPU: not wrapping is both faster and honest.
        say_once("leanrl: --cudagraphs needs a CUDA device; running without CUDA graphs.")
    return ShapeGuard(fn, name)


# Dynamo keeps one compiled entry per object a shared piece of code is called with: torch's Adam.step, once per
# optimizer. Past its default limit of 8 it runs that code eagerly from then on, silently; under a CUDA graph an
# eager Adam step (not `capturable`) fails the capture. Two optimizers an agent, TD3's fifth agent in a process (a
# sweep, a notebook cell run again, the benchmark's modes) met it; the same on an H100: "Attempting CUDA graph
# capture of step() for an instance of Adam but param_groups' capturable is False".
RECOMPILE_LIMIT = 64


def _raise_recompile_limit():
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def sync_cuda(device=None):
    """Wait for this thread's CUDA stream (on `device`, when given: a CPU one has nothing to wait for): what it wrote
    is complete before another thread or role reads it, or a clock reads the time. Never the whole device: that is an
    error while another thread captures a CUDA graph."""
    on_cuda = device is None or torch.device(device).type == "cuda"
    if on_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream(device).synchronize()


def _compiles_in_any_thread(compiled):
    """torch 2.11 sets up the thread-local registry of inductor's CUDA graph trees only in the thread that imported
    them, and dynamo reads it when it compiles an optimizer step on CUDA: a first call from any other thread (a
    trainer or collector thread, the benchmark's turns) failed on an H200 with a bare AssertionError in
    `cudagraph_trees.get_obj`. Set it up in the calling thread first, as torch 2.13 does itself."""
    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees, "_initialize_tls"):  # torch >= 2.13
        return compiled

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        if not hasattr(trees.local, "tree_manager_containers"):
            trees.local.tree_manager_containers = {}
            trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)
        return compiled(*args, **kwargs)
    return call


class _ThreadLocalCapture(torch.cuda.graph):
    """`torch.cuda.graph` capturing in CUDA's thread-local mode, as inductor's own CUDA graphs do."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="thread_local", **kwargs):
        super().__init__(cuda_graph, pool, stream, capture_error_mode, **kwargs)


class _CaptureLock:
    """Shared by the calls of CUDA-graphed functions, held alone by a capture. While a stream captures, CUDA forbids
    in every thread, whatever the capture mode, what would wait on that stream: a device-wide synchronize, which
    CudaGraphModule does before every replay, and a compile's autotuning in a warm-up call. An H200 lease's async
    GRPO failed so: a collector replayed its cache copy while the other captured. Calls in several threads run
    together; a capture waits for the calls in flight, and calls that come meanwhile wait for it (else two threads
    replaying in turn could keep it out for ever). A thread inside already passes, not to wait for itself (no
    graphed function here calls another; a capture inside a capture is torch's error to raise)."""

    def __init__(self):
        self._changed = threading.Condition(threading.Lock())
        self._calls = 0  # calls running
        self._captures = 0  # captures running or waiting
        self._capturing = False
        self._held = threading.local()

    def acquire(self, capture: bool) -> bool:
        """Whether this took the lock (False when the thread holds it already)."""
        if getattr(self._held, "yes", False):
            return False
        with self._changed:
            if capture:
                self._captures += 1
                self._changed.wait_for(lambda: not self._calls and not self._capturing)
                self._capturing = True
            else:
                if self._captures:
                    self._changed.wait_for(lambda: not self._captures)
                self._calls += 1
        self._held.yes = True
        return True

    def release(self, capture: bool):
        self._held.yes = False
        with self._changed:
            if capture:
                self._captures -= 1
                self._capturing = False
                self._changed.notify_all()
            else:
                self._calls -= 1
                if self._captures and not self._calls:
                    self._changed.notify_all()


_graph_lock = _CaptureLock()


class _GraphedAmongThreads:
    """A CudaGraphModule whose calls take `_graph_lock`, and whose capture (its `warmup`-th call) also takes CUDA's
    thread-local capture mode. CudaGraphModule captures in torch's default, global mode, in which a cudaMalloc in
    any other thread is an error: on an H100, async GRPO's second collector thread, warming up while the first
    captured, failed with "operation not permitted when stream is capturing". Thread-local mode lets other threads
    allocate (the allocator keeps their memory out of the graph's pool)."""

    def __init__(self, graphed: CudaGraphModule, warmup: int):
        self.graphed, self.warmup_calls_left, self.captured = graphed, warmup - 1, False

    def __call__(self, *args, **kwargs):
        capture = not (self.captured or self.warmup_calls_left)
        self.warmup_calls_left -= bool(self.warmup_calls_left)
        took = _graph_lock.acquire(capture)
        try:
            if not capture:
                return self.graphed(*args, **kwargs)
            graph, torch.cuda.graph = torch.cuda.graph, _ThreadLocalCapture  # where CudaGraphModule looks
            try:
                out = self.graphed(*args, **kwargs)
            finally:
                torch.cuda.graph = graph
            self.captured = True
            return out
        finally:
            if took:
                _graph_lock.release(capture)


@functools.cache
def _trust_vec_isa_probed_before():
    """Inductor checks at every start that C++ for each vector ISA the CPU claims (AVX2, AVX-512, AMX) builds and
    loads, dlopening a test library in a new Python per ISA: about 1 s of every compiled run's start-up on a 2-core
    CPU, for an answer that belongs to the machine and the torch build. The first run in an inductor cache does the
    check and records it there when every claimed ISA passed; later runs trust it (cpp.vec_isa_ok, as
    TORCHINDUCTOR_VEC_ISA_OK=1 would, which still decides when set). Every run then compiles with the same setting,
    so inductor's cache keys, which include it, stay the same."""
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if config.cpp.vec_isa_ok is not None:
        return
    with config.patch({"cpp.vec_isa_ok": True}):
        claimed = "\n".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__())
    record = os.path.join(cache_dir(), f"leanrl-vec-isa-ok-{torch.__version__}")
    try:
        with open(record) as f:
            recorded = f.read()
    except FileNotFoundError:
        recorded = None
    if recorded != claimed:
        if "\n".join(str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()) != claimed:  # the check, as inductor's
            return
        os.makedirs(cache_dir(), exist_ok=True)
        with open(f"{record}.{os.getpid()}", "w") as f:
            f.write(claimed)
        os.replace(f"{record}.{os.getpid()}", record)
    config.cpp.vec_isa_ok = True


def make_adam(params, lr: float, *, compile: bool, cudagraphs: bool, device, **kwargs) -> torch.optim.Adam:
    """Adam with a tensor learning rate, so an annealed or restored rate reaches a captured graph (it is changed
    in place). Eager runs the fused kernel (about 3x the default on CPU); compile generates its own; graphs
    without compile need `capturable`."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), capturable=cudagraphs and not compile,
                            fused=not compile, **kwargs)


class ScannableAdam:
    """An Adam made by `make_adam` over `params` (its parameters by name), stepped as a pure function inside one
    compiled graph or a compiled scan over updates (a scan's body may not write to what it closes over). The carry
    is (parameters, exp_avg, exp_avg_sq, step), dicts by parameter name: `carry()` reads them, `step(carry, grads,
    lr)` returns the next with torch's own Adam applied to copies, and `load(carry)` writes the last one back in
    place, so the module, checkpoints and an eager step afterwards see one optimizer."""

    def __init__(self, params: dict, optimizer: torch.optim.Adam):
        (group,) = optimizer.param_groups
        self.params, self.optimizer = params, optimizer
        self.hyper = dict(amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                          weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        if group["amsgrad"]:
            raise ValueError("ScannableAdam: amsgrad is not supported")

    def carry(self) -> tuple:
        state = self.optimizer.state  # read at every call: loading a checkpoint replaces it
        for p in self.params.values():
            if not state[p]:  # torch's Adam makes its state at its first step
                state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state = {name: state[p] for name, p in self.params.items()}
        return ({name: p.detach() for name, p in self.params.items()}, {n: s["exp_avg"] for n, s in state.items()},
                {n: s["exp_avg_sq"] for n, s in state.items()}, next(iter(state.values()))["step"])

    def step(self, carry: tuple, grads: dict, lr: torch.Tensor) -> tuple:
        params, exp_avgs, exp_avg_sqs = ({n: x.clone() for n, x in d.items()} for d in carry[:3])
        steps = [carry[3].clone() for _ in params]
        adam(list(params.values()), [grads[n] for n in params], list(exp_avgs.values()), list(exp_avg_sqs.values()),
             [], steps, foreach=False, capturable=torch.compiler.is_compiling(), lr=lr, **self.hyper)
        return params, exp_avgs, exp_avg_sqs, steps[0]

    @torch.no_grad()
    def load(self, carry: tuple) -> None:
        params, exp_avgs, exp_avg_sqs, step = carry
        for name, p in self.params.items():
            p.copy_(params[name])
            for key, value in (("exp_avg", exp_avgs[name]), ("exp_avg_sq", exp_avg_sqs[name]), ("step", step)):
                self.optimizer.state[p][key].copy_(value)


def gradient_step(loss, params: dict, optimizer: torch.optim.Adam, *, one_graph: bool = False,
                  name: str = "gradient_step"):
    """`step(*inputs)`: one optimizer step on `loss(params, *inputs) -> (loss, aux)`, where `params` are the
    optimizer's parameters by name; returns `aux`.

    Plain (backward, then the optimizer's step), for `accelerate` to compile and graph; or, `one_graph`, compiled
    here as ONE graph, for a CPU under --compile: torch.func.grad of `loss` and torch's Adam on the parameters as
    values (`ScannableAdam`), written back after the call. The plain step compiled is three graphs (backward and
    the optimizer step break it), each paying guards and Python, which no CUDA graph removes on a CPU. TD3 at batch
    256, one graph against eager, cpu-2core-intel-xeon: critic 2.3-2.5 vs 3.4-3.5 ms, actor 1.45 vs 1.93-1.98 ms."""
    if not one_graph:
        def step(*inputs):
            value, aux = loss(params, *inputs)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            return aux

        return step

    adam = ScannableAdam(params, optimizer)

    def functional_step(carry, lr, *inputs):
        grads, aux = torch.func.grad(loss, has_aux=True)(carry[0], *inputs)
        return adam.step(carry, grads, lr), aux

    compiled = accelerate(functional_step, compile=True, compile_kwargs=dict(fullgraph=True), name=name)

    def one_graph_step(*inputs):
        carry, aux = compiled(adam.carry(), optimizer.param_groups[0]["lr"], *inputs)
        adam.load(carry)
        return aux

    return one_graph_step


def wrap_flags(args, device, eager_on_cpu: str | None = None) -> dict:
    """The acceleration keywords of `accelerate` and `make_adam`, from a run's `--compile` / `--cudagraphs`.

    `eager_on_cpu`: what of the algorithm compiling does not pay for on a CPU, and why (a measurement). There
    `--compile` keeps it eager (with fused Adam) and says so once: `--compile` is never a slowdown.
    LEANRL_COMPILE_ON_CPU=1 compiles it anyway (to measure it again, and in tests)."""
    compile, on_cpu = args.compile, torch.device(device).type == "cpu"
    if compile and eager_on_cpu and on_cpu and os.environ.get("LEANRL_COMPILE_ON_CPU") != "1":
        say_once(f"leanrl: on a CPU, --compile keeps eager {eager_on_cpu} "
                  "(LEANRL_COMPILE_ON_CPU=1 compiles it anyway).")
        compile = False
    return dict(compile=compile, cudagraphs=args.cudagraphs, device=device)


def compiling_on_cpu(wrap: dict) -> bool:
    """Whether `wrap` (from `wrap_flags`) compiles on a CPU, where no CUDA graph removes the per-call costs: there the
    algorithms make fewer, larger compiled calls (PPO's scans, `gradient_step(one_graph=True)`)."""
    return wrap["compile"] and torch.device(wrap["device"]).type == "cpu"


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore an optimizer made by `make_adam` in place (before any capture), keeping its tensor learning rate
    object (a captured graph reads its address) and copying the saved rate into it."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr.copy_(group["lr"])


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
