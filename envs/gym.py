"""Any registered gymnasium id (MuJoCo, classic control) on a SyncVectorEnv, torch in and out.

Continuous-action ids get CleanRL's ppo_continuous_action recipe: raw episode statistics, clipped
actions, observations normalized and clipped to [-10, 10], rewards normalized and clipped to [-10, 10].
Statistics are shared by all sub-envs. Discrete-action ids get only the episode statistics.
"""
import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers import vector as vector_wrappers
from gymnasium.wrappers.utils import RunningMeanStd
from tensordict import TensorDict

from .common import to_device


class GymEnv:
    obs_dtype = torch.float32

    def __init__(self, env_id: str, num_envs: int, device="cpu", seed: int = 0,
                 normalize_obs: bool | None = None, normalize_reward: bool | None = None,
                 gamma: float = 0.99, clip: float = 10.0, **make_kwargs):
        """normalize_obs / normalize_reward default to True for Box action spaces, False otherwise;
        off-policy methods (TD3, SAC) pass False. `gamma` is the reward normalizer's discount."""
        try:  # on 2 cores Sync beats Async
            env = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                               vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}, **make_kwargs)
        except gym.error.DependencyNotInstalled as e:
            if "mujoco" in str(gym.spec(env_id).entry_point):
                raise ImportError(f'{env_id} needs mujoco: pip install -e ".[mujoco]"') from e
            raise
        space = env.single_observation_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"{env_id} has a {type(space).__name__} observation space; only Box is supported")
        continuous = isinstance(env.single_action_space, gym.spaces.Box)
        normalize_obs = continuous if normalize_obs is None else normalize_obs
        normalize_reward = continuous if normalize_reward is None else normalize_reward
        self.single_action_space = env.single_action_space  # before ClipAction widens it to (-inf, inf)
        env = vector_wrappers.RecordEpisodeStatistics(env)  # innermost: raw returns
        if continuous:
            env = vector_wrappers.ClipAction(env)
        self.reward_norm = None
        if normalize_reward:
            env = self.reward_norm = vector_wrappers.NormalizeReward(env, gamma=gamma)
            env = vector_wrappers.ClipReward(env, -clip, clip)
        # gymnasium's vector NormalizeObservation refuses SAME_STEP autoreset (it would miss final_obs): ours is below
        self.obs_rms = RunningMeanStd(shape=space.shape) if normalize_obs else None
        if self.obs_rms is None:
            self.single_observation_space = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32))
        else:
            self.single_observation_space = gym.spaces.Box(-clip, clip, space.shape, np.float32)
        self.env, self.clip, self.num_envs, self.device, self._seed = env, clip, num_envs, torch.device(device), seed

    def _normalize(self, obs: np.ndarray) -> np.ndarray:
        if self.obs_rms is None:
            return obs
        return np.clip((obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + 1e-8), -self.clip, self.clip)

    def _to_tensor(self, obs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(obs.astype(np.float32))

    def reset(self, seed: int | None = None) -> torch.Tensor:
        seed, self._seed = (self._seed if seed is None else seed), None  # the constructor's seed seeds the first reset
        obs, _ = self.env.reset(seed=seed)
        if self.obs_rms is not None:
            self.obs_rms.update(obs)
        return to_device(self._to_tensor(self._normalize(obs)), self.device)

    def step(self, action: torch.Tensor) -> TensorDict:
        obs, reward, terminated, truncated, info = self.env.step(action.cpu().numpy())
        done = terminated | truncated
        final_obs = obs.copy()
        if done.any():
            final_obs[done] = np.stack(info["final_obs"][done])
        if self.obs_rms is not None:  # statistics see each next_obs once; final_obs gets the same transform
            self.obs_rms.update(obs)
        episode = info.get("episode", {"r": np.zeros(self.num_envs), "l": np.zeros(self.num_envs, dtype=np.int64)})
        td = TensorDict(
            next_obs=self._to_tensor(self._normalize(obs)), final_obs=self._to_tensor(self._normalize(final_obs)),
            reward=torch.from_numpy(reward.astype(np.float32)),
            terminated=torch.from_numpy(terminated), truncated=torch.from_numpy(truncated),
            episode_return=torch.from_numpy(episode["r"].astype(np.float32)),
            episode_length=torch.from_numpy(episode["l"].astype(np.int64)), batch_size=[self.num_envs], device="cpu",
        )
        return to_device(td, self.device)

    def _running_stats(self) -> dict:
        stats = {} if self.obs_rms is None else {"obs_rms": self.obs_rms}
        if self.reward_norm is not None:
            stats["return_rms"] = self.reward_norm.return_rms
        return stats

    def state_dict(self) -> dict:
        """Normalizer statistics, as tensors so that torch.load(weights_only=True) accepts them."""
        sd = {name: {"mean": torch.tensor(rms.mean), "var": torch.tensor(rms.var), "count": float(rms.count)}
              for name, rms in self._running_stats().items()}
        if self.reward_norm is not None:
            sd["accumulated_reward"] = torch.tensor(self.reward_norm.accumulated_reward)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for name, rms in self._running_stats().items():
            rms.mean, rms.var, rms.count = sd[name]["mean"].numpy().copy(), sd[name]["var"].numpy().copy(), sd[name]["count"]
        if self.reward_norm is not None:
            self.reward_norm.accumulated_reward[:] = sd["accumulated_reward"].numpy()

    def close(self) -> None:
        self.env.close()
