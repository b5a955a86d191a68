"""Environments: every env is a `leanrl.VectorEnv` (leanrl/env.py: torch tensors in and out on the run's device),
built by `make_env` from its id: Atari (ale-py), gymnasium and MuJoCo, and the torch/ envs stepped on the device.
"""
import contextlib
import difflib
import os
import re

import gymnasium
import torch

from leanrl.cli import UsageError, import_user_module, require_extra

FAMILIES = ("Atari ('ALE/Breakout-v5', 'BreakoutNoFrameskip-v4'), gymnasium and MuJoCo ('HalfCheetah-v5', "
            "'CartPole-v1'), on-device torch ('torch/CartPole-v1', 'torch/Pendulum-v1'), or your own 'module:EnvId'")


def unknown_env_id(env_id: str) -> UsageError:
    """The error for an env id no family knows: the ids it most likely misspells, else the families."""
    from .torch_envs import TORCH_ENVS

    with contextlib.suppress(ImportError):
        import ale_py  # noqa: F401 (registers the ALE/ ids with gymnasium)
    close = difflib.get_close_matches(env_id, [*gymnasium.registry, *TORCH_ENVS], n=3, cutoff=0.75)
    if close:
        return UsageError(f"--env-id {env_id!r}: unknown; did you mean {', '.join(map(repr, close))}?")
    return UsageError(f"--env-id {env_id!r}: unknown; the ids: {FAMILIES}")


def check_recordable(env_id: str) -> None:
    """That `env_id` can be filmed (`video_folder`; a script's --capture-video checks it before building anything):
    the torch envs do not render, and gymnasium's RecordVideo writes with moviepy (the `video` extra)."""
    if env_id.startswith("torch/"):
        raise UsageError(f"{env_id!r} steps in torch and does not render, so it cannot record videos: use the "
                         f"gymnasium id {env_id.removeprefix('torch/')!r} (--env-id)")
    require_extra("recording videos", "moviepy", "video")


def make_env(env_id: str, num_envs: int, device="cpu", seed: int = 0, video_folder=None, normalize: bool = True,
             **kwargs):
    """Build `num_envs` copies of `env_id` on `device`; `seed` seeds the first reset(). `module:EnvId` (gymnasium's
    form) imports the module first, from the Python path or the launch directory, to register EnvId. `normalize`:
    False for raw observations, rewards and actions (TD3 and SAC, as CleanRL's); only gymnasium's continuous-action
    envs normalize them and clip actions (the Atari and torch envs never do). kwargs go to the family:
    Atari: episodic_life=True, sticky_actions=False, plus AtariVectorEnv's own (e.g. num_threads);
    gymnasium: normalize_obs, normalize_reward, clip_action, gamma, plus gymnasium.make's; torch: dtype (of the
    state).
    `video_folder` (a folder, made if missing): sub-env 0 renders rgb_array frames and gymnasium's RecordVideo
    writes every one of its episodes that ends there as an mp4; nothing else changes (the same observations,
    rewards and episode statistics for the same seed). Atari then runs on gymnasium's ALE envs (AtariVectorEnv cannot
    render: see envs/atari.py); the torch/ envs do not render."""
    device = torch.device(device)
    if ":" in env_id:  # gymnasium's `module:EnvId`, imported in every process that makes the env
        module, _, env_id = env_id.partition(":")
        try:
            import_user_module(module)
        except ImportError as e:
            raise UsageError(f"--env-id {module}:{env_id}: cannot import {module!r} ({e})") from None
        if env_id not in gymnasium.registry:
            raise UsageError(f"--env-id {module}:{env_id}: importing {module!r} registered no {env_id!r}")
    if video_folder is not None:
        if not isinstance(video_folder, (str, os.PathLike)):
            raise TypeError(f"video_folder must be a path (str or os.PathLike), got {type(video_folder).__name__}")
        check_recordable(env_id)
        kwargs["video_folder"] = video_folder
    if env_id.startswith("torch/"):
        from .torch_envs import TORCH_ENVS

        if env_id in TORCH_ENVS:
            return TORCH_ENVS[env_id](num_envs, device, seed, **kwargs)
    elif match := re.fullmatch(r"ALE/(\w+)-v5|(\w+)NoFrameskip-v4", env_id):
        from .atari import AtariEnv

        return AtariEnv(match[1] or match[2], num_envs, device, seed, **kwargs)
    elif env_id in gymnasium.registry:
        from .gym import GymEnv

        if not normalize:
            kwargs.update(normalize_obs=False, normalize_reward=False, clip_action=False)
        return GymEnv(env_id, num_envs, device, seed, **kwargs)
    raise unknown_env_id(env_id)
