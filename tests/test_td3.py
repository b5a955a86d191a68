"""TD3's math by hand: target policy smoothing, clipped double Q, a termination against a truncation; the delayed
step that moves every target in place."""

import torch
import pytest
from offpolicy_helpers import PENDULUM_LEARNING, ScriptedEnv, batch, reaches, small

import leanrl
from leanrl.algorithms import td3


def critic(stacked, i, obs, action):
    """Critic i of a stacked pair, as its own network."""
    net = td3.QNetwork(3, 1, 16)
    net.load_state_dict({k: v[i] for k, v in stacked.flatten_keys(".").items()})
    return net(obs, action)


def test_the_critic_loss_by_hand():
    """Target smoothing (clipped noise times the action scale, actions kept in bounds), the smaller target critic,
    and no bootstrap past a termination: a truncation (stored with terminated False) bootstraps."""
    torch.manual_seed(0)
    args = small(td3, policy_noise=0.4, noise_clip=0.5, gamma=0.5)
    env = ScriptedEnv()
    algo = td3.TD3(env.single_observation_space, env.single_action_space, args, "cpu")
    data = batch(B=4, terminated_every=2)  # transitions 0 and 2 terminate
    with torch.no_grad():
        torch.manual_seed(7)
        noise = (torch.randn_like(data["action"]) * 0.4).clamp(-0.5, 0.5) * 2.0  # action scale 2
        next_actions = (algo.actor_target(data["next_obs"]) + noise).clamp(-2, 2)
        next_q = torch.stack([critic(algo.targets["q"], i, data["next_obs"], next_actions) for i in range(2)])
        target = data["reward"] + 0.5 * (~data["terminated"]).float() * next_q.min(0).values
        q = torch.stack([critic(algo.q_params, i, data["obs"], data["action"]) for i in range(2)])
    torch.manual_seed(7)
    loss, metrics = td3.critic_loss(algo, args, False, algo.q_params, data)
    qf = ((q - target) ** 2).mean(-1)
    torch.testing.assert_close(loss, qf.sum())
    torch.testing.assert_close(metrics, torch.stack([qf.sum(), qf[0], qf[1], q[0].mean(), q[1].mean()]))


def test_the_delayed_step_moves_every_target_in_place(tmp_path):
    torch.manual_seed(0)
    args = small(td3, tau=0.1, run_dir=str(tmp_path))
    env = ScriptedEnv()
    algo = td3.TD3(env.single_observation_space, env.single_action_space, args, "cpu")
    replay = leanrl.Replay(16, 4, dict(obs=((3,), torch.float32), action=((1,), torch.float32),
                                       reward=((), torch.float32), next_obs=((3,), torch.float32),
                                       terminated=((), torch.bool)), "cpu")
    logger = leanrl.Logger(str(tmp_path), {}, 10, progress=False, summary=False)
    steps = [lambda data: td3.gradient_step(lambda p, d: td3.critic_loss(algo, args, False, p, d), algo.q_named,
                                            algo.q_optimizer, data),
             lambda data: td3.gradient_step(lambda p, d: td3.actor_loss(algo, p, d), algo.actor_named,
                                            algo.actor_optimizer, data)]
    ptrs = {k: v.data_ptr() for k, v in algo.targets.items(True, True)}
    before = {k: v.clone() for k, v in algo.targets.items(True, True)}
    obs = env.reset()
    out = env.step(torch.zeros(2, 1))
    td3.learn(algo, replay, logger, steps, 0.1, obs, torch.zeros(2, 1), out, update=True, delayed=True)
    logger.close()
    for k, v in algo.targets.items(True, True):  # after the actor's step: the online weights it left
        torch.testing.assert_close(v, 0.9 * before[k] + 0.1 * algo.online[k], msg=str(k))
        assert v.data_ptr() == ptrs[k]
    assert algo.actor_target.fc1.weight.data_ptr() == ptrs[("actor", "fc1", "weight")]  # reads that same storage


@pytest.mark.slow
def test_td3_learns_pendulum_within_20k_steps(tmp_path):
    assert reaches(td3, tmp_path, "torch/Pendulum-v1", -250, **PENDULUM_LEARNING)
