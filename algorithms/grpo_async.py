"""Async GRPO (`--async`): collectors sample while the trainer trains, PipelineRL style.

Each collector owns a copy of the model and a Sampler over it. Between two decode steps the sampler calls
`ctx.step_boundary()`, which copies the newest published weights into the sampler's own weights in place (an
in-flight update: running sequences continue, their KV kept or, with `--recompute-kv`, recomputed) and returns
the version every token of that step is tagged with. Admission control (`--max-lag`) and the sampler's
`min_version` (a sequence holding an older token restarts) bound every token's lag; the trainer consumes batches
in order, corrects the staleness with GRPO's `--loss` (decoupled PPO by default) and publishes after each update.
`--deterministic`: batch i is sampled by version i - max_lag exactly, no sequence outlives its batch, so the run
is bitwise reproducible whatever the speeds.

Depends on: algorithms/grpo.py (its math, model and update), leanrl.pipeline, and what grpo.py depends on.
"""

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from tensordict import from_module

import leanrl
import leanrl.pipeline
from leanrl.algorithms import grpo
from leanrl.config import ASYNC_ONLY
from leanrl.data_parallel import DataParallel
from leanrl.llm.dataset_task import task_name
from leanrl.llm.tasks import PromptStream, held_out_evaluation, score
from leanrl.llm.warm_start import load_policy
from leanrl.pipeline import AsyncArgs, check_settings

STATS = ("sampled_tokens", "time_s", "dropped", "slot_utilization", "decode_steps")


@dataclass
class Args(grpo.Args, AsyncArgs):
    loss: Literal["clip", "truncated_is", "decoupled"] = "decoupled"
    """clipped ratio to the sampler's log-probs (naive on stale data), truncated-IS REINFORCE on them
    (PipelineRL), or decoupled PPO with the trainer's proximal log-probs (AReaL)"""
    recompute_kv: bool = field(default=False, metadata=ASYNC_ONLY)
    """after an in-flight update, recompute the running sequences' KV cache with the new weights (AReaL);
    default: keep it (PipelineRL)"""


