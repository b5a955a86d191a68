"""The trainer's side of a causal LM: log-probs of the sampled tokens, and micro-batches of fixed shape whose rows
hold whole sequences (packed: as many as fit), so a captured update computes sampled tokens rather than padding."""

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict


def token_logprobs(model, tokens, temperature: float, position_ids=None):
    """log pi(token t | tokens < t) at the sampling temperature, and the policy's entropy there, [B, L]; the
    logits at position t-1 score token t (the sampler's quantity); position 0 scores nothing (0). With packed
    rows, `position_ids` restart at 0 where a sequence starts, which is where transformers ends its attention;
    a sequence's first token is then scored by the one before it, a prompt token no loss weighs."""
    logits = model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits[:, :-1].float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def pack_tokens(seqs: list[int], lengths: list[int], max_len: int, micro_batch: int, packed: bool) -> torch.Tensor:
    """Where each token of the micro-batch rows comes from: [R, max_len] flat indices s * max_len + t (token t of
    sequence s), -1 for padding. R: whole micro-batches of `micro_batch` rows, then a last one of the next power of
    two rows (at least 2, at most micro_batch), its empty rows after the used ones and no more of them: a few fixed
    shapes. `packed`: sequences `seqs` first-fit into rows, the longest first, their `lengths` tokens each; else one
    per row, whole."""
    if packed:
        rows, free = [], []
        for s in sorted(seqs, key=lambda s: -lengths[s]):
            r = next((r for r, f in enumerate(free) if f >= lengths[s]), len(rows))
            if r == len(rows):
                rows.append([])
                free.append(max_len)
            rows[r].append(s)
            free[r] -= lengths[s]
    else:
        rows = [[s] for s in seqs]
    whole, rest = divmod(len(rows), micro_batch)
    last = min(max(1 << (rest - 1).bit_length(), 2), micro_batch) if rest else 0
    src = np.full((whole * micro_batch + last, max_len), -1)
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            n = lengths[s] if packed else max_len
            src[r, start:start + n] = np.arange(s * max_len, s * max_len + n)
            start += n
    return torch.from_numpy(src)


def gather_rows(data: TensorDict, src: torch.Tensor) -> TensorDict:
    """The per-token fields of `data` [B, L] laid out as `src` says (`pack_tokens`), padding weighted out, with the
    position of every token in its own sequence."""
    valid = src >= 0
    rows = data.reshape(-1)[src.clamp(min=0)]
    rows["weights"] = rows["weights"] * valid
    rows["completion_mask"] = rows["completion_mask"] & valid
    rows["position_ids"] = torch.where(valid, src % data.shape[1], 0)
    return rows
