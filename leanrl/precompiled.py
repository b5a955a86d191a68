"""One-graph compiled functions whose Dynamo trace a warm start loads instead of tracing again.

A warm inductor cache skips inductor's work, not Dynamo's: PPO CartPole's two compiled scans were traced again at
every start, seconds of Python in a short run (docs/performance.md). torch's AOT compile
(`torch.compile(fn).aot_compile`, torch >= 2.13, experimental) saves what Dynamo traced; loading it is quick.

A saved trace is used only when nothing it depended on changed, else the function is traced again and saved anew:
- the key: the function's name, torch's and Python's versions, the machine, the compile options, the spec of the
  first call's arguments (structure, shapes, strides, dtypes, devices), and torch's global state (grad mode,
  default dtype, deterministic algorithms);
- the source of every module the trace read code from, torch's aside (its version is in the key);
- every value the trace read outside its arguments: a hyperparameter in the closure, an env constant in a module,
  a parameter's shape, an object's type, the function a closure holds. These are Dynamo's own guards on them,
  taken out of the saved trace (torch cannot save most of them) and evaluated again against the live objects;
- per call, torch's guards on the arguments' tensors; a call they reject runs the function compiled the ordinary way.
The objects the closure holds (modules, envs, optimizers) are handed to the loaded trace by name: it reads this run's
parameters, never copies of the saved run's. TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 turns saving and loading off.
"""

import builtins
import contextlib
import glob
import hashlib
import importlib
import inspect
import os
import pickle
import platform
import re
import sys
import threading
import types

import torch
import torch.utils._pytree as pytree
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch._dynamo.utils import counters

from leanrl.cli import say_once

_ROOT_NAME = re.compile(r"[A-Za-z_]\w*")
_PRIMITIVE = (bool, int, float, str, type(None))
FORMAT = 2  # of the saved files: bumped when what they hold changes
# The guards torch keeps with a trace and checks at every call: on the arguments' tensors, and on which of them are one
# tensor (a trace made for two arguments that are one tensor computes wrongly for two that are not, and vice versa).
ARGUMENT_GUARDS = ("TENSOR_MATCH", "DUPLICATE_INPUT", "NO_TENSOR_ALIASING")


