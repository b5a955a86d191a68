"""leanrl.importance: the effective sample size of importance weights, as async PPO and GRPO log it."""

import pytest
import torch

import leanrl


def test_effective_sample_size_is_one_on_policy_and_one_over_n_when_one_sample_dominates():
    assert leanrl.effective_sample_size(torch.zeros(10)).item() == pytest.approx(1.0)
    assert leanrl.effective_sample_size(torch.tensor([0.0, -100.0, -100.0, -100.0])).item() == pytest.approx(0.25)
    # against the weights' own definition, at a large scale of log-weights (no overflow)
    logw = torch.randn(50, dtype=torch.float64) * 30
    w = logw.exp()
    assert leanrl.effective_sample_size(logw).item() == pytest.approx((w.sum() ** 2 / (50 * (w ** 2).sum())).item())
