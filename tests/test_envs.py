import io
import math
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from leanrl.envs import make_env


def _gym_env(env_id):
    env = gym.make(env_id)
    env.reset(seed=0)
    return env


def test_cartpole_matches_gymnasium_step_for_step():
    n = 8
    env = make_env("torch/CartPole-v1", n, seed=0)
    env.reset()
    refs = [_gym_env("CartPole-v1") for _ in range(n)]
    for i, ref in enumerate(refs):
        ref.unwrapped.state = env.state[i].numpy().copy()
    gen = torch.Generator().manual_seed(0)
    terminations = 0
    for _ in range(300):
        action = torch.randint(0, 2, (n,), generator=gen)
        td = env.step(action)
        for i, ref in enumerate(refs):
            obs, reward, terminated, truncated, _ = ref.step(int(action[i]))
            np.testing.assert_allclose(td["final_obs"][i].numpy(), obs, atol=1e-5)
            assert td["reward"][i].item() == reward == 1.0
            assert td["terminated"][i].item() == terminated and td["truncated"][i].item() == truncated
            if terminated:  # auto-reset in the same step: a fresh state in gymnasium's reset range
                terminations += 1
                assert (env.state[i].abs() <= 0.05).all() and env.steps[i] == 0
                assert torch.equal(td["next_obs"][i], env.state[i].float())
                assert td["episode_length"][i] > 0 and td["episode_return"][i] == td["episode_length"][i]
                ref.reset()
                ref.unwrapped.state = env.state[i].numpy().copy()
            else:
                assert torch.equal(td["next_obs"][i], td["final_obs"][i]) and td["episode_length"][i] == 0
    assert terminations > 20


def test_cartpole_truncates_at_500():
    env = make_env("torch/CartPole-v1", 2)
    env.reset()
    sd = env.state_dict()
    sd["steps"][:] = 499
    sd["state"][:] = 0.0  # upright and still: the 500th step cannot terminate
    env.load_state_dict(sd)
    td = env.step(torch.tensor([0, 1]))
    assert td["truncated"].all() and not td["terminated"].any()
    assert (td["episode_length"] == 500).all() and (env.steps == 0).all()
    assert (td["final_obs"][:, 1].abs() > 0.19).all()  # one push of the cart: x_dot = +-0.195
    assert (env.state.abs() <= 0.05).all() and torch.equal(td["next_obs"], env.state.float())


def test_pendulum_matches_gymnasium_and_truncates_at_200():
    n = 4
    env = make_env("torch/Pendulum-v1", n, seed=1)
    env.reset()
    refs = [_gym_env("Pendulum-v1") for _ in range(n)]  # with its TimeLimit(200)
    for i, ref in enumerate(refs):
        ref.unwrapped.state = env.state[i].numpy().copy()
    gen = torch.Generator().manual_seed(0)
    returns = np.zeros(n)
    for t in range(200):
        action = torch.rand(n, 1, generator=gen) * 6 - 3  # beyond max_torque: tests the clipping
        td = env.step(action)
        for i, ref in enumerate(refs):
            obs, reward, terminated, truncated, _ = ref.step(action[i].numpy())
            returns[i] += reward
            np.testing.assert_allclose(td["final_obs"][i].numpy(), obs, atol=1e-5)
            np.testing.assert_allclose(td["reward"][i].item(), reward, rtol=1e-5, atol=1e-5)
            assert not td["terminated"][i] and td["truncated"][i].item() == truncated == (t == 199)
    np.testing.assert_allclose(td["episode_return"].numpy(), returns, rtol=1e-4)
    assert (td["episode_length"] == 200).all()
    assert (env.state[:, 0].abs() <= math.pi).all() and (env.state[:, 1].abs() <= 1).all()
    assert not torch.equal(td["next_obs"], td["final_obs"])


def test_torch_env_step_compiles_and_matches_eager():
    eager, compiled = make_env("torch/CartPole-v1", 64), make_env("torch/CartPole-v1", 64)
    eager.reset(seed=0)
    compiled.load_state_dict(eager.state_dict())
    step = torch.compile(compiled.step, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    resets = 0
    with torch._inductor.config.patch(fallback_random=True):  # the same random resets as eager
        for t in range(40):
            action = torch.randint(0, 2, (64,), generator=gen)
            torch.manual_seed(t)
            expected = eager.step(action)
            torch.manual_seed(t)
            got = step(action)
            for key in expected.keys():
                torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6)
            resets += expected["terminated"].sum().item()
    assert resets > 0
    torch.testing.assert_close(compiled.state, eager.state)