def available() -> bool:
    """Whether this torch saves and loads traces (2.13 does; 2.11's AOT compile is off by default) and caches are on."""
    return torch._dynamo.config.enable_aot_compile and not torch._inductor.config.force_disable_caches


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _tensor_spec(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride(), str(x.dtype), x.device.type, x.requires_grad


def _fingerprint(guard_type: str, value):
    """What a guard of `guard_type` checks of `value`, as plain data that compares across runs; None: not checked
    here (an object's identity or a dict's version mean nothing in another process)."""
    if guard_type == "TENSOR_MATCH":
        return _tensor_spec(value)
    if guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH"):
        return value if isinstance(value, _PRIMITIVE) else repr(value)
    if guard_type == "TYPE_MATCH":
        return _qualified(type(value))
    if guard_type in ("CLOSURE_MATCH", "FUNCTION_MATCH"):  # which function: its code is in the sources checked
        return _qualified(getattr(value, "__func__", value))
    if guard_type in ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"):
        return len(value)
    if guard_type == "DICT_KEYS_MATCH":
        return tuple(k if isinstance(k, _PRIMITIVE) else _qualified(k) for k in value)
    return None


class _Globals(dict):
    """A module's globals as Dynamo's guards name them, with the aliases it adds while tracing."""

    def __missing__(self, key):
        if key.startswith("__import_"):
            return importlib.import_module(key.removeprefix("__import_").replace("_dot_", "."))
        if key.startswith("__builtins_dict__"):
            return builtins.__dict__
        raise KeyError(key)


def _closure_objects(fn, prefix: str, out: dict, seen: set) -> dict:
    """Every object that `fn`'s closure holds, through nested functions and bound methods, by a path name."""
    if id(fn) in seen:
        return out
    seen.add(id(fn))
    if isinstance(fn, types.MethodType):
        out[f"{prefix}.__self__"] = fn.__self__
        return out
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value, path = cell.cell_contents, f"{prefix}.{name}"
        if isinstance(value, (types.FunctionType, types.MethodType)):
            _closure_objects(value, path, out, seen)
        elif not isinstance(value, _PRIMITIVE):  # plain values are saved with the trace, and checked by the guards
            out[path] = value
    return out


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _sources_match(sources: dict) -> bool:
    """Whether every module a saved trace read code from has the source it had."""
    try:
        return all(_hash(inspect.getsource(sys.modules.get(name) or importlib.import_module(name))) == digest
                   for name, digest in sources.items())
    except (ImportError, OSError, TypeError):  # a module that is gone, or has no source file
        return False


def _calling(callable_):
    def call(*args):
        return callable_(*args)

    call.__qualname__ = _qualified(getattr(callable_, "func", callable_))
    return call


class Precompiled:
    """`torch.compile(fn, fullgraph=True, ...)` whose trace is saved to, and loaded from, inductor's cache directory
    (see the module's docstring). `loaded`: whether the trace in use came from a file."""

    def __init__(self, fn, compile_kwargs: dict, name: str):
        if not isinstance(fn, types.FunctionType):  # a partial: traced through a function of its own, whose closure
            fn = _calling(fn)                       # holds it (the objects it binds are handed over by name)
        self.fn, self.compile_kwargs, self.name = fn, compile_kwargs, name
        # how a call's arguments bind to the names the guards read: each to its parameter, or all to `*args`
        params = list(inspect.signature(fn).parameters.values())
        self._var_positional = params[0].name if [p.kind for p in params] == [params[0].VAR_POSITIONAL] else None
        self._parameters = [p.name for p in params]
        if self._var_positional is None and any(p.kind != p.POSITIONAL_OR_KEYWORD or p.default is not p.empty
                                                for p in params):
            raise TypeError(f"{name}: a one-graph compiled function takes positional arguments without defaults, "
                            "or *args")
        self.compiled = None  # the AOT-compiled function, once the first call has loaded or traced it
        self.fallback = torch.compile(fn, **compile_kwargs)  # for calls the trace's guards reject; traces when called
        self.loaded = False
        self._prepared = False
        self._lock = threading.Lock()

    def __call__(self, *args):
        if not self._prepared:
            with self._lock:
                if not self._prepared:
                    self._prepare(args)
                    self._prepared = True
        if self.compiled is not None and self._guard_manager.check(self._f_locals(args)):
            return self.compiled(*args)
        return self.fallback(*args)

    def _f_locals(self, args) -> dict:
        """What the trace's guards read: the function's free variables and its arguments by name. torch's
        `guard_check` builds the same through inspect's binding, with ten times the Python calls."""
        f_locals = {name: cell.cell_contents for name, cell in self._cells}
        if self._var_positional is None:
            f_locals.update(zip(self._parameters, args))
        else:
            f_locals[self._var_positional] = args
        return f_locals

    def _prefix(self, args) -> str:
        """The saved traces' path up to the hash of what each one depends on; several may be kept (a sweep)."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        leaves, treespec = pytree.tree_flatten(args)
        specs = [_tensor_spec(x) if isinstance(x, torch.Tensor) else (type(x).__qualname__, x) for x in leaves]
        global_state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
                        torch.are_deterministic_algorithms_enabled())
        structure = re.sub(r" at 0x[0-9a-f]+", "", str(treespec))  # (a TensorDict's names its constructor's address)
        key = repr((FORMAT, _qualified(self.fn), self.name, torch.__version__, sys.version, platform.machine(),
                    self.compile_kwargs, structure, specs, global_state))
        return os.path.join(cache_dir(), "leanrl-precompiled", f"{self.name}-{_hash(key)}")

    def _guards_hold(self, saved: dict, args) -> bool:
        """Whether every value the saved trace read outside its arguments is as it was (evaluated from the names
        Dynamo's guards start at: the function's free variables, its arguments, its module's globals)."""
        f_locals = {name: cell.cell_contents for name, cell in zip(self.fn.__code__.co_freevars,
                                                                    self.fn.__closure__ or ())}
        f_locals.update(inspect.signature(self.fn).bind(*args).arguments)
        f_globals = {"G": _Globals(self.fn.__globals__), "__builtins__": builtins}
        try:
            return all(_fingerprint(kind, eval(name, f_globals, f_locals)) == value
                       for kind, name, value in saved["guards"])
        except Exception:  # a path that no longer resolves
            return False

    def _prepare(self, args):
        if not available():
            return
        prefix, objects = self._prefix(args), _closure_objects(self.fn, self.name, {}, set())
        for path in sorted(glob.glob(f"{glob.escape(prefix)}-*.bin"), key=os.path.getmtime, reverse=True):
            try:
                with open(path, "rb") as f:
                    saved = pickle.load(f)
            except (OSError, pickle.UnpicklingError, EOFError):  # another process's, removed meanwhile
                continue
            if not _sources_match(saved["sources"]):
                with contextlib.suppress(OSError):  # code that changed since: never valid again
                    os.remove(path)
            elif self._guards_hold(saved, args):
                try:
                    self.compiled = AOTCompiledFunction.deserialize(saved["trace"], self.fn.__globals__, objects)
                except Exception:  # noqa: BLE001 (torch's experimental format: a trace it cannot load is traced again)
                    with contextlib.suppress(OSError):
                        os.remove(path)
                    continue
                self.loaded = True
                counters["leanrl"]["traces_loaded"] += 1  # how benchmarks/worker.py tells a loaded trace from eager
                break
        else:
            try:
                self._trace_and_save(args, prefix, objects)
            except Exception as e:  # noqa: BLE001 (an error of the function itself is raised again by the fallback)
                say_once(f"leanrl: {self.name}: compiled without saving its trace ({type(e).__name__}: {e})")
                self.compiled = None
                return
        self.compiled.disable_guard_check()  # checked in __call__, which falls back rather than raising
        env = self.compiled._artifacts.runtime_env
        self._guard_manager = self.compiled._artifacts.guard_manager
        self._cells = list(zip(env.bytecode.co_freevars, env.closure or ()))

    def _trace_and_save(self, args, prefix: str, objects: dict):
        arguments = set(inspect.signature(self.fn).parameters)
        guards = set()

        def keep(entries):  # torch keeps ARGUMENT_GUARDS; the rest are checked at load
            kept = []
            for g in entries:
                root = _ROOT_NAME.match(g.name)
                on_argument = not g.is_global and root is not None and root.group() in arguments
                kept.append(g.guard_type in ARGUMENT_GUARDS and on_argument)
                if not kept[-1] and g.has_value and (value := _fingerprint(g.guard_type, g.value)) is not None:
                    guards.add((g.guard_type, g.name, value))
            return kept

        # Static: a trace Dynamo made dynamic (a float that differed from an earlier trace's in this process) names
        # globals it installed in this process only, and cannot be loaded by another.
        kwargs = {"dynamic": False, **self.compile_kwargs,
                  "options": {**self.compile_kwargs.get("options", {}), "guard_filter_fn": keep}}
        self.compiled = torch.compile(self.fn, **kwargs).aot_compile((args, {}))
        sources = {s.module: _hash(s.content)
                   for s in self.compiled.source_info().inlined_sources if s.module.split(".")[0] != "torch"}
        saved = dict(sources=sources, guards=sorted(guards, key=repr))
        if not (_sources_match(sources) and self._guards_hold(saved, args)):  # could never be loaded: not saved
            say_once(f"leanrl: {self.name}: its compiled trace cannot be checked when loaded; not saved")
            return
        saved["trace"] = AOTCompiledFunction.serialize(self.compiled, objects).serialized_data
        path = f"{prefix}-{_hash(repr((sources, saved['guards'])))}.bin"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}.{threading.get_ident()}", "wb") as f:
            pickle.dump(saved, f)
        os.replace(f.name, path)
        # From now on the trace as a later run loads it: the same Python around each call (a fresh one wraps one more
        # layer), and a trace that cannot be loaded is known now
        self.compiled = AOTCompiledFunction.deserialize(saved["trace"], self.fn.__globals__, objects)
