"""What the off-policy algorithms (TD3, SAC, DQN) share: torchrl's replay buffer, its place in a checkpoint,
and a periodic deterministic evaluation on an env of its own."""

import sys

import torch
from tensordict import TensorDict
from torch.utils._pytree import tree_map
from torchrl.data import LazyTensorStorage, ReplayBuffer


def make_replay_buffer(size: int, batch_size: int, device) -> ReplayBuffer:
    """torchrl's ReplayBuffer with its storage on `device` (allocated for `size` transitions at the first
    `extend`, with the keys, shapes and dtypes of that first batch). `sample()` draws `batch_size`
    transitions uniformly, with replacement, so every batch has the same shape: what a graphed update needs."""
    if batch_size > size:
        raise ValueError(f"batch_size = {batch_size} is larger than buffer_size = {size}")
    return ReplayBuffer(storage=LazyTensorStorage(size, device=device), batch_size=batch_size)


def replay_state_dict(rb: ReplayBuffer, include: bool):
    """The buffer's contents and write cursor for a checkpoint, or None when `include` is False."""
    return rb.state_dict() if include else None


def load_replay_state_dict(rb: ReplayBuffer, state) -> bool:
    """Restore what `replay_state_dict` saved, onto the buffer's own device (a checkpoint is loaded on CPU).
    Returns False, and says so, when the checkpoint holds no buffer: the caller refills it."""
    if state is None:
        print("leanrl: this checkpoint holds no replay buffer (save one with --save-buffer); the resumed run acts "
              "with the restored policy and updates again once learning_starts new transitions are stored.",
              file=sys.stderr)
        return False
    device = rb.storage.device
    state = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state)
    if not rb.storage.initialized:
        # torchrl 0.14 loads into an empty storage without its batch size (sampling then fails): allocate it with
        # one transition of the saved shapes and dtypes first; the load below overwrites it, cursor included.
        stored = TensorDict(state["_storage"]["_storage"], batch_size=[rb.storage.max_size]).unflatten_keys(".")
        rb.extend(stored[:1])
    rb.load_state_dict(state)
    return True


@torch.no_grad()
def evaluate(policy, envs, seed: int) -> torch.Tensor:
    """Mean return of one episode in each of `envs.num_envs` environments, acting with `policy` (obs -> action),
    from a reset with `seed` (the same start states at every evaluation). Reads one flag to the host per step:
    it is meant to run every few thousand training steps, not in the hot loop."""
    obs = envs.reset(seed=seed)
    returns = finished = None
    while finished is None or not bool(finished.all()):
        out = envs.step(policy(obs))
        ended = out["episode_length"] > 0  # a whole episode ended (an Atari life loss is not one)
        if finished is None:
            returns, finished = torch.zeros_like(out["episode_return"]), torch.zeros_like(ended)
        returns = torch.where(ended & ~finished, out["episode_return"], returns)
        finished = finished | ended
        obs = out["next_obs"]
    return returns.mean()