def _play_games(env, max_steps=5000):
    """Random actions until every env has finished one game; per env: (raw rewards, terminated flags, td at game
    end)."""
    rewards, terms, ends = [[] for _ in range(env.num_envs)], [[] for _ in range(env.num_envs)], {}
    env.reset(seed=0)
    for _ in range(max_steps):
        td = env.step(torch.randint(0, env.single_action_space.n, (env.num_envs,)))
        game_over = td["terminated"] | td["truncated"]
        for i in range(env.num_envs):
            if i in ends:
                continue
            rewards[i].append(td["reward"][i].item())
            terms[i].append(td["terminated"][i].item())
            if td["episode_length"][i] > 0:
                ends[i] = {key: x[i] for key, x in td.items()}
            elif game_over[i]:  # a life lost: the game goes on, so final_obs is next_obs
                assert torch.equal(td["final_obs"][i], td["next_obs"][i])
        if len(ends) == env.num_envs:
            return rewards, terms, ends
    raise AssertionError("no game finished")


@pytest.mark.parametrize("env_id, lives", [("BreakoutNoFrameskip-v4", 5), ("ALE/SpaceInvaders-v5", 3)])
def test_atari_episode_return_spans_all_lives(env_id, lives):
    env = make_env(env_id, 2)
    obs = env.reset()
    assert obs.dtype == torch.uint8 and obs.shape == (2, 4, 84, 84) and obs.device.type == "cpu"
    rewards, terms, ends = _play_games(env)
    for i in range(2):
        assert ends[i]["episode_return"].item() == sum(rewards[i])
        assert ends[i]["episode_length"].item() == len(rewards[i])
        assert sum(terms[i]) == lives  # every lost life is terminal for learning
        assert not torch.equal(ends[i]["final_obs"], ends[i]["next_obs"])  # a new game
    if "SpaceInvaders" in env_id:
        assert max(max(r) for r in rewards) > 1  # raw game rewards, not clipped
    env.close()


def test_atari_without_episodic_life_terminates_only_at_game_over():
    env = make_env("BreakoutNoFrameskip-v4", 1, episodic_life=False)
    rewards, terms, ends = _play_games(env)
    assert sum(terms[0]) == 1 and terms[0][-1]


def test_unknown_atari_game_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown Atari game 'Breakoutt'.*Breakout"):
        make_env("ALE/Breakoutt-v5", 1)


def test_halfcheetah_final_obs_normalized_like_next_obs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # mujoco writes MUJOCO_LOG.TXT (a deprecation warning) into the cwd
    kwargs = dict(num_envs=2, seed=3, max_episode_steps=20)
    env = make_env("HalfCheetah-v5", **kwargs)
    raw = make_env("HalfCheetah-v5", normalize_obs=False, normalize_reward=False, **kwargs)
    norm = lambda x: np.clip((x - env.obs_rms.mean) / np.sqrt(env.obs_rms.var + 1e-8), -10, 10).astype(np.float32)
    obs, raw_obs = env.reset(), raw.reset()
    assert obs.dtype == raw_obs.dtype == torch.float32 and obs.shape == (2, 17)
    gen = torch.Generator().manual_seed(0)
    for t in range(20):
        action = torch.rand(2, 6, generator=gen) * 2 - 1
        td, raw_td = env.step(action), raw.step(action)
        assert env.obs_rms.count == pytest.approx(1e-4 + 2 * (t + 2))  # updated once per step
        np.testing.assert_allclose(td["next_obs"].numpy(), norm(raw_td["next_obs"].numpy()), atol=1e-5)
        np.testing.assert_allclose(td["final_obs"].numpy(), norm(raw_td["final_obs"].numpy()), atol=1e-5)
    assert td["truncated"].all() and not torch.equal(raw_td["final_obs"], raw_td["next_obs"])
    # raw episodic return, normalized reward
    torch.testing.assert_close(td["episode_return"], raw_td["episode_return"])
    assert not torch.allclose(td["reward"], raw_td["reward"])


