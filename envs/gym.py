"""Any registered gymnasium id (MuJoCo, classic control) on a SyncVectorEnv, through `leanrl.TorchVectorEnv`.

Continuous-action ids get CleanRL's ppo_continuous_action recipe: raw episode statistics, clipped
actions, observations normalized and clipped to [-10, 10], rewards normalized and clipped to [-10, 10].
Statistics are shared by all sub-envs, and saved in checkpoints. Discrete-action ids get only the episode statistics.
The sub-envs step in this process (gymnasium's SyncVectorEnv), or with `vectorization_mode="async"` each in a worker
process of its own (`leanrl.gym_adapter.SendingAsyncVectorEnv`, observations in shared memory): sync by default, as
on a few cores worker processes cost more than they overlap.

With `video_folder`, sub-env 0 is made with render_mode="rgb_array" and wrapped in gymnasium's RecordVideo, which
writes every one of its episodes that ends there as an mp4 (moviepy; see `RecordEndedEpisodes`); the other sub-envs
do not render, and rendering changes no number. Classic control renders with pygame (the `video` extra has it);
MuJoCo with OpenGL: on a Linux machine without a display MUJOCO_GL defaults to "egl" here (gymnasium would try
GLFW, which fails there and does not fall back), unless MUJOCO_GL or PYOPENGL_PLATFORM is set. If nothing can
render, make_env says so at once.
"""
import functools
import os
import re
import sys
import warnings

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import vector as vector_wrappers
from gymnasium.wrappers.utils import RunningMeanStd

from leanrl.cli import MissingExtra, UsageError, missing_extra
from leanrl.gym_adapter import SendingAsyncVectorEnv, TorchVectorEnv


# gymnasium's MuJoCo models set `settotalmass`, which MuJoCo 4 compiles with a deprecation warning for every env made:
# noise about gymnasium's files, not the user's. Every other MuJoCo warning is printed as MuJoCo would.
MUJOCO_NOISE = ("compiler attribute 'settotalmass' is deprecated",)


def _mujoco_warning(message: str):
    if not message.startswith(MUJOCO_NOISE):
        print(f"WARNING: {message}", file=sys.stderr)


def _quiet_mujoco():
    try:
        import mujoco
    except ImportError:
        return
    mujoco.set_mju_user_warning(_mujoco_warning)


class GymEnv(TorchVectorEnv):
    def __init__(self, env_id: str, num_envs: int, device="cpu", seed: int = 0,
                 normalize_obs: bool | None = None, normalize_reward: bool | None = None,
                 clip_action: bool | None = None, gamma: float = 0.99, clip: float = 10.0, video_folder=None,
                 vectorization_mode: str = "sync", **make_kwargs):
        """normalize_obs / normalize_reward / clip_action default to True for Box action spaces, False otherwise;
        off-policy methods (TD3, SAC, whose actions are in the bounds already) pass False, as CleanRL's. `gamma` is
        the reward normalizer's discount. `video_folder`: record every episode of sub-env 0 there as mp4 (see
        above). `vectorization_mode`: "sync" or "async" (see above)."""
        if vectorization_mode not in ("sync", "async"):
            raise UsageError(f"vectorization_mode {vectorization_mode!r}: 'sync' or 'async'")
        if video_folder is not None and vectorization_mode == "async":
            raise UsageError("video_folder records sub-env 0 in this process: vectorization_mode 'sync'")
        if "mujoco" in str(gym.spec(env_id).entry_point):
            _quiet_mujoco()
        try:
            if vectorization_mode == "async":
                env = SendingAsyncVectorEnv([functools.partial(gym.make, env_id, **make_kwargs)] * num_envs,
                                            autoreset_mode=AutoresetMode.SAME_STEP)
            elif video_folder is None:
                env = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                                   vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}, **make_kwargs)
            else:
                env = _recording_vector_env(env_id, num_envs, video_folder, make_kwargs)
        except gym.error.DependencyNotInstalled as e:
            if "mujoco" in str(gym.spec(env_id).entry_point):
                raise missing_extra(env_id, "mujoco", "mujoco") from e
            raise
        space, action_space = env.single_observation_space, env.single_action_space
        if not isinstance(space, gym.spaces.Box):
            raise UsageError(f"{env_id} has a {type(space).__name__} observation space; only Box is supported")
        continuous = isinstance(action_space, gym.spaces.Box)
        normalize_obs = continuous if normalize_obs is None else normalize_obs
        normalize_reward = continuous if normalize_reward is None else normalize_reward
        env = vector_wrappers.RecordEpisodeStatistics(env)  # innermost: raw returns
        if continuous if clip_action is None else clip_action:
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

    def statistics(self) -> dict:
        """The normalizers' running statistics, shared by the sub-envs: what a policy trained on these envs needs to
        act in new ones (an evaluation's, an async collector's). Tensors, as torch.load(weights_only=True) wants."""
        return {name: {"mean": torch.tensor(rms.mean), "var": torch.tensor(rms.var),
                       "count": torch.tensor(float(rms.count), dtype=torch.float64)}
                for name, rms in self._running_stats().items()}

    def load_statistics(self, sd: dict) -> None:
        for name, rms in self._running_stats().items():
            saved = sd[name]
            rms.mean, rms.var = saved["mean"].numpy().copy(), saved["var"].numpy().copy()
            rms.count = float(saved["count"])

    def state_dict(self) -> dict:
        """The statistics, and the reward normalizer's discounted return of each sub-env."""
        sd = self.statistics()
        if self.reward_norm is not None:
            sd["accumulated_reward"] = torch.tensor(self.reward_norm.accumulated_reward)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.load_statistics(sd)
        if self.reward_norm is not None:
            self.reward_norm.accumulated_reward[:] = sd["accumulated_reward"].numpy()


