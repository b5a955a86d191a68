"""Atari on ale-py's native C++ vector env, which does the DeepMind preprocessing itself
(84x84 gray, 4-frame stack, frameskip 4 with max-pool, up to 30 noops and FIRE on reset).

Rewards are the raw game rewards (the learner clips). With `episodic_life`, losing a life is
`terminated` for learning while the game goes on, and `episode_return` / `episode_length` report
the whole game (all lives), like CleanRL's EpisodicLifeEnv + RecordEpisodeStatistics.
"""
import difflib

import numpy as np
import torch
from tensordict import TensorDict

from leanrl.gym_adapter import to_device

try:
    from ale_py import roms
    from ale_py.registration import rom_id_to_name
    from ale_py.vector_env import AtariVectorEnv
except ImportError as e:
    raise ImportError('Atari envs need ale-py: pip install -e ".[atari]"') from e


class AtariEnv:
    obs_dtype = torch.uint8
    on_device = False  # stepped on the host

    def __init__(self, game: str, num_envs: int, device="cpu", seed: int = 0,
                 episodic_life: bool = True, sticky_actions: bool = False, **ale_kwargs):
        """`game` as in the gymnasium id ("Breakout", "SpaceInvaders"); `ale_kwargs` go to AtariVectorEnv."""
        rom_ids = {rom_id_to_name(rom): rom for rom in roms.get_all_rom_ids()}
        if game not in rom_ids:
            close = difflib.get_close_matches(game, rom_ids, n=5)
            raise ValueError(f"Unknown Atari game {game!r}: ale-py has no such ROM (close matches: {close})")
        # ale-py's own episodic_life resets the whole game on a life loss, so we track lives ourselves.
        self.env = AtariVectorEnv(
            rom_ids[game], num_envs, autoreset_mode="SameStep", reward_clipping=False,
            repeat_action_probability=0.25 if sticky_actions else 0.0, **ale_kwargs,
        )
        self.num_envs, self.device, self.episodic_life, self._seed = num_envs, torch.device(device), episodic_life, seed
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space

    def reset(self, seed: int | None = None) -> torch.Tensor:
        seed, self._seed = (self._seed if seed is None else seed), None  # the constructor's seed seeds the first reset
        obs, info = self.env.reset(seed=seed)
        self.lives = info["lives"]
        self.game_return = np.zeros(self.num_envs, dtype=np.float64)
        self.game_length = np.zeros(self.num_envs, dtype=np.int64)
        return to_device(torch.from_numpy(obs), self.device)

    def step(self, action: torch.Tensor) -> TensorDict:
        obs, reward, terminated, truncated, info = self.env.step(action.cpu().numpy())
        game_over = terminated | truncated
        final_obs = obs.copy()
        if game_over.any():  # info has final_obs only then
            final_obs[game_over] = info["final_obs"][game_over]
        self.game_return += reward
        self.game_length += 1
        episode_return = np.where(game_over, self.game_return, 0.0)
        episode_length = np.where(game_over, self.game_length, 0)
        self.game_return[game_over] = 0
        self.game_length[game_over] = 0
        if self.episodic_life:  # the game continues after a lost life, so next_obs is the true next obs
            terminated = terminated | (info["lives"] < self.lives)
        self.lives = info["lives"]
        td = TensorDict(
            next_obs=torch.from_numpy(obs), final_obs=torch.from_numpy(final_obs),
            reward=torch.from_numpy(reward.astype(np.float32)),
            terminated=torch.from_numpy(terminated), truncated=torch.from_numpy(truncated),
            episode_return=torch.from_numpy(episode_return.astype(np.float32)),
            episode_length=torch.from_numpy(episode_length), batch_size=[self.num_envs], device="cpu",
        )
        return to_device(td, self.device)

    def state_dict(self) -> dict:
        return {}  # a resumed run starts fresh games

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        self.env.close()
