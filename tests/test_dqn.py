"""DQN: the epsilon schedule and the policy that decays it in-graph, the target update hard or soft, the Atari
buffer's one stored next frame, and learning CartPole."""

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch._inductor.config
from offpolicy_helpers import ScriptedEnv, reaches, small

import leanrl
from leanrl.algorithms import dqn
from leanrl.envs import make_env


def build(**kw):
    env = ScriptedEnv(**{"action_space": gym.spaces.Discrete(2), **kw.pop("env", {})})
    return dqn.DQN(env.single_observation_space, env.single_action_space, small(dqn, **kw), "cpu")


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_the_target_update_is_hard_or_soft(tau):
    torch.manual_seed(0)
    algo = build(tau=tau)
    for p in algo.q_network.parameters():
        p.data.normal_()
    ptrs = [p.data_ptr() for p in algo.q_target.parameters()]
    before = [p.clone() for p in algo.q_target.parameters()]
    algo.target.lerp_(algo.online, tau)  # what train does every target_network_frequency steps
    for p, b, o, ptr in zip(algo.q_target.parameters(), before, algo.q_network.parameters(), ptrs):
        if tau == 1.0:
            assert torch.equal(p, o)  # exactly a copy
        else:
            torch.testing.assert_close(p, (1 - tau) * b + tau * o)
        assert p.data_ptr() == ptr


def test_the_linear_schedule_start_end_fraction():
    f = lambda t: dqn.linear_schedule(1.0, 0.05, 500.0, torch.tensor(t)).item()  # noqa: E731
    assert f(0) == pytest.approx(1.0)
    assert f(250) == pytest.approx(0.525)
    assert f(500) == pytest.approx(0.05)
    assert f(10_000) == pytest.approx(0.05)
    assert dqn.linear_schedule(1.0, 0.05, 0.0, torch.tensor(3)).item() == pytest.approx(0.05)


@pytest.mark.parametrize("compile", [False, True])
def test_the_policy_decays_epsilon_in_graph(compile):
    torch.manual_seed(0)
    # total 1000 steps, fraction 0.5: epsilon goes from 1 to 0.05 over 500 steps
    args = small(dqn, total_timesteps=1000, exploration_fraction=0.5, start_e=1.0, end_e=0.05)
    algo = build(total_timesteps=1000, exploration_fraction=0.5, start_e=1.0, end_e=0.05,
                 env=dict(action_space=gym.spaces.Discrete(4)))
    policy = leanrl.accelerate(lambda obs: dqn.policy(algo, args, obs), compile=compile)
    obs, seen = torch.randn(2, 3), []
    with torch.no_grad(), torch._inductor.config.patch(fallback_random=True):
        for _ in range(300):
            action, epsilon = policy(obs)
            seen.append(epsilon.item())
    assert algo.step.item() == 600  # the policy advanced its own counter by num_envs per call
    expected = [max(1.0 - 0.95 * (2 * k) / 500, 0.05) for k in range(300)]
    np.testing.assert_allclose(seen, expected, rtol=1e-5, atol=1e-6)


def test_the_random_action_fraction_follows_epsilon():
    torch.manual_seed(0)
    args = small(dqn, num_envs=20_000, total_timesteps=1_000_000, exploration_fraction=0.5)
    algo = build(num_envs=20_000, total_timesteps=1_000_000, exploration_fraction=0.5,
                 env=dict(num_envs=20_000, action_space=gym.spaces.Discrete(4)))
    obs = torch.randn(1, 3).expand(20_000, 3)
    greedy = algo.q_network(obs[:1]).argmax(-1)
    algo.step.fill_(250_000)  # halfway: epsilon = 1 - 0.95 / 2 = 0.525
    with torch.no_grad():
        action, epsilon = dqn.policy(algo, args, obs)
    assert epsilon.item() == pytest.approx(0.525)
    # greedy with prob 1 - eps, plus uniform over 4 actions with prob eps
    assert (action != greedy).float().mean().item() == pytest.approx(0.525 * 3 / 4, abs=0.015)


def test_an_atari_buffer_keeps_one_next_frame_and_rebuilds_the_stack(tmp_path):
    torch.manual_seed(0)
    env = make_env("BreakoutNoFrameskip-v4", 2, seed=0)
    finals = []
    step = env.step

    def recording_step(action):
        out = step(action)
        finals.append(out["final_obs"].clone())
        return out

    env.step = recording_step
    args = dqn.Args(env_id="BreakoutNoFrameskip-v4", num_envs=2, buffer_size=400, batch_size=4, learning_starts=1,
                    total_timesteps=400, train_frequency=1000, progress=False, checkpoint_every=0,
                    run_dir=str(tmp_path))
    replay = dqn.train(args, env, "cpu").replay
    env.close()
    data = replay.storage
    assert data["obs"].shape == (400, 4, 84, 84) and data["next_obs"].shape == (400, 1, 84, 84)
    rebuilt = torch.cat([data["obs"][:, 1:], data["next_obs"]], 1)
    assert torch.equal(rebuilt, torch.cat(finals))  # exactly the env's true next observations, game overs included


@pytest.mark.slow
def test_dqn_learns_cartpole(tmp_path):
    # rl-baselines3-zoo's tuned CartPole DQN (lr 2.3e-3, batch 64, a hard target update every 256 steps, one update
    # per 2 steps, exploration over 16% of the run down to 0.04) on 4 envs; CleanRL's defaults need ~10x the steps.
    assert reaches(dqn, tmp_path, "torch/CartPole-v1", 400, num_envs=4, total_timesteps=60_000, learning_rate=2.3e-3,
                   buffer_size=50_000, batch_size=64, learning_starts=1000, train_frequency=2,
                   target_network_frequency=256, exploration_fraction=0.16, end_e=0.04, log_every=250)
