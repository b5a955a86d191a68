"""Any registered gymnasium id (MuJoCo, classic control) on a SyncVectorEnv, through `leanrl.TorchVectorEnv`.

Continuous-action ids get CleanRL's ppo_continuous_action recipe: raw episode statistics, clipped
actions, observations normalized and clipped to [-10, 10], rewards normalized and clipped to [-10, 10].
Statistics are shared by all sub-envs, and saved in checkpoints. Discrete-action ids get only the episode statistics.
"""
import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers import vector as vector_wrappers
from gymnasium.wrappers.utils import RunningMeanStd

from leanrl.gym_adapter import TorchVectorEnv


class GymEnv(TorchVectorEnv):
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
        space, action_space = env.single_observation_space, env.single_action_space
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"{env_id} has a {type(space).__name__} observation space; only Box is supported")
        continuous = isinstance(action_space, gym.spaces.Box)
        normalize_obs = continuous if normalize_obs is None else normalize_obs
        normalize_reward = continuous if normalize_reward is None else normalize_reward
        env = vector_wrappers.RecordEpisodeStatistics(env)  # innermost: raw returns
        if continuous:
            env = vector_wrappers.ClipAction(env)
        self.reward_norm = None
        if normalize_reward:
            env = self.reward_norm = vector_wrappers.NormalizeReward(env, gamma=gamma)
            env = vector_wrappers.ClipReward(env, -clip, clip)
        super().__init__(env, device)
        self.single_action_space = action_space  # before ClipAction widens it to (-inf, inf)
        # gymnasium's vector NormalizeObservation refuses SAME_STEP autoreset (it would miss final_obs): ours is below
        self.obs_rms = RunningMeanStd(shape=space.shape) if normalize_obs else None
        if self.obs_rms is not None:
            self.single_observation_space = gym.spaces.Box(-clip, clip, space.shape, np.float32)
        self.clip, self._seed = clip, seed

    def normalize_obs(self, obs: np.ndarray, update: bool) -> np.ndarray:
        if self.obs_rms is None:
            return obs
        if update:
            self.obs_rms.update(obs)
        return np.clip((obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + 1e-8), -self.clip, self.clip)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        seed, self._seed = (self._seed if seed is None else seed), None  # the constructor's seed seeds the first reset
        return super().reset(seed)

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
