"""The replay memory of TD3, SAC and DQN, and what an off-policy run's loop shares: the checks on its arguments and
the Logger's burn-in for a run that compiles only once learning starts.

`Replay` is a bounded storage on the run's device, written and sampled by tensor ops alone: the write cursor, the
fill level and the count of writes are device tensors. So an env step's learner call, which stores the transition
and samples a batch before its updates, compiles as one graph and replays in a CUDA graph. torchrl's ReplayBuffer
(`compilable=True`) compiles on a CPU too, but keeps its cursor a Python int, which a CUDA graph would replay as a
constant: every step would write the same slot. Its checkpoint is torchrl's: `state_dict()` is what torchrl's
`ReplayBuffer(storage=LazyTensorStorage(...)).state_dict()` holds for the same transitions, and loads into one.
"""

import math
import sys

import psutil
import torch

from leanrl.cli import UsageError
from leanrl.run import check_flags


def check_replay_args(args, learning_rates=("learning_rate",)) -> int:
    """Fail on replay settings that cannot work, before any environment is built or anything compiled. Returns the
    number of iterations (vector env steps)."""
    check_flags(args, positive=("num_envs", "buffer_size", "batch_size", *learning_rates),
                non_negative=("learning_starts",), unit_interval=("gamma",))
    if args.total_timesteps < args.num_envs:
        raise UsageError(f"total_timesteps = {args.total_timesteps} is less than one step of num_envs = "
                         f"{args.num_envs} environments")
    if args.batch_size > args.buffer_size:
        raise UsageError(f"batch_size = {args.batch_size} must be at most buffer_size = {args.buffer_size}")
    if args.learning_starts >= args.total_timesteps:
        raise UsageError(f"learning_starts = {args.learning_starts} must be less than total_timesteps = "
                         f"{args.total_timesteps}: otherwise no update would ever run")
    if not 0 < args.tau <= 1:
        raise UsageError(f"tau = {args.tau} must be in (0, 1]")
    return args.total_timesteps // args.num_envs


