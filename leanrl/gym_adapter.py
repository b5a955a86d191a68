"""A gymnasium vector env as the vector env the algorithm files step: torch tensors in and out.

    envs = leanrl.TorchVectorEnv(gym.make_vec("CartPole-v1", 4, vectorization_mode="sync",
                                              vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}))

`reset(seed) -> obs`; `step(action) -> {next_obs, final_obs, reward, terminated, truncated, episode_return,
episode_length}`: with SAME_STEP autoreset `next_obs` is already reset where an episode ended and
`final_obs` is that episode's true last observation (what a truncated episode bootstraps from). Episode returns
are raw: recorded by the env's own `RecordEpisodeStatistics` when it has one (below any reward wrapper), else by
one added here. `state_dict()` is empty: a host simulator's episodes cannot be restored, so a resumed run starts
new episodes (subclasses add what can be restored, e.g. normalization statistics).
"""

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics


def to_device(x, device: torch.device):
    """Move a CPU tensor to `device`; on CUDA through pinned memory, so the copy does not block."""
    if device.type == "cpu":
        return x
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def to_device_dict(tensors: dict, device: torch.device) -> dict:
    """A step's host tensors on `device` (see `to_device`), as a plain dict: a TensorDict's bookkeeping, made anew at
    every step, cost more host time than the rest of a step's conversion."""
    return tensors if device.type == "cpu" else {name: to_device(t, device) for name, t in tensors.items()}


def _records_episodes(env) -> bool:
    while env is not None:
        if isinstance(env, RecordEpisodeStatistics):
            return True
        env = getattr(env, "env", None)
    return False


class TorchVectorEnv:
    on_device = False  # stepped on the host: algorithms do not compile or capture `step`
    obs_dtype = torch.float32

    def __init__(self, env: gym.vector.VectorEnv, device="cpu"):
        if not isinstance(env, gym.vector.VectorEnv):
            raise TypeError(f"TorchVectorEnv wraps a gymnasium vector env (gym.make_vec), got {type(env).__name__}")
        if env.metadata.get("autoreset_mode") != AutoresetMode.SAME_STEP:
            raise ValueError(f"TorchVectorEnv needs autoreset_mode SAME_STEP (the final observation of each "
                             f"episode), got {env.metadata.get('autoreset_mode')}: make it with gym.make_vec(..., "
                             "vectorization_mode='sync', "
                             "vector_kwargs={'autoreset_mode': gymnasium.vector.AutoresetMode.SAME_STEP})")
        space = env.single_observation_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"observation space {type(space).__name__}: only Box observations are supported")
        self.single_observation_space = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32))
        self.single_action_space = env.single_action_space
        self.env = env if _records_episodes(env) else RecordEpisodeStatistics(env)
        self.num_envs, self.device = env.num_envs, torch.device(device)

    def normalize_obs(self, obs: np.ndarray, update: bool) -> np.ndarray:
        """The observation the agent sees (`update`: this is a new next observation, not a final one)."""
        return obs

    def _tensor(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(obs, dtype=np.float32))

    def reset(self, seed: int | None = None) -> torch.Tensor:
        obs, _ = self.env.reset(seed=seed)
        return to_device(self._tensor(self.normalize_obs(obs, update=True)), self.device)

    def step(self, action: torch.Tensor) -> dict:
        obs, reward, terminated, truncated, info = self.env.step(action.cpu().numpy())
        next_obs = self.normalize_obs(obs, update=True)  # statistics see each next observation once
        final_obs = next_obs.copy()
        done = terminated | truncated
        if done.any():  # the true last observation only where an episode ended
            final_obs[done] = self.normalize_obs(np.stack(info["final_obs"][done]), update=False)
        episode = info.get("episode", {"r": np.zeros(self.num_envs), "l": np.zeros(self.num_envs, dtype=np.int64)})
        return to_device_dict(dict(
            next_obs=self._tensor(next_obs), final_obs=self._tensor(final_obs),
            reward=torch.from_numpy(np.asarray(reward, dtype=np.float32)),
            terminated=torch.from_numpy(terminated), truncated=torch.from_numpy(truncated),
            episode_return=torch.from_numpy(episode["r"].astype(np.float32)),
            episode_length=torch.from_numpy(episode["l"].astype(np.int64))), self.device)

    def statistics(self) -> dict:
        return {}

    def load_statistics(self, sd: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        self.env.close()
