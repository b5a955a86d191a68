"""Workarounds for torch and tensordict, each with the version it was needed on and what makes it removable. The rest
of the toolbox calls these; nothing else in the repository works around them."""

import collections
import functools
import os
import threading

import tensordict
import torch
import torch.nn as nn
from torch.torch_version import TorchVersion

TORCH = TorchVersion(torch.__version__)

# tensordict (0.14.3) restores its lazy-legacy setting on leaving `set_lazy_legacy(...)` (from_modules, which TD3's
# and SAC's twin critics are built with, enters one) by writing str(None) into the environment variable it reads at
# import: every process started afterwards (a script, a collector) fails its first TensorDict stack on "None".
# Setting it once to its default (as torchrl does on import) keeps the variable a valid value. Removable when
# tensordict restores an unset variable as unset.
tensordict.set_lazy_legacy(False).set()

# Dynamo (every torch so far, 2.11-2.13) keeps one compiled entry per object a shared piece of code is called with:
# torch's Adam.step, once per optimizer. Past its default limit of 8 it runs that code eagerly from then on,
# silently, and under a CUDA graph an eager Adam step (not `capturable`) fails the capture: two optimizers an agent
# and a fifth agent in one process (a sweep, a notebook cell run again, the benchmark's modes) met it.
# Removable when Dynamo shares one entry among objects of one class.
RECOMPILE_LIMIT = 64


def raise_recompile_limit():
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


@functools.cache
def trust_vec_isa_probed_before():
    """Inductor (2.11-2.13) checks at every start that C++ for each vector ISA the CPU claims (AVX2, AVX-512, AMX)
    builds and loads, dlopening a test library in a new Python per ISA: a second or so of every compiled run's
    start-up on a small CPU, for an answer that belongs to the machine and the torch build. The first run in an
    inductor cache does the check and records it there when every claimed ISA passed; later runs trust it
    (cpp.vec_isa_ok, as TORCHINDUCTOR_VEC_ISA_OK=1 would, which still decides when set). Every run then compiles
    with the same setting, so inductor's cache keys, which include it, stay the same. Removable when inductor
    caches its probe itself."""
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


def compiles_in_any_thread(compiled):
    """torch 2.11 sets up the thread-local registry of inductor's CUDA graph trees only in the thread that imported
    them, and Dynamo reads it when it compiles an optimizer step on CUDA: a first call from any other thread (a
    trainer or collector thread, the benchmark's turns) failed on a GPU with a bare AssertionError in
    `cudagraph_trees.get_obj`. Set it up in the calling thread first, as torch 2.13 does itself. Removable with
    torch >= 2.13."""
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


def scan_compile_kwargs() -> dict:
    """torch.compile's keywords for a function that calls torch's scan operator (torch 2.13's):
    - fullgraph=True: without it, inductor's lowering of the scan to a loop fails on reading the loop index;
    - the scan marked cacheable: inductor's cache skips higher-order ops unless told, and every run then compiled
      the scan again (seconds of a warm start-up); the key still holds the scanned body's code. Removable when
      inductor caches higher-order ops;
    - `cpp_wrapper` (the loop in inductor's C++ wrapper, not its Python one): only from torch 2.13, whose C++ wrapper
      can emit the scan's loop (2.11's fails in codegen_while_loop)."""
    options = dict(unsafe_marked_cacheable_functions={"torch.ops.higher_order.scan": torch.__version__})
    if TORCH >= "2.13":
        options["cpp_wrapper"] = True
    return dict(fullgraph=True, options=options)


def clip_grad_norm(grads: dict, max_norm: float) -> tuple[dict, torch.Tensor]:
    """`nn.utils.clip_grad_norm_`'s math on gradients as values (torch.func's): the clipped gradients and their
    norm before clipping. Its in-place scaling of them is lost inside a compiled scan (torch 2.13; the scanned
    update's test against eager catches it). Removable when that scaling survives the scan."""
    norm = nn.utils.get_total_norm(grads.values())
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return {name: g * scale for name, g in grads.items()}, norm