class Replay:
    """`capacity` transitions of the `fields` {name: (shape, dtype)} on `device`, allocated at once (untouched pages
    cost no memory until written); `extend(transition)` writes a vector step's transitions (a dict of tensors with a
    leading num_envs dimension) round robin, `sample()` draws `batch_size` of the stored ones uniformly, with
    replacement: every batch has the same shape, which a graphed update needs."""

    def __init__(self, capacity: int, batch_size: int, fields: dict, device):
        if batch_size > capacity:
            raise ValueError(f"batch_size = {batch_size} is larger than the capacity {capacity}")
        self.capacity, self.batch_size, self.device = capacity, batch_size, torch.device(device)
        need = capacity * sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())
        # host pages cost nothing until written, but an allocation larger than the memory fails at once
        cuda = self.device.type == "cuda"
        have = torch.cuda.mem_get_info(self.device)[0] if cuda else psutil.virtual_memory().total
        if need > have:
            raise UsageError(f"buffer_size = {capacity:,} transitions need {need / 2**30:.1f} GiB, more than the "
                             f"{have / 2**30:.1f} GiB {'free on' if cuda else 'of'} {self.device}: lower --buffer-size")
        self.storage = {name: torch.empty(capacity, *shape, dtype=dtype, device=self.device)
                        for name, (shape, dtype) in fields.items()}
        zero = dict(dtype=torch.int64, device=self.device)
        self.cursor, self.size, self.written = torch.zeros((), **zero), torch.zeros((), **zero), torch.zeros((), **zero)

    @classmethod
    def of_transitions(cls, args, obs_space, act_space, device, obs_dtype=torch.float32, next_obs_shape=None):
        """A buffer of `args.buffer_size` transitions (obs, action, reward, next_obs, terminated) of these spaces,
        sampled `args.batch_size` at a time; `next_obs_shape`: where next_obs keeps less than obs (a frame stack's
        newest frame)."""
        action_dtype = torch.float32 if act_space.shape else torch.int64
        return cls(args.buffer_size, args.batch_size, dict(
            obs=(obs_space.shape, obs_dtype), action=(act_space.shape, action_dtype), reward=((), torch.float32),
            next_obs=(next_obs_shape or obs_space.shape, obs_dtype), terminated=((), torch.bool)), device)

    def extend(self, transition: dict) -> None:
        n = next(iter(transition.values())).shape[0]
        index = (self.cursor + torch.arange(n, device=self.device)) % self.capacity
        for name, x in transition.items():
            self.storage[name].index_copy_(0, index, x)
        self.cursor.copy_((self.cursor + n) % self.capacity)
        self.size.copy_((self.size + n).clamp(max=self.capacity))
        self.written.add_(n)

    def sample(self) -> dict:
        index = (torch.rand(self.batch_size, device=self.device) * self.size).long()
        return {name: x[index] for name, x in self.storage.items()}

    def __len__(self) -> int:
        return int(self.size)  # a host read: for checks and tests, not the loop

    def state_dict(self) -> dict:
        """torchrl's ReplayBuffer layout: the storage (all `capacity` slots) with its length, the writer's cursor."""
        return {"_storage": {"_storage": dict(self.storage), "initialized": True, "_len": int(self.size)},
                "_sampler": {}, "_writer": {"_cursor": int(self.cursor), "_write_count": int(self.written)},
                "_transforms": {}, "_batch_size": self.batch_size}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """What `state_dict` (or torchrl's ReplayBuffer.state_dict()) saved, onto this storage's device, in place."""
        saved = _flat(state["_storage"]["_storage"])
        if set(saved) != set(self.storage) or any(saved[k].shape != x.shape for k, x in self.storage.items()):
            raise UsageError(f"the checkpoint's replay buffer holds {_shapes(saved)}, "
                             f"this run's {_shapes(self.storage)}")
        for name, x in self.storage.items():
            x.copy_(saved[name])
        self.size.fill_(state["_storage"]["_len"])
        self.cursor.fill_(state["_writer"]["_cursor"])
        self.written.fill_(state["_writer"].get("_write_count", state["_storage"]["_len"]))


def _flat(tree: dict, prefix: str = "") -> dict:
    """A (possibly nested, as torchrl keeps a TensorDict's) dict of tensors by dotted name."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shapes(storage: dict) -> str:
    return ", ".join(f"{k} {list(v.shape[1:])}" for k, v in sorted(storage.items()))


def restore_replay(replay: Replay, state: dict) -> int:
    """Load a checkpoint's replay buffer (saved with --save-buffer) into `replay`; returns the step its filling started
    from (`fill_start`). A checkpoint without one: the resumed run acts with the restored policy and updates again
    once learning_starts new transitions are stored, and says so."""
    if state["replay_buffer"] is None:
        print("leanrl: this checkpoint holds no replay buffer (save one with --save-buffer); the resumed run acts "
              "with the restored policy and updates again once learning_starts new transitions are stored.",
              file=sys.stderr)
        return state["global_step"]
    replay.load_state_dict(state["replay_buffer"])
    return state["fill_start"]


def burn_in(args, global_step: int, fill_start: int, updates: int, updates_in=lambda before, after: 1) -> int:
    """The Logger's burn-in for an off-policy run: the iterations from `global_step` to the `updates`-th update,
    after which every accelerated function has been compiled and captured (updates begin only once the buffer holds
    learning_starts transitions since `fill_start`, long after `leanrl.WARMUP` iterations, so compile time would
    otherwise dilute SPS). `updates_in(before, after)`: the updates of an iteration from global step `before` to
    `after`."""
    step, iterations, done = global_step, 0, 0
    while done < updates:
        before, step, iterations = step, step + args.num_envs, iterations + 1
        if step - fill_start > args.learning_starts:
            done += updates_in(before, step)
    return iterations

