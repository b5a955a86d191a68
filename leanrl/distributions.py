"""Action distributions written out, so that no validation check or host sync hides inside `torch.distributions`
and a sample can be drawn inside a compiled call or a CUDA graph from random numbers drawn before it.

Each returns `(action, logprob, entropy)`: a sample when `action` is None, drawn from `noise` (drawn here if None),
else the given action's log-probability."""

import math

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def categorical(logits: torch.Tensor, action=None, noise=None):
    """A categorical over the last dim of `logits`; `noise` uniform in [0, 1), shaped as `logits` (Gumbel-max: an
    exact sample, drawn in-graph)."""
    logits = logits.log_softmax(-1)
    if action is None:
        noise = torch.rand_like(logits) if noise is None else noise
        action = (logits - torch.log(-torch.log(noise.clamp_min(1e-20)))).argmax(-1)
    logprob = logits.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    return action, logprob, -(logits.exp() * logits).sum(-1)


def diagonal_gaussian(mean: torch.Tensor, logstd: torch.Tensor, action=None, noise=None):
    """A Gaussian with independent dims (the last, summed over); `noise` standard normal, shaped as `mean`."""
    logstd = logstd.expand_as(mean)
    if action is None:
        action = mean + logstd.exp() * (torch.randn_like(mean) if noise is None else noise)
    logprob = -((action - mean) ** 2) / (2 * (2 * logstd).exp()) - logstd - LOG_SQRT_2PI
    return action, logprob.sum(-1), (0.5 + LOG_SQRT_2PI + logstd).sum(-1)
