"""The vector env every algorithm file steps, written once: torch tensors in and out, on the run's device.

`leanrl.envs` implements it for Atari, gymnasium/MuJoCo and the on-device torch envs; `leanrl.TorchVectorEnv`
wraps any gymnasium vector env made with `autoreset_mode=AutoresetMode.SAME_STEP`. `EnvBuffers` steps host envs in
groups, each in the background while the policy acts on another (PufferLib's double buffering).
"""

from typing import Protocol

import gymnasium
import torch

from leanrl.cli import UsageError


class VectorEnv(Protocol):
    num_envs: int
    device: torch.device
    single_observation_space: gymnasium.spaces.Space
    single_action_space: gymnasium.spaces.Space
    obs_dtype: torch.dtype
    on_device: bool
    """stepped in torch on the run's device (algorithms may compile and capture `step`), not on the host"""

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Every env's first observation; `seed` (the constructor's, if None the first time) seeds it."""

    def step(self, action: torch.Tensor) -> dict[str, torch.Tensor]:
        """One step of every env, a dict of tensors: `next_obs`, `final_obs`, `reward` (float32), `terminated`,
        `truncated` (bool), `episode_return` (float32), `episode_length` (int64). Auto-reset in the same step
        (gymnasium's SAME_STEP): `next_obs` is already reset where an episode ended and `final_obs` is its true last
        observation (a truncated episode bootstraps from it). `episode_return` and `episode_length` are the raw
        return and length where an episode ended (a whole Atari game, all its lives) and 0 elsewhere:
        `episode_length > 0` is where one ended."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the envs (an on-device env's whole state; a host env's normalizers)."""

    def load_state_dict(self, state: dict) -> None: ...

    def statistics(self) -> dict:
        """What a policy trained on these envs needs in new ones (an evaluation's, an async collector's): the
        observation normalizers' running statistics, {} for most envs."""

    def load_statistics(self, statistics: dict) -> None: ...

    def close(self) -> None: ...


class HostEnv(VectorEnv, Protocol):
    """An env stepped on the host (a simulator: ALE, MuJoCo), which also steps in two halves: `step(action)` is
    `send(action)` then `recv()`."""

    background: bool
    """whether `send` returns at once and the envs step in the background until `recv` (set by `EnvBuffers`)"""

    def send(self, action: torch.Tensor) -> None:
        """Start a step of every env with `action`."""

    def recv(self) -> dict[str, torch.Tensor]:
        """The step `send` started, as `step` returns it."""


class OnDeviceEnv(VectorEnv, Protocol):
    """An env stepped in torch (`on_device`), which also draws its auto-reset states from numbers it is given and
    steps as a pure function, for code that compiles a whole rollout (`leanrl.scan.scan_env_steps`)."""

    def reset_noise(self, num_steps: int) -> torch.Tensor:
        """The random numbers `num_steps` steps draw their auto-reset states from, drawn at once."""

    def step(self, action: torch.Tensor, reset_noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...

    @property
    def carry(self) -> tuple:
        """The env's whole state, what `transition` maps to the next one."""

    def transition(self, carry: tuple, action: torch.Tensor, reset_noise: torch.Tensor | None = None) -> tuple:
        """`step` as a pure function: (the next carry, the step's outputs as a dict), nothing written."""

    def set_carry(self, carry: tuple) -> None: ...


def no_step(obs: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a step returns before the first one: the observation, no reward, nothing ended; the dtypes of `step`,
    and no two values one tensor, as in a step (a compiled function is specialized to its inputs' aliasing)."""
    def zeros(dtype=torch.float32):
        return torch.zeros(obs.shape[0], dtype=dtype, device=obs.device)
    return dict(next_obs=obs, final_obs=obs.clone(), reward=zeros(), terminated=zeros(torch.bool),
                truncated=zeros(torch.bool), episode_return=zeros(), episode_length=zeros(torch.int64))


class EnvBuffers:
    """Host envs in groups ("buffers") of `buffers[0].num_envs` envs each: each group steps in the background
    between its `send` and `recv`, so that while the policy acts on one buffer the others step (with two, PufferLib's
    double buffering). Itself a `VectorEnv` of all their envs in order (`step` steps every buffer and concatenates),
    so an evaluation or an off-policy learner takes it as any env; PPO's rollout steps the `buffers` one by one."""

    on_device = False

    def __init__(self, buffers: list):
        if any(b.on_device for b in buffers):
            raise UsageError("env buffers step host envs in the background; an on-device env (torch/...) steps on "
                             "the device already: use one buffer")
        self.buffers = buffers
        for b in buffers:
            b.background = True
        first = buffers[0]
        self.single_observation_space, self.single_action_space = first.single_observation_space, \
            first.single_action_space
        self.obs_dtype, self.device = first.obs_dtype, first.device
        self.sizes = [b.num_envs for b in buffers]
        self.num_envs = sum(self.sizes)

    @classmethod
    def of(cls, make_envs, num_envs: int, num_buffers: int, seed: int = 0, **kwargs):
        """`make_envs(n, seed=, **kwargs)` called `num_buffers` times for num_envs / num_buffers envs each, seeded
        on from `seed` as one vector env of `num_envs` seeds its envs (`seed + i` for env i): the same envs,
        stepped in groups. One buffer: `make_envs(num_envs, seed=seed, **kwargs)` itself."""
        if num_buffers == 1:
            return make_envs(num_envs, seed=seed, **kwargs)
        n = num_envs // num_buffers
        return cls([make_envs(n, seed=seed + i * n, **kwargs) for i in range(num_buffers)])

    def reset(self, seed: int | None = None) -> torch.Tensor:
        offsets = [sum(self.sizes[:i]) for i in range(len(self.buffers))]
        return torch.cat([b.reset(None if seed is None else seed + o) for b, o in zip(self.buffers, offsets)])

    def step(self, action: torch.Tensor) -> dict[str, torch.Tensor]:
        for b, a in zip(self.buffers, action.split(self.sizes)):
            b.send(a)
        outs = [b.recv() for b in self.buffers]
        return {key: torch.cat([out[key] for out in outs]) for key in outs[0]}

    def statistics(self) -> dict:
        """Each buffer keeps its own normalizers (as a run of its envs alone would); new envs get the statistics of
        every env's observations: each running mean and variance ({"mean", "var", "count"}) pooled over the buffers,
        as one normalizer that saw them all would have them; anything else, the first buffer's."""
        stats = [b.statistics() for b in self.buffers]
        return {name: _pooled([s[name] for s in stats]) if _is_running_moments(first) else first
                for name, first in stats[0].items()}

    def load_statistics(self, statistics: dict) -> None:
        for b in self.buffers:
            b.load_statistics(statistics)

    def state_dict(self) -> dict:
        return {"buffers": [b.state_dict() for b in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        for b, s in zip(self.buffers, state["buffers"]):
            b.load_state_dict(s)

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def _is_running_moments(x) -> bool:
    return isinstance(x, dict) and x.keys() == {"mean", "var", "count"}


def _pooled(moments: list[dict]) -> dict:
    """Running means and variances of disjoint samples as those of their union (Chan et al.'s parallel update)."""
    count = torch.stack([m["count"] for m in moments])
    mean, var = torch.stack([m["mean"] for m in moments]), torch.stack([m["var"] for m in moments])
    weight = (count / count.sum()).view(-1, *[1] * (mean.dim() - 1))
    pooled_mean = (weight * mean).sum(0)
    return {"mean": pooled_mean, "var": (weight * (var + (mean - pooled_mean) ** 2)).sum(0), "count": count.sum()}