def test_halfcheetah_state_dict_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kwargs = dict(num_envs=2, max_episode_steps=20)
    env = make_env("HalfCheetah-v5", seed=0, **kwargs)
    env.reset()
    for _ in range(30):
        env.step(torch.rand(2, 6) * 2 - 1)
    buffer = io.BytesIO()
    torch.save(env.state_dict(), buffer)
    buffer.seek(0)
    sd = torch.load(buffer, weights_only=True)
    action = torch.rand(2, 6) * 2 - 1
    reset_and_step = lambda e: (e.reset(seed=7), e.step(action))
    obs_a, td_a = reset_and_step(env)
    resumed = make_env("HalfCheetah-v5", seed=1, **kwargs)
    resumed.load_state_dict(sd)
    obs_b, td_b = reset_and_step(resumed)
    assert torch.equal(obs_a, obs_b) and torch.equal(td_a["next_obs"], td_b["next_obs"])
    assert torch.equal(td_a["reward"], td_b["reward"])
    obs_c, _ = reset_and_step(make_env("HalfCheetah-v5", seed=1, **kwargs))
    assert not torch.equal(obs_a, obs_c)  # without the statistics the run would differ


def test_an_unknown_env_id_is_one_short_line_with_its_close_matches():
    with pytest.raises(ValueError, match=r"^--env-id 'CartPol-v1': unknown; did you mean 'CartPole-v1', .*\?$"):
        make_env("CartPol-v1", 1)
    with pytest.raises(ValueError, match=r"^--env-id 'Breakout-v5': unknown; did you mean .*'ALE/Breakout-v5'"):
        make_env("Breakout-v5", 1)
    for env_id in ("NotAnEnv-v0", "torch/Acrobat-v1"):  # nothing close: the families, with examples
        with pytest.raises(ValueError) as err:
            make_env(env_id, 1)
        assert len(str(err.value)) < 250 and str(err.value).startswith(f"--env-id {env_id!r}: unknown; the ids: ")
        for example in ("ALE/Breakout-v5", "BreakoutNoFrameskip-v4", "HalfCheetah-v5", "torch/CartPole-v1"):
            assert example in str(err.value)


def test_your_own_gymnasium_env_by_module_and_id(tmp_path, monkeypatch):
    """gymnasium's `module:EnvId`: the module (here in the launch directory, as a user's would be) is imported and
    registers the env; a module that cannot be imported, or registers no such id, is a clear error."""
    (tmp_path / "my_envs.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('ShortCartPole-v0', entry_point='gymnasium.envs.classic_control.cartpole:CartPoleEnv',\n"
        "             max_episode_steps=20)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_envs", raising=False)
    monkeypatch.delitem(gym.registry, "ShortCartPole-v0", raising=False)
    envs = make_env("my_envs:ShortCartPole-v0", 2, seed=0)
    assert gym.spec("ShortCartPole-v0").max_episode_steps == 20 and envs.single_action_space.n == 2
    envs.reset()
    assert envs.step(torch.zeros(2, dtype=torch.long))["reward"].tolist() == [1.0, 1.0]
    envs.close()
    with pytest.raises(ValueError, match="my_envs:Nope-v0: importing 'my_envs' registered no 'Nope-v0'"):
        make_env("my_envs:Nope-v0", 1)
    with pytest.raises(ValueError, match=r"no_such_module:Env-v0: cannot import 'no_such_module' \(No module named"):
        make_env("no_such_module:Env-v0", 1)


def test_missing_optional_dependency_names_the_extra():
    code = """
import sys
sys.modules["ale_py"] = sys.modules["mujoco"] = None  # as if not installed
from leanrl.envs import make_env
for env_id, extra in (("ALE/Breakout-v5", "'leanrl[atari]'"), ("HalfCheetah-v5", "'leanrl[mujoco]'")):
    try:
        make_env(env_id, 1)
    except ImportError as e:
        assert extra in str(e), e
    else:
        raise AssertionError(env_id)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def _video_frames(path):
    """(frame count, (width, height), whether any pixel has colour) of an mp4, read back with ffmpeg."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    width, height = next(reader)["size"]
    frames = [np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]
    colour = any((f.max(axis=2).astype(int) - f.min(axis=2) > 30).any() for f in frames)
    return len(frames), (width, height), colour