def check_args(args: Args):
    # Under torchrun with threads/processes, the ranks are data-parallel trainers; with distributed, collectors.
    grpo.check_args(args, 1 if args.transport == "distributed" else DataParallel.torchrun_world())
    check_settings(args.transport, args.num_collectors, args.max_lag, args.deterministic, args.publish_every,
                   args.max_restarts)
    if (args.async_ and args.sampler == "vllm" and args.transport == "threads" and args.num_collectors > 1
            and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"):  # vLLM's parallel state is per process
        raise leanrl.UsageError(f"VLLM_ENABLE_V1_MULTIPROCESSING=0 with --transport threads: the {args.num_collectors}"
                                " collectors' engines would run in one process, which holds one vLLM engine; use "
                                "--transport processes, --num-collectors 1, or engines in processes of their own")


def processes(args: Args) -> int:
    """The processes of this run that compute at once on this machine (leanrl.set_threads shares the cores)."""
    return args.num_collectors + 1 if args.transport == "processes" else 1


def batch_template(sampler, args: Args):
    """A sampler batch plus what a collector adds: the rewards, which completions the verifier could not read,
    and its sampler's statistics (per row, so the batch keeps one batch dimension)."""
    batch = sampler.make_batch(args.num_prompts * args.group_size)
    batch["rewards"] = torch.zeros(batch.shape, device=batch.device)
    batch["unparsed"] = torch.zeros(batch.shape, dtype=torch.bool, device=batch.device)
    batch["sampler_stats"] = torch.zeros(*batch.shape, len(STATS), dtype=torch.float64, device=batch.device)
    return batch


def grpo_collector(ctx, args: Args, make_task, model_dir: str, device, prompt_offset: int, first_stream: int = 0,
                   num_streams: int | None = None):
    """A collector role: its own model copy and Sampler; fills each admitted batch slot, scores it, sends it.
    It reads prompt stream `first_stream + ctx.rank` of `num_streams` (default: one per collector)."""
    leanrl.seed_everything(args.seed + 1 + ctx.rank, args.torch_deterministic)
    task = make_task()
    model, tokenizer, _ = load_policy(args, task, device, model_dir, processes(args))
    sampler = grpo.make_sampler(model, tokenizer, args, model_dir,
                                recompute_kv=args.recompute_kv, seed=args.seed + 1 + ctx.rank)
    # Stream s is prompts offset + s, offset + s + n, ...: streams never overlap and are the same every run.
    prompts = PromptStream(task, tokenizer, args.seed, start=prompt_offset + first_stream + ctx.rank,
                                stride=num_streams or args.num_collectors, chat=args.chat_template)
    def state():  # what a batch starts from (--deterministic: a restarted collector continues from it)
        return dict(rng=torch.random.get_rng_state(), sampler=sampler.generator.get_state(), prompt=prompts.next_index)

    def load_state(saved):
        torch.random.set_rng_state(saved["rng"])
        sampler.generator.set_state(saved["sampler"])
        prompts.next_index = saved["prompt"]

    for batch in ctx.batches(sampler.params, batch_template(sampler, args),
                             state=(state, load_state) if hasattr(sampler, "generator") else None):
        stats = sampler.fill(batch, prompts, group_size=args.group_size, step_boundary=ctx.step_boundary,
                             min_version=ctx.min_version, carry_over=not args.deterministic,
                             min_version_step=args.num_collectors)
        host = batch.select("tokens", "prompt_length", "completion_length", "prompt_id", "finished").cpu()
        rewards, unparsed = score(task, tokenizer, host, args.seed)
        batch["rewards"].copy_(rewards)
        batch["unparsed"].copy_(unparsed)
        batch["sampler_stats"].copy_(torch.tensor([stats[k] for k in STATS], dtype=torch.float64))


def from_rank_zero(model_dir=None, prompt_offset=None):
    """`--transport distributed`: rank 0's model directory (the warm start it built) and prompt offset on every
    rank. A collector rank on a node that does not see rank 0's directory receives its files."""
    from leanrl.pipeline.distributed import broadcast_from_rank_zero, directory_on_every_rank
    model_dir, prompt_offset = broadcast_from_rank_zero((model_dir, prompt_offset))
    return directory_on_every_rank(model_dir), prompt_offset


def train(args: Args, make_task, collector=grpo_collector) -> dict:
    """The trainer role: prepares the model (the collectors load the same directory), starts the collectors,
    then consumes, updates, publishes, logs and checkpoints. Returns the last logged metrics. `make_task()`
    builds the task, in every process of the run (a class, or a picklable callable: see grpo.train).
    Under `torchrun --nproc-per-node N` with `--transport threads` or `processes`, N data-parallel trainers
    (as in grpo.train), each with its own `--num-collectors` filling its 1/N of every batch; rank 0 logs the
    world's metrics and checkpoints. With `--transport distributed`, every torchrun rank calls this: rank 0 trains,
    the others collect (and return None)."""
    check_args(args)
    # the learner resumes exactly; collectors draw fresh prompts
    resumed = args.resume and leanrl.load_checkpoint(args.resume, args, ("total_timesteps",))  # (a constant lr)
    device = leanrl.resolve_device(args.device)
    settings = dict(max_lag=args.max_lag, deterministic=args.deterministic, publish_every=args.publish_every,
                    max_restarts=args.max_restarts)
    if args.transport == "distributed":  # torchrun's ranks: rank 0 trains, the others collect
        from leanrl.pipeline.distributed import is_collector_rank, join
        device = join(args.num_collectors, device)
        if is_collector_rank():
            model_dir, prompt_offset = from_rank_zero()
            leanrl.pipeline.start("distributed", args.num_collectors, collector,
                                  (args, make_task, model_dir, device, prompt_offset), None, None, **settings)
            return None
        data_parallel = DataParallel(device)
    else:
        data_parallel = DataParallel.from_torchrun(device)
    rank, world, device = data_parallel.rank, data_parallel.world, data_parallel.device
    leanrl.seed_everything(args.seed, args.torch_deterministic)
    # The first rank builds the warm-start cache, the others load it.
    task = make_task()
    model, tokenizer, model_dir = data_parallel.in_turns(lambda: load_policy(args, task, device,
                                                                             processes=processes(args)))
    learner = grpo.Learner(model, args, device, max_lag=args.max_lag, data_parallel=data_parallel)
    B = args.num_prompts * args.group_size
    num_iterations = args.total_timesteps // B
    share = dataclasses.replace(args, num_prompts=args.num_prompts // world)  # what this rank's collectors fill
    run_dir = data_parallel.from_rank_zero(lambda: leanrl.make_run_dir(args, f"grpo-{task_name(args)}"))
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    iteration = 0
    if resumed:
        leanrl.restore_rng(resumed)
        learner.load_state_dict(resumed)
        iteration = resumed["iteration"]

    def state():
        return dict(learner.state_dict(), iteration=iteration)

    if args.transport == "distributed":
        from_rank_zero(model_dir, iteration * B)
    collector_device = device if args.transport == "threads" else torch.device("cpu")
    # The batch layout is the same for every sampler: the cheapest one builds it.
    template = batch_template(grpo.make_sampler(model, tokenizer, args, backend="builtin", num_slots=1), share)
    # Evaluations sample the trainer's weights with a built-in sampler of its own (the collectors' samplers follow
    # them up to --max-lag behind, in other processes or on other machines), on rank 0 only as in sync GRPO.
    evaluate = held_out_evaluation(grpo.make_sampler(model, tokenizer, args, backend="builtin"), task, tokenizer,
                                   args) if args.eval_every and rank == 0 else None
    logger, interrupt = data_parallel.logging(args, run_dir, num_iterations * B, iteration * B, checkpoint_path,
                                              state, return_metric="charts/reward_mean", unit="sequence")
    C = args.num_collectors
    fn_args = (share, make_task, model_dir, collector_device, iteration * B, rank * C, world * C)
    with logger, interrupt, leanrl.pipeline.start(args.transport, C, collector, fn_args, template,
                                                  from_module(model).data, **settings) as trainer:
        while iteration < num_iterations:
            batch = trainer.next_batch().to(device)
            t0 = time.perf_counter()
            metrics = learner.update(batch, batch["rewards"], trainer.version)
            leanrl.sync_cuda(device)
            update_time = time.perf_counter() - t0
            trainer.publish()
            stats = dict(zip(STATS, batch["sampler_stats"][0].tolist()))
            # The collector's own speed, as in sync GRPO; the run's, pauses included, is charts/SPS.
            metrics.update({"perf/sampled_tokens_per_s": stats["sampled_tokens"] / stats["time_s"],
                            "perf/trained_tokens_per_s": float(batch["completion_length"].sum()) / update_time,
                            "perf/sample_time": stats["time_s"],
                            "perf/slot_utilization": stats["slot_utilization"], "perf/dropped": stats["dropped"],
                            "perf/decode_steps": stats["decode_steps"], "perf/update_time": update_time,
                            "charts/unparsed_frac": batch["unparsed"].float().mean(), **trainer.stats.summary()})
            world_metrics = data_parallel.reduce_metrics(metrics)
            logger.record(world_metrics if rank == 0 else metrics)
            iteration += 1
            logger.end_iteration(iteration * B)
            if evaluate and iteration % args.eval_every == 0 and iteration < num_iterations:
                logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            if iteration % args.log_every == 0 or iteration == num_iterations:
                logger.flush()
            if rank == 0 and args.checkpoint_every and iteration % args.checkpoint_every == 0:
                grpo.save(checkpoint_path, state(), args, model, tokenizer)
        if evaluate:  # the trained policy, also when a finished run is resumed only to evaluate
            logger.record({"charts/eval_solve_rate": evaluate(iteration)})
            logger.flush()
        if rank == 0:
            grpo.save(checkpoint_path, state(), args, model, tokenizer)
    data_parallel.close()
    return logger.last
