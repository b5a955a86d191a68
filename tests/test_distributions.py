"""The sync-free distributions against torch.distributions: the same log-probabilities and entropies, and samples
drawn from the right law."""

import torch
from torch.distributions import Categorical, Normal

import leanrl


def test_categorical_matches_torch_and_samples_its_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    actions = torch.randint(0, 4, (5,))
    _, logprob, entropy = leanrl.categorical(logits, actions)
    torch.testing.assert_close(logprob, Categorical(logits=logits).log_prob(actions))
    torch.testing.assert_close(entropy, Categorical(logits=logits).entropy())
    # Gumbel-max from uniform noise: the empirical frequencies of 200k draws within 1 % of the probabilities.
    row = logits[:1].expand(200_000, 4)
    sampled, logprob, _ = leanrl.categorical(row, noise=torch.rand(200_000, 4))
    frequencies = torch.bincount(sampled, minlength=4) / 200_000
    torch.testing.assert_close(frequencies, logits[0].softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(logprob, Categorical(logits=row).log_prob(sampled))


def test_diagonal_gaussian_matches_torch_and_samples_its_moments():
    torch.manual_seed(0)
    mean, logstd = torch.randn(3, 2), torch.randn(1, 2) * 0.3
    actions = torch.randn(3, 2)
    reference = Normal(mean, logstd.exp().expand(3, 2))
    _, logprob, entropy = leanrl.diagonal_gaussian(mean, logstd, actions)
    torch.testing.assert_close(logprob, reference.log_prob(actions).sum(-1))
    torch.testing.assert_close(entropy, reference.entropy().sum(-1))
    noise = torch.randn(100_000, 2)
    sampled, _, _ = leanrl.diagonal_gaussian(mean[:1].expand(100_000, 2), logstd, noise=noise)
    torch.testing.assert_close(sampled, mean[:1] + logstd.exp() * noise)  # the given noise, reparametrized
    torch.testing.assert_close(sampled.std(0), logstd.exp()[0], atol=0.01, rtol=0)