@pytest.mark.slow
def test_atari_video_records_sub_env_0_and_matches_ale_vector_env(tmp_path):
    # sticky actions and a frame limit: the gymnasium-ALE path must reproduce the C++ repeats and truncation too
    kwargs = dict(num_envs=2, seed=1, sticky_actions=True, max_num_frames_per_episode=616)  # 154 steps
    folder = tmp_path / "videos"
    env, ref = make_env("ALE/Breakout-v5", video_folder=folder, **kwargs), make_env("BreakoutNoFrameskip-v4", **kwargs)
    assert env.single_observation_space == ref.single_observation_space
    assert env.single_action_space == ref.single_action_space
    obs = env.reset()
    assert obs.shape == (2, 4, 84, 84) and obs.dtype == torch.uint8 and torch.equal(obs, ref.reset())
    gen = torch.Generator().manual_seed(0)
    returns, ends = np.zeros(2), {}
    for step in range(1, 301):
        action = torch.randint(0, 4, (2,), generator=gen)
        td, ref_td = env.step(action), ref.step(action)
        for key in ref_td.keys():  # the same numbers as AtariVectorEnv for the same seed and actions
            assert torch.equal(td[key], ref_td[key]), key
        assert td["next_obs"].shape == (2, 4, 84, 84) and td["next_obs"].dtype == torch.uint8
        returns += td["reward"].numpy()
        for i in range(2):
            if i not in ends and td["episode_length"][i] > 0:
                ends[i] = (step, returns[i], {key: x[i] for key, x in td.items()})
                if i == 0:  # its video is written when its episode ends
                    assert [p.name for p in folder.iterdir()] == ["rl-video-episode-0.mp4"]
        if len(ends) == 2:
            break
    else:
        raise AssertionError("no episode ended")
    for length, ret, end in ends.values():
        assert end["episode_length"].item() == length and end["episode_return"].item() == ret
        assert not torch.equal(end["final_obs"], end["next_obs"])
    kinds = {"terminated" if end["terminated"] else "truncated" for *_, end in ends.values()}
    assert kinds == {"terminated", "truncated"}  # seed 1: sub-env 0 loses its last life, sub-env 1 hits the limit
    length = ends[0][0]
    frames, size, colour = _video_frames(folder / "rl-video-episode-0.mp4")
    # every emulator frame of the episode: 4 a step (fewer in the last), plus the reset's FIRE and up to 29 noops
    assert 4 * length - 2 <= frames <= 4 * length + 32 and size == (160, 210) and colour
    env.close()  # drops the episode under way: it did not end
    assert [p.name for p in folder.iterdir()] == ["rl-video-episode-0.mp4"]


def test_a_video_keeps_only_the_episodes_that_end(tmp_path):
    """The episode that autoreset begins after an evaluation's last one is cut by the next evaluation's seeded
    reset, or by close(): no video of it (RecordVideo wrote a 1-frame mp4 for each)."""
    pytest.importorskip("pygame")
    folder = tmp_path / "videos"
    env = make_env("CartPole-v1", 2, video_folder=folder)
    for seed in (1, 2):  # two evaluations
        env.reset(seed=seed)
        while not env.step(torch.zeros(2, dtype=torch.long))["episode_length"][0]:  # always left: it falls
            pass
        env.step(torch.zeros(2, dtype=torch.long))  # sub-env 0 goes on into the next episode
    env.close()
    videos = sorted(folder.iterdir())
    assert [p.name for p in videos] == ["rl-video-episode-0.mp4", "rl-video-episode-1.mp4"]
    assert all(_video_frames(p)[0] > 5 for p in videos)


