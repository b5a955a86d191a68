"""A gymnasium vector env as the vector env the algorithm files step: torch tensors in and out.

    envs = leanrl.TorchVectorEnv(gym.make_vec("CartPole-v1", 4, vectorization_mode="sync",
                                              vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}))

`reset(seed) -> obs`; `step(action) -> {next_obs, final_obs, reward, terminated, truncated, episode_return,
episode_length}`: with SAME_STEP autoreset `next_obs` is already reset where an episode ended and
`final_obs` is that episode's true last observation (what a truncated episode bootstraps from). Episode returns
are raw: recorded by the env's own `RecordEpisodeStatistics` when it has one (below any reward wrapper), else by
one added here. `state_dict()` is empty: a host simulator's episodes cannot be restored, so a resumed run starts
new episodes (subclasses add what can be restored, e.g. normalization statistics). `send(action)` then `recv()` is
`step(action)` in two halves; with `background` (set by `leanrl.EnvBuffers`) the env steps between the two while
the caller computes: a `SendingAsyncVectorEnv` in its worker processes, any other vector env on a thread of its own.
"""

import queue
import threading

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.wrappers.vector import RecordEpisodeStatistics


def to_device(x, device: torch.device):
    """Move a CPU tensor to `device`; on CUDA through pinned memory, so the copy does not block."""
    if device.type == "cpu":
        return x
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class StepToDevice:
    """A host env step's arrays as the step's dict of tensors on `device`, in one host-to-device copy: every array
    the env returns is packed into one host buffer (pinned on CUDA, so the copy does not block) and viewed back on
    the device, and of `final_obs` only the rows of the envs whose episode ended travel (the rest is `next_obs`).
    On a CPU the arrays become tensors without a copy."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu"  # (a CPU's tensors share the arrays' memory; tests pack there too)
        self.layout = None  # name -> (byte offset, shape, dtype) in the packed buffer, fixed by the first step
        self.copied = None  # (CUDA) the last copy out of the host buffer, awaited before the buffer is written again

    def __call__(self, next_obs: np.ndarray, done: np.ndarray, final_rows: np.ndarray | None, **arrays) -> dict:
        """`final_rows`: the final observations of the envs where `done` (None where none is); `arrays`: the
        step's other per-env arrays, returned under their names."""
        if not self.pack:
            final_obs = next_obs.copy()
            if final_rows is not None:
                final_obs[done] = final_rows
            return dict(next_obs=torch.from_numpy(next_obs), final_obs=torch.from_numpy(final_obs),
                        **{name: torch.from_numpy(a) for name, a in arrays.items()})
        ended = np.flatnonzero(done)
        parts = dict(next_obs=next_obs, **arrays, ended=ended)
        if self.layout is None:
            self._allocate(parts)
        if self.copied is not None:
            self.copied.synchronize()  # long done in practice: the policy's action came to the host since
        for name, a in parts.items():
            self.views[name][: len(a)] = a
        if final_rows is not None:
            self.views["final_rows"][: len(ended)] = final_rows
        # the packed bytes up to this step's last final row (final_rows is last in the buffer)
        size = self.layout["final_rows"][0] + len(ended) * (next_obs.nbytes // len(next_obs))
        packed = torch.empty(size, dtype=torch.uint8, device=self.device)  # new memory: the last step's stays
        packed.copy_(self.host[:size], non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        out = {name: self._view(packed, name, len(ended) if name in ("ended", "final_rows") else len(next_obs))
               for name in self.layout}
        ended, final_rows = out.pop("ended"), out.pop("final_rows")
        out["final_obs"] = out["next_obs"].clone()
        if len(ended):
            out["final_obs"].index_copy_(0, ended, final_rows)
        return out

    def _allocate(self, parts: dict):
        """The buffer's layout: each array at an 8-byte aligned offset, room for every env's index and final row."""
        n = len(parts["next_obs"])
        shapes = {name: a.shape for name, a in parts.items()} | {"ended": (n,), "final_rows": parts["next_obs"].shape}
        dtypes = {name: a.dtype for name, a in parts.items()} | {"final_rows": parts["next_obs"].dtype}
        self.layout, size = {}, 0
        for name in (*parts, "final_rows"):
            dtype = torch.from_numpy(np.empty(0, dtypes[name])).dtype
            self.layout[name] = (size, shapes[name], dtype)
            size += -(-int(np.prod(shapes[name], dtype=np.int64)) * dtype.itemsize // 8) * 8
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.views = {name: self._view(self.host, name, shape[0]).numpy()
                      for name, (_, shape, _) in self.layout.items()}

    def _view(self, packed: torch.Tensor, name: str, rows: int) -> torch.Tensor:
        """`name`'s first `rows` rows in the packed bytes."""
        offset, shape, dtype = self.layout[name]
        shape = (rows, *shape[1:])
        count = int(np.prod(shape, dtype=np.int64))
        return packed[offset: offset + count * dtype.itemsize].view(dtype).view(shape)


class SendingAsyncVectorEnv(AsyncVectorEnv):
    """gymnasium's AsyncVectorEnv (each env in a worker process, observations in shared memory) whose `step`, while
    a step sent with `step_async` is under way, waits for that step: so `leanrl.TorchVectorEnv` sends a step below
    the vector wrappers and receives it through them."""

    def step(self, actions):
        if self._state == AsyncState.WAITING_STEP:
            return self.step_wait()
        return super().step(actions)


def _records_episodes(env) -> bool:
    while env is not None:
        if isinstance(env, RecordEpisodeStatistics):
            return True
        env = getattr(env, "env", None)
    return False


class TorchVectorEnv:
    on_device = False  # stepped on the host: algorithms do not compile or capture `step`
    obs_dtype = torch.float32
    background = False  # step between send and recv while the caller computes (leanrl.EnvBuffers sets it)
    _worker = None

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
        self.processes = isinstance(env.unwrapped, SendingAsyncVectorEnv)  # in the background: its worker processes
        self.to_device = StepToDevice(device)

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
        done = terminated | truncated
        final_rows = self.normalize_obs(np.stack(info["final_obs"][done]), update=False) if done.any() else None
        episode = info.get("episode", {"r": np.zeros(self.num_envs), "l": np.zeros(self.num_envs, dtype=np.int64)})
        return self.to_device(
            np.asarray(next_obs, dtype=np.float32), done,
            None if final_rows is None else np.asarray(final_rows, dtype=np.float32),
            reward=np.asarray(reward, dtype=np.float32), terminated=terminated, truncated=truncated,
            episode_return=episode["r"].astype(np.float32), episode_length=episode["l"].astype(np.int64))

    def send(self, action: torch.Tensor) -> None:
        if not self.background:
            self.action = action  # stepped in recv
            return
        if self.processes:  # its workers step, recv's `step` waits for them
            self.action = action
            self.env.unwrapped.step_async(self._env_actions(action))
            return
        if self._worker is None:
            self._inbox, self._outbox = queue.SimpleQueue(), queue.SimpleQueue()
            self._worker = threading.Thread(target=self._step_sent, name="leanrl-env", daemon=True)
            self._worker.start()
        self._inbox.put(action)

    def recv(self) -> dict:
        if not self.background or self.processes:
            return self.step(self.action)
        out = self._outbox.get()
        if isinstance(out, BaseException):  # raised in the env's thread: raised here, with its traceback
            raise out
        return out

    def _env_actions(self, action: torch.Tensor) -> np.ndarray:
        """The actions the vector env below the wrappers steps with (after ClipAction's clipping)."""
        actions, env = action.cpu().numpy(), self.env
        while isinstance(env, gym.vector.VectorWrapper):
            if isinstance(env, gym.vector.VectorActionWrapper):
                actions = env.actions(actions)
            env = env.env
        return actions

    def _step_sent(self):
        """The env's thread: a step for each action sent, until close. The simulator's step releases the GIL
        (MuJoCo's, ALE's), so the caller's Python and torch run meanwhile."""
        for action in iter(self._inbox.get, None):
            try:
                self._outbox.put(self.step(action))
            except BaseException as e:  # noqa: BLE001 (handed to recv)
                self._outbox.put(e)

    def statistics(self) -> dict:
        return {}

    def load_statistics(self, sd: dict) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        if self._worker is not None:
            self._inbox.put(None)
            self._worker.join()
        if self.processes and self.env.unwrapped._state == AsyncState.WAITING_STEP:
            self.env.unwrapped.step_wait()  # a step sent and not received (gymnasium would warn)
        self.env.close()
