"""Importance weights of stale samples, as the async corrections and GRPO's logs measure them."""

import torch


def effective_sample_size(logw: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (n sum w^2) of the importance weights w = exp(logw): 1 on-policy, 1/n at worst."""
    w = (logw - logw.max()).exp()
    return w.sum() ** 2 / (w.numel() * (w ** 2).sum())
