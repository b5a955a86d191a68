"""What TD3 and SAC share: a bounded Box action space, and the twin critic, both Q networks' weights stacked in one
TensorDict (leading dim 2) and evaluated together."""

import torch
from torch.func import functional_call

from leanrl.cli import UsageError


def check_box_spaces(algo: str, observation_space, action_space):
    """TD3 and SAC act in a bounded Box and read flat observations."""
    if hasattr(action_space, "n") or not hasattr(action_space, "low"):
        raise UsageError(f"{algo} needs a continuous (Box) action space; got {action_space} "
                         "(use DQN for discrete actions)")
    low, high = torch.as_tensor(action_space.low), torch.as_tensor(action_space.high)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise UsageError(f"{algo} needs a bounded action space; got low={action_space.low}, high={action_space.high}")
    if len(observation_space.shape) != 1:
        raise UsageError(f"{algo} reads flat observations; got shape {observation_space.shape}")


def q_value(qnet, params, obs, action):
    """One critic: `qnet` (a weightless, meta copy of the architecture) with `params` (a TensorDict, or a dict by dotted
    parameter name) -> (batch,)."""
    # LeanRL's `with params.to_module(qnet)` here makes torch 2.13's Dynamo fail (an internal error, at the first
    # compiled call, under no_grad); functional_call is the same computation and compiles.
    params = params if isinstance(params, dict) else dict(params.flatten_keys(".").items())
    return functional_call(qnet, params, (obs, action))


def twin_q(qnet, params, obs, action, looped: bool = False):
    """Both critics, `params` stacked (leading dim 2) -> (2, batch): one vmapped call, or two calls when `looped`.
    Compiled on a CPU, inductor lowers vmap's batched product with a single output column (the last layer, and its
    weight's gradient) to slow reduction kernels; two calls compile to plain matrix products."""
    if not looped:
        return torch.vmap(lambda p: q_value(qnet, p, obs, action))(params)
    params = params if isinstance(params, dict) else dict(params.flatten_keys(".").items())
    return torch.stack([q_value(qnet, {name: p[i] for name, p in params.items()}, obs, action) for i in range(2)])