@pytest.mark.slow
def test_mujoco_video_records_every_episode_and_changes_no_number(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MUJOCO_GL", raising=False)  # the default this machine gets
    kwargs = dict(num_envs=2, seed=3, max_episode_steps=12)
    folder = tmp_path / "videos"
    try:
        env = make_env("InvertedPendulum-v5", video_folder=folder, **kwargs)
    except RuntimeError as e:
        if "cannot render" in str(e):
            pytest.skip(f"no OpenGL backend for MuJoCo here: {e}")
        raise
    ref = make_env("InvertedPendulum-v5", **kwargs)
    assert torch.equal(env.reset(), ref.reset())
    gen = torch.Generator().manual_seed(0)
    lengths = []
    while len(lengths) < 3:
        action = torch.rand(2, 1, generator=gen) * 2 - 1
        td, ref_td = env.step(action), ref.step(action)
        for key in ref_td.keys():  # rendering changes no number, normalization statistics included
            assert torch.equal(td[key], ref_td[key]), key
        if td["episode_length"][0] > 0:
            lengths.append(td["episode_length"][0].item())
    assert env.obs_rms.count == ref.obs_rms.count and np.array_equal(env.obs_rms.mean, ref.obs_rms.mean)
    videos = sorted(folder.iterdir())
    assert [p.name for p in videos] == [f"rl-video-episode-{i}.mp4" for i in range(3)]
    for path, length in zip(videos, lengths):
        frames, size, colour = _video_frames(path)
        assert length <= frames <= length + 1 and size == (480, 480) and colour  # the reset's frame and each step's
    env.close()


def test_video_folder_errors_name_the_input(tmp_path, monkeypatch):
    folder = tmp_path / "videos"
    for env_id in ("torch/CartPole-v1", "torch/Pendulum-v1"):
        with pytest.raises(ValueError, match=f"'{env_id}'.*does not render.*'{env_id[6:]}'"):
            make_env(env_id, 2, video_folder=folder)
    monkeypatch.setitem(sys.modules, "pygame", None)  # as if not installed, whether or not it is
    with pytest.raises(ImportError, match="CartPole-v1 cannot render.*pygame"):
        make_env("CartPole-v1", 2, video_folder=folder)
    with pytest.raises(ValueError, match="batch_size"):
        make_env("ALE/Breakout-v5", 2, video_folder=folder, batch_size=1)
    with pytest.raises(TypeError, match="video_folder"):
        make_env("ALE/Breakout-v5", 2, video_folder=1)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="video_folder .* is a file"):
        make_env("ALE/Breakout-v5", 2, video_folder=tmp_path / "file")
    assert not folder.exists()  # nothing was made


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("env_id, kwargs", [("CartPole-v1", {}), ("HalfCheetah-v5", dict(max_episode_steps=15)),
                                            ("BreakoutNoFrameskip-v4", dict(max_num_frames_per_episode=120))])
def test_a_step_packed_for_one_device_copy_is_the_step(env_id, kwargs, device, tmp_path, monkeypatch):
    """The packed path of a GPU run (every array in one buffer, one host-to-device copy, final_obs rows only where
    an episode ended), on the GPU and forced on a CPU, against the CPU's unpacked step: the same tensors, dtypes and
    shapes at every step, episode ends included; on a GPU, one host-to-device copy per step."""
    monkeypatch.chdir(tmp_path)  # mujoco writes MUJOCO_LOG.TXT into the cwd
    plain, packed = make_env(env_id, 3, seed=5, **kwargs), make_env(env_id, 3, device, seed=5, **kwargs)
    packed.to_device.pack = True
    assert torch.equal(plain.reset(), packed.reset().cpu())
    gen, ended = torch.Generator().manual_seed(0), 0
    space = plain.single_action_space
    for t in range(60):
        action = (torch.randint(int(space.n), (3,), generator=gen) if hasattr(space, "n") else
                  torch.rand(3, *space.shape, generator=gen) * 2 - 1)
        a, action = plain.step(action), action.to(device)
        if device == "cuda" and t == 30:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                b = packed.step(action)
                torch.cuda.synchronize()
            assert sum(e.name.startswith("Memcpy HtoD") for e in prof.events()) == 1
        else:
            b = packed.step(action)
        assert a.keys() == b.keys()
        for key in a:
            assert b[key].device.type == device and a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key].cpu()), key
        done = a["episode_length"] > 0  # an episode ended (Atari: a game, not a life)
        ended += int(done.sum())
        if done.any() and not done.all():
            assert not torch.equal(b["final_obs"], b["next_obs"])  # the final rows went in, the others are next_obs
    assert ended >= 3
    plain.close(), packed.close()


@pytest.mark.parametrize("env_id,kwargs", [("CartPole-v1", {}), ("CartPole-v1", {"vectorization_mode": "async"}),
                                           ("BreakoutNoFrameskip-v4", {})])
def test_env_buffers_step_as_one_vector_env_of_their_envs(env_id, kwargs):
    """Two buffers of 2 envs, seeded on as one vector env of 4 seeds its envs: `step` (each buffer's send, then
    each's recv, in the background: ALE's threads, a gymnasium env's own thread or its worker processes) returns what
    the 4-env vector env returns, step for step."""
    if env_id.startswith("Breakout"):
        pytest.importorskip("ale_py")
    import functools

    import leanrl
    one = make_env(env_id, 4, seed=5)
    buffers = leanrl.EnvBuffers.of(functools.partial(make_env, env_id, **kwargs), 4, 2, seed=5)
    torch.testing.assert_close(buffers.reset(), one.reset())
    generator = torch.Generator().manual_seed(0)
    ended = 0
    for _ in range(300):
        action = torch.randint(0, one.single_action_space.n, (4,), generator=generator)
        expected, got = one.step(action), buffers.step(action)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], msg=key)
        ended += int((expected["episode_length"] > 0).sum())
    assert ended > 0
    one.close()
    buffers.close()


