"""CartPole-v1 and Pendulum-v1 stepped as batched tensors on the device, with gymnasium's dynamics.

`step` has no Python branch on tensor values and no host sync, and writes the env state in place into
preallocated tensors, so it traces under torch.compile(fullgraph=True) and can be captured in a CUDA
graph. `transition` is the same step as a pure function of the state (`carry`), for code that scans it.
Auto-reset states come from `reset_noise` when the caller draws it (PPO draws a rollout's at once), else
from torch's default generator (the one CUDA graphs and compiled code can replay): seed it with
torch.manual_seed. Only reset(seed) uses a generator of its own.
The state is float64 by default, like gymnasium's; observations are float32.
"""
import math

import numpy as np
import torch
from gymnasium.spaces import Box, Discrete

# gymnasium/envs/classic_control/cartpole.py
GRAVITY, MASS_CART, MASS_POLE, HALF_LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLEMASS_LENGTH = MASS_CART + MASS_POLE, MASS_POLE * HALF_LENGTH
X_THRESHOLD, THETA_THRESHOLD = 2.4, 12 * 2 * math.pi / 360
CARTPOLE_OBS_HIGH = np.array([2 * X_THRESHOLD, np.inf, 2 * THETA_THRESHOLD, np.inf], dtype=np.float32)


def cartpole_obs(state: torch.Tensor) -> torch.Tensor:
    return state.float()


def cartpole_step(state: torch.Tensor, action: torch.Tensor):
    """Euler step of a batch. state (N, 4): x, x_dot, theta, theta_dot; action (N,) in {0, 1}.
    Returns (new_state, obs, reward, terminated); the terms are ordered as in gymnasium's."""
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = (2 * action - 1).to(state.dtype) * FORCE_MAG
    costheta, sintheta = torch.cos(theta), torch.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sintheta) / TOTAL_MASS
    thetaacc = (GRAVITY * sintheta - costheta * temp) / (
        HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * costheta**2 / TOTAL_MASS)
    )
    xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
    x, x_dot = x + TAU * x_dot, x_dot + TAU * xacc
    theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * thetaacc
    new_state = torch.stack([x, x_dot, theta, theta_dot], -1)
    terminated = (x.abs() > X_THRESHOLD) | (theta.abs() > THETA_THRESHOLD)
    return new_state, cartpole_obs(new_state), torch.ones_like(x, dtype=torch.float32), terminated


# gymnasium/envs/classic_control/pendulum.py
MAX_SPEED, MAX_TORQUE, DT, G, M, L = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0
PENDULUM_OBS_HIGH = np.array([1.0, 1.0, MAX_SPEED], dtype=np.float32)


def pendulum_obs(state: torch.Tensor) -> torch.Tensor:
    theta, theta_dot = state.unbind(-1)
    return torch.stack([torch.cos(theta), torch.sin(theta), theta_dot], -1).float()


def pendulum_step(state: torch.Tensor, action: torch.Tensor):
    """Step of a batch. state (N, 2): theta, theta_dot; action (N, 1) torque, clipped to [-2, 2].
    Returns (new_state, obs, reward, terminated); the torque stays float32 as in gymnasium."""
    th, thdot = state.unbind(-1)
    u = action[..., 0].float().clamp(-MAX_TORQUE, MAX_TORQUE)
    cost = ((th + math.pi) % (2 * math.pi) - math.pi) ** 2 + 0.1 * thdot**2 + 0.001 * u**2
    newthdot = thdot + (3 * G / (2 * L) * torch.sin(th) + 3.0 / (M * L**2) * u) * DT
    newthdot = newthdot.clamp(-MAX_SPEED, MAX_SPEED)
    new_state = torch.stack([th + newthdot * DT, newthdot], -1)
    return new_state, pendulum_obs(new_state), (-cost).float(), torch.zeros_like(th, dtype=torch.bool)


