"""Atari on ale-py's native C++ vector env, which does the DeepMind preprocessing itself
(84x84 gray, 4-frame stack, frameskip 4 with max-pool, up to 30 noops and FIRE on reset).

Rewards are the raw game rewards (the learner clips). With `episodic_life`, losing a life is
`terminated` for learning while the game goes on, and `episode_return` / `episode_length` report
the whole game (all lives), like CleanRL's EpisodicLifeEnv + RecordEpisodeStatistics.

With `video_folder` (AtariVectorEnv cannot render) the same preprocessing is built from gymnasium's
ALE envs in a SyncVectorEnv with SAME_STEP autoreset: `ALE/<Game>-v5` with frameskip=1, then gymnasium's
RecordVideo on sub-env 0 (every episode that ends; every frame the emulator draws, in full colour, at 60 fps: real
time), then `_LikeAtariVectorEnv` (AtariVectorEnv's reset: its seeding, one FIRE frame where the game has
FIRE, then uniform 0..noop_max-1 NOOP frames, one fewer after FIRE; its truncation after
`max_num_frames_per_episode` frames of play), `AtariPreprocessing(noop_max=0, frame_skip=4, screen_size=84,
grayscale_obs=True, terminal_on_life_loss=False)` (max-pool of the last two frames, INTER_AREA resize, as the
C++ code does) and `FrameStackObservation(4, padding_type="zero")` (the C++ stack also starts from zeros).
For the same seed and actions the two paths give the same observations, rewards, lives, episode ends and
statistics, sticky actions included (tests/test_envs.py checks it step for step; the noop counts follow
libstdc++'s std::uniform_int_distribution, which ale-py's Linux wheels use). What differs is the cost:
the Python loop steps about twice as slow as the C++ one, sub-env 0 keeps each frame (100 KB) in memory until
its episode ends, and writing the mp4 (moviepy, which RecordVideo needs; the resize needs opencv) happens within
the step that ends the episode.
"""
import difflib
import os

import gymnasium as gym
import numpy as np
import torch

from leanrl.cli import UsageError, missing_extra, require_extra
from leanrl.gym_adapter import StepToDevice, to_device

from .gym import RecordEndedEpisodes

try:
    from ale_py import roms
    from ale_py.registration import rom_id_to_name
    from ale_py.vector_env import AtariVectorEnv
except ImportError as e:
    raise missing_extra("an Atari env", "ale-py", "atari") from e


# AtariVectorEnv's keyword arguments that the video path (gymnasium's ALE envs) reproduces; num_threads and
# thread_affinity_offset are accepted and ignored there (the sync vector env steps on one thread).
VIDEO_ALE_KWARGS = ("max_num_frames_per_episode", "noop_max", "use_fire_reset", "full_action_space", "frameskip",
                    "stack_num", "img_height", "img_width", "grayscale", "num_threads", "thread_affinity_offset")


class AtariEnv:
    obs_dtype = torch.uint8
    on_device = False  # stepped on the host

    def __init__(self, game: str, num_envs: int, device="cpu", seed: int = 0,
                 episodic_life: bool = True, sticky_actions: bool = False, video_folder=None, **ale_kwargs):
        """`game` as in the gymnasium id ("Breakout", "SpaceInvaders"); `ale_kwargs` go to AtariVectorEnv.
        `video_folder`: record every episode of sub-env 0 there as mp4 (on gymnasium's ALE envs, see above)."""
        rom_ids = {rom_id_to_name(rom): rom for rom in roms.get_all_rom_ids()}
        if game not in rom_ids:
            close = difflib.get_close_matches(game, rom_ids, n=5)
            raise UsageError(f"Unknown Atari game {game!r}: ale-py has no such ROM (close matches: {close})")
        repeat_action_probability = 0.25 if sticky_actions else 0.0
        if video_folder is not None:
            self.env = _recording_vector_env(game, num_envs, video_folder, repeat_action_probability, **ale_kwargs)
        else:  # ale-py's own episodic_life resets the whole game on a life loss, so we track lives ourselves.
            self.env = AtariVectorEnv(
                rom_ids[game], num_envs, autoreset_mode="SameStep", reward_clipping=False,
                repeat_action_probability=repeat_action_probability, **ale_kwargs,
            )
        self.num_envs, self.device, self.episodic_life, self._seed = num_envs, torch.device(device), episodic_life, seed
        self.recording, self.background = video_folder is not None, False  # (this env always steps in the background)
        self.paddle_strength = np.ones(num_envs, dtype=np.float32)
        self.to_device = StepToDevice(device)
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space

    def reset(self, seed: int | None = None) -> torch.Tensor:
        seed, self._seed = (self._seed if seed is None else seed), None  # the constructor's seed seeds the first reset
        obs, info = self.env.reset(seed=seed)
        self.lives = info["lives"]
        self.game_return = np.zeros(self.num_envs, dtype=np.float32)  # (exact for any game's integer score)
        self.game_length = np.zeros(self.num_envs, dtype=np.int64)
        return to_device(torch.from_numpy(obs), self.device)

    def step(self, action: torch.Tensor) -> dict:
        self.send(action)
        return self.recv()

    def send(self, action: torch.Tensor) -> None:
        """AtariVectorEnv's threads step the games from here until `recv` (the video path's sync env steps in recv)."""
        if self.recording:
            self.action = action.cpu().numpy()
        else:  # ale-py's own send, less its wrapper's checks and its allocation of full paddle strengths at every step
            self.env.ale.send(action.cpu().numpy(), self.paddle_strength)

    def recv(self) -> dict:
        obs, reward, terminated, truncated, info = self.env.step(self.action) if self.recording else self.env.ale.recv()
        game_over = terminated | truncated
        # info has final_obs only where a game ended (an object array from gymnasium's SyncVectorEnv)
        final_rows = np.stack(info["final_obs"][game_over]) if game_over.any() else None
        self.game_return += reward
        self.game_length += 1
        episode_return, episode_length = self.game_return * game_over, self.game_length * game_over
        self.game_return *= ~game_over  # (operators, not calls: this runs at every step)
        self.game_length *= ~game_over
        if self.episodic_life:  # the game continues after a lost life, so next_obs is the true next obs
            terminated = terminated | (info["lives"] < self.lives)
        self.lives = info["lives"]
        return self.to_device(obs, game_over, final_rows, reward=reward.astype(np.float32), terminated=terminated,
                              truncated=truncated, episode_return=episode_return, episode_length=episode_length)

    def statistics(self) -> dict:
        return {}  # nothing is normalized

    def load_statistics(self, sd: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}  # a resumed run starts fresh games

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        self.env.close()


