"""What the benchmark measures: one entry per algorithm run, built exactly as its script builds it.

An entry names a script in `scripts/` (its `Args` defaults are the sizes measured), the algorithm class
(which provides `benchmark_calls()`, `train_iteration(logger)`, `reset(seed)` and `global_step`), the
`Args` fields the script passes on to `make_env`, and tiny sizes for `--quick`. Adding an algorithm is
one line here.
"""

import importlib
import importlib.util
import os
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> (compile, cudagraphs), the flags every script takes
MODES = {"eager": (False, False), "compile": (True, False), "cudagraphs": (False, True),
         "compile+cudagraphs": (True, True)}


@dataclass(frozen=True)
class Entry:
    script: str
    """file in scripts/ whose `Args` defaults are benchmarked"""
    algo: str
    """"module:Class" of the algorithm"""
    env_kwargs: tuple = ()
    """`Args` fields the script passes to `make_env` besides env_id, num_envs, device and seed"""
    quick: dict = field(default_factory=dict)
    """`Args` overrides for --quick (CI smoke: tiny sizes, same code paths)"""


@dataclass(frozen=True)
class Scaling:
    """Env-steps/s against the number of parallel envs, for an on-device env."""
    entry: str
    sizes: tuple
    """num_envs on CPU"""
    sizes_gpu: tuple
    sizes_quick: tuple
    overrides: dict = field(default_factory=dict)
    """`Args` overrides: the hook for the all-on-device iteration once PPO has it"""


ENTRIES = {
    "ppo_atari": Entry("ppo_atari.py", "algorithms.ppo:PPO", ("sticky_actions",), dict(num_envs=2, num_steps=16)),
    "ppo_continuous": Entry("ppo_continuous.py", "algorithms.ppo:PPO", ("gamma",),
                            dict(num_steps=64, num_minibatches=2, update_epochs=2)),
    "ppo_cartpole": Entry("ppo_cartpole.py", "algorithms.ppo:PPO", (), dict(num_steps=16, update_epochs=2)),
}

SCALING = {
    "cartpole_scaling": Scaling("ppo_cartpole", sizes=(8, 64, 512, 4096), sizes_gpu=(64, 1024, 16384, 131072),
                                sizes_quick=(4, 32), overrides=dict(env_id="torch/CartPole-v1")),
}


def missing(name: str) -> str | None:
    """Why an entry cannot run in this checkout (its script or algorithm not written yet), else None."""
    entry = ENTRIES[SCALING[name].entry] if name in SCALING else ENTRIES[name]
    if not os.path.isfile(os.path.join(ROOT, "scripts", entry.script)):
        return f"scripts/{entry.script} not found"
    if importlib.util.find_spec(entry.algo.split(":")[0]) is None:
        return f"{entry.algo.split(':')[0]} not found"
    return None


def load_args_class(script: str):
    """The script's `Args` dataclass; `scripts/` is not a package, so load the file by path."""
    path = os.path.join(ROOT, "scripts", script)
    spec = importlib.util.spec_from_file_location(f"_benchmarked_{script.removesuffix('.py')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its `if __name__ == "__main__"` block does not run
    return module.Args


def build(name: str, mode: str, device, quick: bool, **overrides):
    """(algorithm, envs, args) as the script builds them, in `mode`, seeded, reset."""
    import leanrl
    from envs import make_env

    entry = ENTRIES[name]
    compile, cudagraphs = MODES[mode]
    sizes = {**(entry.quick if quick else {}), **overrides}
    args = load_args_class(entry.script)(compile=compile, cudagraphs=cudagraphs, device=str(device),
                                         progress=False, **sizes)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed,
                    **{k: getattr(args, k) for k in entry.env_kwargs})
    module, cls = entry.algo.split(":")
    algo = getattr(importlib.import_module(module), cls)(args, envs, device)
    algo.reset(args.seed)
    return algo, envs, args
