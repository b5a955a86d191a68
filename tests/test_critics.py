"""leanrl.critics: the stacked twin critic against two separate networks, vmapped and looped."""

import pytest
import torch
from tensordict import from_modules

from leanrl.algorithms import sac, td3
from leanrl.critics import q_value, twin_q


@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("net", [td3.QNetwork, sac.SoftQNetwork])
def test_the_twin_critic_equals_two_networks(net, looped):
    torch.manual_seed(0)
    q1, q2 = net(3, 2, 32), net(3, 2, 32)
    params = from_modules(q1, q2, as_module=True)
    meta = net(3, 2, 32, "meta")
    obs, action = torch.randn(10, 3), torch.randn(10, 2)
    out = twin_q(meta, params, obs, action, looped)
    assert out.shape == (2, 10)
    torch.testing.assert_close(out[0], q1(obs, action))
    torch.testing.assert_close(out[1], q2(obs, action))
    torch.testing.assert_close(q_value(meta, params[1], obs, action), q2(obs, action))
    # gradients reach both stacked critics, as the per-network losses would
    (out ** 2).sum().backward()
    (q1(obs, action) ** 2).sum().backward()
    torch.testing.assert_close(params["fc1", "weight"].grad[0], q1.fc1.weight.grad)
