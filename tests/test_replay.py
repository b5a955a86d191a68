"""leanrl.replay: the device-resident replay memory against torchrl's (its layout and checkpoint format), its
round-robin writes, uniform sampling and bound, in eager and compiled code; the off-policy burn-in."""

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch._inductor.config
from tensordict import TensorDict

import leanrl
from leanrl.replay import Replay, burn_in

FIELDS = dict(x=((2,), torch.float32), flag=((), torch.bool))


def transitions(start, n):
    return dict(x=torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 2).clone(),
                flag=torch.arange(start, start + n) % 3 == 0)


def test_writes_round_robin_within_its_capacity():
    replay = Replay(5, 3, FIELDS, "cpu")
    for start in range(0, 7, 2):  # 8 transitions in steps of 2: the first 3 overwritten
        replay.extend(transitions(start, 2))
    assert len(replay) == 5 and int(replay.cursor) == 3 and int(replay.written) == 8
    assert replay.storage["x"][:, 0].tolist() == [5.0, 6.0, 7.0, 3.0, 4.0]
    assert replay.storage["flag"].tolist() == [False, True, False, True, False]


def test_a_buffer_larger_than_the_memory_is_a_clear_error():
    """CleanRL's million Atari transitions on a small machine: one line naming the flag, before any allocation."""
    args = SimpleNamespace(buffer_size=10**9, batch_size=32)
    frames, actions = gym.spaces.Box(0, 255, (4, 84, 84), dtype=np.uint8), gym.spaces.Discrete(4)
    with pytest.raises(leanrl.UsageError, match=r"buffer_size = 1,000,000,000 transitions need 32\d{3}\.\d GiB, "
                                                r"more than the .* GiB of cpu: lower --buffer-size"):
        Replay.of_transitions(args, frames, actions, "cpu", torch.uint8, (1, 84, 84))
    small = Replay.of_transitions(SimpleNamespace(buffer_size=64, batch_size=8), frames, actions, "cpu", torch.uint8)
    assert small.storage["obs"].shape == (64, 4, 84, 84) and small.storage["next_obs"].shape == (64, 4, 84, 84)


def test_samples_uniformly_from_what_it_holds_only():
    replay = Replay(10_000, 10_000, FIELDS, "cpu")
    replay.extend(transitions(0, 4))
    torch.manual_seed(0)
    counts = torch.bincount(replay.sample()["x"][:, 0].long(), minlength=4)
    assert counts.sum() == 10_000 and counts.min() > 2300 and counts.max() < 2700  # 2500 each


def test_its_checkpoint_is_torchrls_and_loads_both_ways(tmp_path):
    """state_dict() holds what torchrl's ReplayBuffer over a LazyTensorStorage holds after the same writes, loads into
    one (which then samples what it stored), and one's state_dict() loads here: old checkpoints resume."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    ours, theirs = Replay(5, 3, FIELDS, "cpu"), ReplayBuffer(storage=LazyTensorStorage(5), batch_size=3)
    for start in range(0, 7, 2):
        ours.extend(transitions(start, 2))
        theirs.extend(TensorDict(transitions(start, 2), batch_size=[2]))
    saved, expected = ours.state_dict(), theirs.state_dict()
    assert saved["_writer"] == expected["_writer"] and saved["_storage"]["_len"] == expected["_storage"]["_len"]
    for k in FIELDS:
        assert torch.equal(saved["_storage"]["_storage"][k], expected["_storage"]["_storage"][k]), k
    leanrl.save_checkpoint(str(tmp_path / "c.pt"), {"ours": saved, "theirs": expected})
    state = leanrl.load_checkpoint(str(tmp_path / "c.pt"))
    loaded = ReplayBuffer(storage=LazyTensorStorage(5), batch_size=3)
    loaded.extend(TensorDict(transitions(0, 1), batch_size=[1]))  # torchrl loads into an allocated storage
    loaded.load_state_dict(state["ours"])
    assert torch.equal(loaded[:]["x"], theirs[:]["x"])
    restored = Replay(5, 3, FIELDS, "cpu")
    restored.load_state_dict(state["theirs"])
    assert all(torch.equal(restored.storage[k], ours.storage[k]) for k in FIELDS)
    for replay in (ours, restored):  # the cursor came back too
        replay.extend(transitions(99, 1))
    assert torch.equal(restored.storage["x"], ours.storage["x"])


def test_a_buffer_of_other_shapes_is_a_clear_error():
    other = Replay(5, 3, dict(x=((3,), torch.float32), flag=((), torch.bool)), "cpu")
    with pytest.raises(ValueError, match=r"replay buffer holds flag \[\], x \[3\], this run's flag \[\], x \[2\]"):
        Replay(5, 3, FIELDS, "cpu").load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="batch_size = 6 is larger than the capacity 5"):
        Replay(5, 6, FIELDS, "cpu")


@torch._inductor.config.patch(fallback_random=True)  # compiled code draws eager's random numbers
def test_compiled_in_one_graph_it_writes_and_samples_what_eager_does():
    batches = []
    for compiled in (False, True):
        replay = Replay(7, 4, FIELDS, "cpu")

        def step(t):
            replay.extend(t)
            return replay.sample()

        fn = torch.compile(step, fullgraph=True) if compiled else step
        torch.manual_seed(0)
        batches.append([fn(transitions(start, 3)) for start in range(0, 15, 3)])
        batches[-1].append(dict(replay.storage))
    for eager, compiled in zip(*batches):
        for k in eager:
            assert torch.equal(compiled[k], eager[k]), k


def test_burn_in_counts_the_iterations_to_the_nth_update():
    class Args:
        num_envs, learning_starts = 2, 10

    assert burn_in(Args, 0, 0, 7) * 2 == 10 + 2 * 7  # an update per iteration after learning starts
    assert burn_in(Args, 40, 40, 1) * 2 == 10 + 2  # resumed without the buffer at step 40: it fills again