class TorchEnv:
    """`num_envs` copies of a physics step function, with SAME_STEP auto-reset and a time limit."""

    obs_dtype = torch.float32
    on_device = True  # step is pure tensor code: algorithms may compile it and capture it with their own

    def __init__(self, num_envs: int, device="cpu", seed: int = 0, dtype: torch.dtype = torch.float64):
        self.num_envs, self.device, self._seed = num_envs, torch.device(device), seed
        self.reset_high = torch.tensor(self.RESET_HIGH, dtype=dtype, device=self.device)
        # Preallocated and only ever written with copy_: a captured CUDA graph keeps reading these addresses.
        self.state = torch.zeros(num_envs, len(self.reset_high), dtype=dtype, device=self.device)
        self.steps = torch.zeros(num_envs, dtype=torch.int64, device=self.device)
        self.episode_return = torch.zeros(num_envs, device=self.device)

    def _sample_state(self, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None):
        """Uniform in [-reset_high, reset_high], like gymnasium's reset; made from `uniform` (in [0, 1)) if given."""
        if uniform is None:
            uniform = torch.rand((self.num_envs, len(self.reset_high)), dtype=self.reset_high.dtype,
                                 device=self.device, generator=generator)
        return (2 * uniform - 1) * self.reset_high

    def reset_noise(self, num_steps: int) -> torch.Tensor:
        """The random numbers `num_steps` steps draw their auto-reset states from, drawn at once: one per step
        (`step`'s and `transition`'s `reset_noise`)."""
        return torch.rand(num_steps, self.num_envs, len(self.reset_high), dtype=self.reset_high.dtype,
                          device=self.device)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        seed, self._seed = (self._seed if seed is None else seed), None  # the constructor's seed seeds the first reset
        generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.state.copy_(self._sample_state(generator))
        self.steps.zero_()
        self.episode_return.zero_()
        return self.obs_fn(self.state)

    @property
    def carry(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole env state: what `transition` maps to the next one."""
        return self.state, self.steps, self.episode_return

    def transition(self, carry, action: torch.Tensor, reset_noise: torch.Tensor | None = None) -> tuple[tuple, dict]:
        """`step` as a pure function: (the next carry, the step's outputs as a dict), nothing written."""
        state, steps, episode_return = carry
        new_state, final_obs, reward, terminated = self.step_fn(state, action)
        steps, episode_return = steps + 1, episode_return + reward
        truncated = steps >= self.max_steps  # gymnasium's TimeLimit: may be set together with terminated
        done = terminated | truncated
        next_state = torch.where(done[:, None], self._sample_state(uniform=reset_noise), new_state)
        next_carry = (next_state, torch.where(done, 0, steps), torch.where(done, 0.0, episode_return))
        return next_carry, dict(
            next_obs=self.obs_fn(next_state), final_obs=final_obs, reward=reward,
            terminated=terminated, truncated=truncated,
            episode_return=torch.where(done, episode_return, 0.0), episode_length=torch.where(done, steps, 0))

    def step(self, action: torch.Tensor, reset_noise: torch.Tensor | None = None) -> dict:
        """One step of every env; auto-reset states from `reset_noise` (one step of `reset_noise()`), or drawn."""
        next_carry, out = self.transition(self.carry, action, reset_noise)
        self.set_carry(next_carry)
        return out

    def set_carry(self, carry) -> None:
        for mine, new in zip(self.carry, carry):
            mine.copy_(new)

    def statistics(self) -> dict:
        return {}  # nothing is normalized

    def load_statistics(self, sd: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": self.state.clone(), "steps": self.steps.clone(), "episode_return": self.episode_return.clone()}

    def load_state_dict(self, sd: dict) -> None:
        for name in ("state", "steps", "episode_return"):
            getattr(self, name).copy_(sd[name])

    def close(self) -> None:
        pass


class CartPole(TorchEnv):
    single_observation_space = Box(-CARTPOLE_OBS_HIGH, CARTPOLE_OBS_HIGH)
    single_action_space = Discrete(2)
    RESET_HIGH, max_steps = [0.05] * 4, 500
    step_fn, obs_fn = staticmethod(cartpole_step), staticmethod(cartpole_obs)


class Pendulum(TorchEnv):
    single_observation_space = Box(-PENDULUM_OBS_HIGH, PENDULUM_OBS_HIGH)
    single_action_space = Box(-MAX_TORQUE, MAX_TORQUE, (1,), np.float32)
    RESET_HIGH, max_steps = [math.pi, 1.0], 200
    step_fn, obs_fn = staticmethod(pendulum_step), staticmethod(pendulum_obs)


TORCH_ENVS = {"torch/CartPole-v1": CartPole, "torch/Pendulum-v1": Pendulum}