def test_async_gymnasium_buffers_step_as_threaded_ones(recwarn):
    """MuJoCo in two buffers: each buffer's envs in worker processes (gymnasium's AsyncVectorEnv) step as on the
    buffer's thread, through the same wrappers (actions clipped, observations and rewards normalized per buffer);
    a buffer closed with a step sent and not received closes without a warning."""
    pytest.importorskip("mujoco")
    import functools

    import leanrl
    threaded = leanrl.EnvBuffers.of(functools.partial(make_env, "HalfCheetah-v5"), 4, 2, seed=5)
    processes = leanrl.EnvBuffers.of(functools.partial(make_env, "HalfCheetah-v5", vectorization_mode="async"), 4, 2,
                                     seed=5)
    assert isinstance(processes.buffers[0].env.unwrapped, leanrl.gym_adapter.SendingAsyncVectorEnv)
    torch.testing.assert_close(processes.reset(), threaded.reset())
    generator, ended = torch.Generator().manual_seed(0), 0
    for _ in range(1010):  # past the end of an episode (1,000 steps): the final observations
        action = 2 * torch.randn(4, 6, generator=generator)  # outside the bounds: clipped
        expected, got = threaded.step(action), processes.step(action)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], msg=key)
        ended += int((expected["episode_length"] > 0).sum())
    assert ended == 4
    processes.buffers[0].send(action[:2])
    threaded.close()
    processes.close()
    assert not [w for w in recwarn if "pending call" in str(w.message)]


def test_env_buffers_statistics_are_those_of_one_normalizer_over_all_their_envs():
    """Each buffer normalizes with its own running statistics; `statistics()` (what an evaluation's envs load) pools
    them: equal to those of one 4-env vector env of the same seeds, whose one normalizer saw every env's
    observations and returns."""
    import functools

    import leanrl
    one = make_env("Pendulum-v1", 4, seed=5)
    buffers = leanrl.EnvBuffers.of(functools.partial(make_env, "Pendulum-v1"), 4, 2, seed=5)
    one.reset(), buffers.reset()
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        action = 2 * torch.rand(4, 1, generator=generator) - 1
        one.step(action), buffers.step(action)
    expected, got = one.statistics(), buffers.statistics()
    assert expected.keys() == got.keys() == {"obs_rms", "return_rms"}
    assert not torch.allclose(buffers.buffers[0].statistics()["obs_rms"]["mean"], expected["obs_rms"]["mean"])
    for name in expected:
        for key in ("mean", "var"):  # (each normalizer starts from a prior of count 1e-4)
            torch.testing.assert_close(got[name][key], expected[name][key], rtol=1e-5, atol=1e-7, msg=name + key)
        assert abs(float(got[name]["count"]) - float(expected[name]["count"])) < 1e-3
    one.close(), buffers.close()


@pytest.mark.parametrize("vector_env", ["SyncVectorEnv", "SendingAsyncVectorEnv"])
def test_an_error_in_an_env_stepping_in_the_background_is_raised_by_recv(vector_env):
    """A gymnasium env stepped in the background (a buffer's: on its own thread, or in a worker process): its
    exception reaches the caller at `recv`, and the env closes."""
    import leanrl
    from leanrl.gym_adapter import SendingAsyncVectorEnv

    class Breaks(gym.Wrapper):
        def step(self, action):
            raise RuntimeError("the simulator broke")

    make = {"SyncVectorEnv": gym.vector.SyncVectorEnv, "SendingAsyncVectorEnv": SendingAsyncVectorEnv}[vector_env]
    env = leanrl.TorchVectorEnv(make([lambda: Breaks(gym.make("CartPole-v1"))],
                                     autoreset_mode=gym.vector.AutoresetMode.SAME_STEP))
    env.background = True
    env.reset(seed=0)
    env.send(torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="the simulator broke"):
        env.recv()
    env.close()
