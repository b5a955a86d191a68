"""SAC's math by hand: the tanh-Gaussian log-probability against torch.distributions, the soft target's entropy
term and its termination, the target critic that moves after every critic step, in place."""

import gymnasium as gym
import numpy as np
import torch
import pytest
from offpolicy_helpers import PENDULUM_LEARNING, ScriptedEnv, batch, reaches, small
from torch.distributions import Normal

import leanrl
from leanrl.algorithms import sac


def test_the_log_prob_matches_torch_distributions():
    torch.manual_seed(0)
    actor = sac.Actor(3, gym.spaces.Box(np.float32([-1.0, 0.0]), np.float32([3.0, 1.0])), 16)
    obs = torch.randn(64, 3)
    torch.manual_seed(1)
    action, log_prob = sac.sample_action(actor, obs)
    torch.manual_seed(1)
    mean, log_std = actor(obs)
    x_t = Normal(mean, log_std.exp()).rsample()  # the same draw: mean + std * randn
    y_t = torch.tanh(x_t)
    expected = (Normal(mean, log_std.exp()).log_prob(x_t) - torch.log(actor.action_scale * (1 - y_t**2) + 1e-6)).sum(-1)
    torch.testing.assert_close(action, y_t * actor.action_scale + actor.action_bias)
    torch.testing.assert_close(log_prob, expected)
    assert ((action >= torch.tensor([-1.0, 0.0])) & (action <= torch.tensor([3.0, 1.0]))).all()
    assert log_std.min() >= sac.LOG_STD_MIN and log_std.max() <= sac.LOG_STD_MAX


def critic(stacked, i, obs, action):
    """Critic i of a stacked pair, as its own network."""
    net = sac.SoftQNetwork(3, 1, 16)
    net.load_state_dict({k: v[i] for k, v in stacked.flatten_keys(".").items()})
    return net(obs, action)


def test_the_critic_loss_by_hand():
    """The smaller target critic at a fresh next action, minus alpha * log pi; a termination cuts it."""
    torch.manual_seed(0)
    args = small(sac, gamma=0.5, autotune=False, alpha=0.3)
    env = ScriptedEnv()
    algo = sac.SAC(env.single_observation_space, env.single_action_space, args, "cpu")
    data = batch(B=4, terminated_every=2)
    with torch.no_grad():
        torch.manual_seed(7)
        next_actions, next_log_pi = sac.sample_action(algo.actor, data["next_obs"])
        next_q = torch.stack([critic(algo.q_target, i, data["next_obs"], next_actions) for i in range(2)])
        target = data["reward"] + 0.5 * (~data["terminated"]).float() * (next_q.min(0).values - 0.3 * next_log_pi)
        q = torch.stack([critic(algo.q_online, i, data["obs"], data["action"]) for i in range(2)])
    torch.manual_seed(7)
    loss, _ = sac.critic_loss(algo, 0.5, False, algo.q_params, data)
    torch.testing.assert_close(loss, ((q - target) ** 2).mean(-1).sum())


def test_the_target_critic_moves_after_every_critic_step_in_place(tmp_path):
    torch.manual_seed(0)
    args = small(sac, tau=0.25)
    env = ScriptedEnv()
    algo = sac.SAC(env.single_observation_space, env.single_action_space, args, "cpu")
    replay = leanrl.Replay(16, 4, dict(obs=((3,), torch.float32), action=((1,), torch.float32),
                                       reward=((), torch.float32), next_obs=((3,), torch.float32),
                                       terminated=((), torch.bool)), "cpu")
    logger = leanrl.Logger(str(tmp_path), {}, 10, progress=False, summary=False)
    step = [lambda data: sac.gradient_step(lambda p, d: sac.critic_loss(algo, 0.99, False, p, d), algo.q_named,
                                           algo.q_optimizer, data), None, None]
    ptrs = {k: v.data_ptr() for k, v in algo.q_target.items(True, True)}
    before = {k: v.clone() for k, v in algo.q_target.items(True, True)}
    obs = env.reset()
    sac.learn(algo, replay, logger, step, args, obs, torch.zeros(2, 1), env.step(torch.zeros(2, 1)), update=True,
              delayed=False)
    logger.close()
    for k, v in algo.q_target.items(True, True):
        torch.testing.assert_close(v, 0.75 * before[k] + 0.25 * algo.q_online[k], msg=str(k))
        assert v.data_ptr() == ptrs[k]


@pytest.mark.slow
def test_sac_learns_pendulum_within_20k_steps(tmp_path):
    assert reaches(sac, tmp_path, "torch/Pendulum-v1", -250, **PENDULUM_LEARNING)
