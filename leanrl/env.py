"""The vector env every algorithm file steps, written once: torch tensors in and out, on the run's device.

`leanrl.envs` implements it for Atari, gymnasium/MuJoCo and the on-device torch envs; `leanrl.TorchVectorEnv`
wraps any gymnasium vector env made with `autoreset_mode=AutoresetMode.SAME_STEP`.
"""

from typing import Protocol

import gymnasium
import torch


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
        """One step of every env, a dict of tensors: `next_obs`, `final_obs`, `reward`, `terminated`, `truncated`,
        `episode_return`, `episode_length`. Auto-reset in the same step (gymnasium's SAME_STEP): `next_obs` is already
        reset where an episode ended and `final_obs` is its true last observation (a truncated episode bootstraps
        from it). `episode_return` and `episode_length` are the raw return and length where an episode ended (a
        whole Atari game, all its lives) and 0 elsewhere: `episode_length > 0` is where one ended."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the envs (an on-device env's whole state; a host env's normalizers)."""

    def load_state_dict(self, state: dict) -> None: ...

    def statistics(self) -> dict:
        """What a policy trained on these envs needs in new ones (an evaluation's, an async collector's): the
        observation normalizers' running statistics, {} for most envs."""

    def load_statistics(self, statistics: dict) -> None: ...

    def close(self) -> None: ...


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