class _LikeAtariVectorEnv(gym.Wrapper):
    """What AtariVectorEnv does around its frame skip, on a frameskip=1 ALE env, as its C++ code does it
    (ale-py's src/ale/vector/preprocessed_env.cpp): a seeded reset seeds the emulator with the seed itself and
    the noop generator with std::mt19937(seed); each reset plays one FIRE frame (if the game has FIRE), then a
    uniform 0..noop_max-1 NOOP frames, one fewer after FIRE, resetting again on a game over; `truncated` once
    `max_frames` frames have been played since the reset (reset frames not counted)."""

    def __init__(self, env: gym.Env, noop_max: int, use_fire_reset: bool, max_frames: int):
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        self.fire = meanings.index("FIRE") if use_fire_reset and "FIRE" in meanings else None
        self.noop, self.noop_max, self.max_frames, self.frames = meanings.index("NOOP"), noop_max, max_frames, 0
        self.mt = np.random.MT19937()  # until a seeded reset: from OS entropy, like the C++ std::random_device

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        if seed is not None:
            ale = self.env.unwrapped.ale
            ale.setInt("random_seed", seed)  # the C++ code's seeding (gymnasium's derives another seed)
            self.env.unwrapped.load_game()
            ale.reset_game()
            key = [seed & 0xFFFFFFFF]  # std::mt19937(seed): MT19937's init_genrand
            for i in range(1, 624):
                key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + i) & 0xFFFFFFFF)
            self.mt.state = {"bit_generator": "MT19937", "state": {"key": np.array(key, np.uint32), "pos": 624}}
        noops = self._uniform(max(self.noop_max, 1))
        if self.fire is not None:
            obs, _, _, _, info = self.env.step(self.fire)
            noops -= 1
        for _ in range(noops):
            obs, _, terminated, _, info = self.env.step(self.noop)
            if terminated:
                obs, info = self.env.reset()
        self.frames = 0
        return obs, info

    def _uniform(self, n: int) -> int:
        """libstdc++'s std::uniform_int_distribution(0, n - 1) on a 32-bit engine (Lemire's method)."""
        product = int(self.mt.random_raw()) * n
        if product % 2**32 < n:
            while product % 2**32 < (2**32 - n) % n:
                product = int(self.mt.random_raw()) * n
        return product >> 32

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.frames += 1
        return obs, reward, terminated, truncated or (self.frames >= self.max_frames and not terminated), info


def _recording_vector_env(game: str, num_envs: int, video_folder, repeat_action_probability: float,
                          max_num_frames_per_episode: int = 108_000, noop_max: int = 30, use_fire_reset: bool = True,
                          full_action_space: bool = False, frameskip: int = 4, stack_num: int = 4,
                          img_height: int = 84, img_width: int = 84, grayscale: bool = True,
                          num_threads: int = 0, thread_affinity_offset: int = -1, **unsupported):
    """AtariVectorEnv's preprocessing from gymnasium's wrappers, sub-env 0 recorded: see the module docstring."""
    if unsupported:
        raise ValueError(f"AtariVectorEnv arguments {sorted(unsupported)} are not supported with video_folder "
                         f"(gymnasium's ALE envs); supported: {list(VIDEO_ALE_KWARGS)}")
    if os.path.isfile(video_folder):
        raise ValueError(f"video_folder {str(video_folder)!r} is a file, not a folder")
    for name, value in (("max_num_frames_per_episode", max_num_frames_per_episode), ("frameskip", frameskip),
                        ("stack_num", stack_num), ("img_height", img_height), ("img_width", img_width)):
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    require_extra("Atari with video_folder", "cv2", "video")  # AtariPreprocessing resizes with it

    def make(index: int) -> gym.Env:
        env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=repeat_action_probability,
                       full_action_space=full_action_space, max_num_frames_per_episode=None,  # truncation below
                       obs_type="grayscale" if grayscale else "rgb", render_mode="rgb_array" if index == 0 else None)
        if index == 0:  # every frame the emulator draws, in colour; the Atari runs at 60 frames a second
            env = RecordEndedEpisodes(env, video_folder, fps=60)
        env = _LikeAtariVectorEnv(env, noop_max, use_fire_reset, max_num_frames_per_episode)
        env = gym.wrappers.AtariPreprocessing(env, noop_max=0, frame_skip=frameskip,
                                              screen_size=(img_width, img_height), terminal_on_life_loss=False,
                                              grayscale_obs=grayscale)
        return gym.wrappers.FrameStackObservation(env, stack_num, padding_type="zero")

    return gym.vector.SyncVectorEnv([lambda i=i: make(i) for i in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