class RecordEndedEpisodes(gym.wrappers.RecordVideo):
    """gymnasium's RecordVideo of every episode, less those cut short, numbered on from the videos already in the
    folder (a resumed run's follow its earlier ones instead of overwriting them). A seeded reset (the start of an
    evaluation) or close() drops the episode being recorded: the one the vector env's autoreset began after the
    last episode of an evaluation ended, which RecordVideo saved as a 1-frame mp4. Autoresets pass no seed."""

    def __init__(self, env, video_folder, **kwargs):
        with warnings.catch_warnings():  # its warning that a folder which exists is overwritten: not here
            warnings.filterwarnings("ignore", ".*Overwriting existing videos")
            super().__init__(env, str(video_folder), episode_trigger=lambda episode: True, **kwargs)
        filmed = (re.fullmatch(rf"{re.escape(self.name_prefix)}-episode-(\d+)\.mp4", name)
                  for name in os.listdir(self.video_folder))
        self.episode_id = max((int(m[1]) for m in filmed if m), default=-1)  # the next reset's is one more

    def drop_recording(self):
        if self.recording:
            self.recorded_frames, self.recording = [], False
            self.episode_id -= 1  # its number goes to the next episode: the videos stay numbered 0, 1, 2, ...

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.drop_recording()
        return super().reset(seed=seed, options=options)

    def close(self):
        self.drop_recording()
        super().close()


def _recording_vector_env(env_id: str, num_envs: int, video_folder, make_kwargs: dict) -> SyncVectorEnv:
    """What gym.make_vec(vectorization_mode="sync", SAME_STEP) builds, with sub-env 0 rendering into RecordVideo."""
    if "render_mode" in make_kwargs:
        raise ValueError(f"render_mode={make_kwargs['render_mode']!r} with video_folder: "
                         "video_folder sets it for sub-env 0")
    if os.path.isfile(video_folder):
        raise ValueError(f"video_folder {str(video_folder)!r} is a file, not a folder")
    is_mujoco = "mujoco" in str(gym.spec(env_id).entry_point)
    headless = not any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "PYOPENGL_PLATFORM"))
    if is_mujoco and sys.platform.startswith("linux") and headless:
        # gymnasium tries GLFW first, which fails without a display. It reads MUJOCO_GL when it makes the renderer
        # (in the render below, where a failure is a clear error). `import mujoco` reads it too and then loads that
        # backend's bindings, which on a machine without EGL would fail uncaught: so mujoco is imported first.
        try:
            import mujoco  # noqa: F401
        except ImportError as e:
            raise gym.error.DependencyNotInstalled(str(e)) from e
        os.environ.setdefault("MUJOCO_GL", "egl")
    first = gym.make(env_id, render_mode="rgb_array", **make_kwargs)
    try:  # fail here, not at the first step: one frame after a reset (the run's seeded reset comes after it and sets
        first.unwrapped.reset(seed=0)  # every state and random generator again); Pendulum has no state before one
        first.unwrapped.render()
    except gym.error.DependencyNotInstalled as e:
        first.close()
        raise MissingExtra(f"{env_id} cannot render for video_folder: {e}") from e
    except Exception as e:  # e.g. no OpenGL context
        first.close()
        how = (f" (MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}; headless Linux needs EGL, e.g. apt-get install libegl1, "
               "or OSMesa with MUJOCO_GL=osmesa)" if is_mujoco else "")
        raise RuntimeError(f"{env_id} cannot render for video_folder{how}: {type(e).__name__}: {e}") from e
    first = RecordEndedEpisodes(first, video_folder)
    return SyncVectorEnv([lambda: first] + [lambda: gym.make(env_id, **make_kwargs)] * (num_envs - 1),
                         autoreset_mode=AutoresetMode.SAME_STEP)
