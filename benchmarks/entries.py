"""What the benchmark measures: one entry per algorithm run, built exactly as its script builds it.

An entry names a script in `scripts/` (its `Args` defaults are the sizes measured), the algorithm class
(which provides `benchmark_calls()`, `train_iteration(logger)`, `reset(seed)`, `iteration` and
`global_step`), how the script builds its envs, the few `Args` the benchmark changes, and tiny sizes for
`--quick`. Adding an algorithm is one entry here.
"""

import functools
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
    env_args: tuple = ()
    """`Args` fields the script passes to `make_env` besides env_id, num_envs, device and seed"""
    env_fn: str | None = None
    """the script's own env factory `fn(env_id, num_envs, device, seed)`, when it has one"""
    overrides: dict = field(default_factory=dict)
    """`Args` overrides in every benchmark run (say why next to each)"""
    quick: dict = field(default_factory=dict)
    """`Args` overrides for --quick (CI smoke: tiny sizes, same code paths)"""


@dataclass(frozen=True)
class Scaling:
    """End-to-end env-steps/s against the number of parallel envs, with an entry's script."""
    entry: str
    sizes: tuple
    """num_envs on CPU"""
    sizes_gpu: tuple
    sizes_quick: tuple
    overrides: dict = field(default_factory=dict)
    """`Args` overrides; where a variant of the iteration (e.g. one graph per iteration) is switched on"""


# Cheapest first: a run cut short by a time limit keeps the most entries (results are saved after each).
# Off-policy entries start learning as soon as a batch is in the buffer (CleanRL waits 5k to 80k random
# steps), so that the iterations measured after burn-in are learning iterations.
ENTRIES = {
    "ppo_cartpole": Entry("ppo_cartpole.py", "leanrl.algorithms.ppo:PPO", quick=dict(num_steps=16, update_epochs=2)),
    "dqn_cartpole": Entry("dqn_cartpole.py", "leanrl.algorithms.dqn:DQN", overrides=dict(learning_starts=128),
                          quick=dict(batch_size=32, learning_starts=32)),
    "td3_continuous": Entry("td3_continuous.py", "leanrl.algorithms.td3:TD3", env_fn="make",
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "sac_continuous": Entry("sac_continuous.py", "leanrl.algorithms.sac:SAC", env_fn="make",
                            overrides=dict(learning_starts=256), quick=dict(batch_size=32, learning_starts=32)),
    "ppo_atari": Entry("ppo_atari.py", "leanrl.algorithms.ppo:PPO", env_args=("sticky_actions",),
                       quick=dict(num_envs=2, num_steps=16)),
    # 1e6 stacked Atari frames are 35 GB: a smaller buffer changes the memory, not the time of a step.
    "dqn_atari": Entry("dqn_atari.py", "leanrl.algorithms.dqn:DQN", env_args=("sticky_actions",),
                       overrides=dict(learning_starts=32, buffer_size=50_000), quick=dict(buffer_size=1_000)),
    # Its compile is the longest: `gae` unrolls a 2048-step loop.
    "ppo_continuous": Entry("ppo_continuous.py", "leanrl.algorithms.ppo:PPO", env_args=("gamma",),
                            quick=dict(num_steps=64, num_minibatches=2, update_epochs=2)),
}

SCALING = {
    # The step-by-step PPO iteration for now. total_timesteps: at least one batch at every size (it only
    # sets the learning-rate annealing).
    "cartpole_scaling": Scaling("ppo_cartpole", sizes=(16, 256, 4096), sizes_gpu=(256, 4096, 32768, 262144),
                                sizes_quick=(4, 32),
                                overrides=dict(env_id="torch/CartPole-v1", total_timesteps=10**10)),
}


def missing(name: str) -> str | None:
    """Why an entry cannot run in this checkout (its script or algorithm not written yet), else None."""
    entry = ENTRIES[SCALING[name].entry] if name in SCALING else ENTRIES[name]
    if not os.path.isfile(os.path.join(ROOT, "scripts", entry.script)):
        return f"scripts/{entry.script} not found"
    if importlib.util.find_spec(entry.algo.split(":")[0]) is None:
        return f"{entry.algo.split(':')[0]} not found"
    return None


@functools.cache
def load_script(script: str):
    """The script as a module (its `Args`, maybe an env factory); `scripts/` is not a package, so by path."""
    path = os.path.join(ROOT, "scripts", script)
    spec = importlib.util.spec_from_file_location(f"_benchmarked_{script.removesuffix('.py')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its `if __name__ == "__main__"` block does not run
    return module


def make_args(name: str, quick: bool, **overrides):
    """The script's `Args` with the entry's overrides (and --quick sizes), then the caller's."""
    entry = ENTRIES[name]
    return load_script(entry.script).Args(**{**entry.overrides, **(entry.quick if quick else {}), **overrides})


def build(name: str, mode: str, device, quick: bool, **overrides):
    """(algorithm, envs, args) as the script builds them, in `mode`, seeded, reset."""
    import leanrl
    from leanrl.envs import make_env

    entry = ENTRIES[name]
    compile, cudagraphs = MODES[mode]
    args = make_args(name, quick, compile=compile, cudagraphs=cudagraphs, device=str(device), progress=False,
                     **overrides)
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    if entry.env_fn:
        envs = getattr(load_script(entry.script), entry.env_fn)(args.env_id, args.num_envs, device, args.seed)
    else:
        envs = make_env(args.env_id, args.num_envs, device=device, seed=args.seed,
                        **{k: getattr(args, k) for k in entry.env_args})
    module, cls = entry.algo.split(":")
    algo = getattr(importlib.import_module(module), cls)(args, envs, device)
    algo.reset(args.seed)
    return algo, envs, args
