"""The policy a GRPO run starts from: a local model directory (`--model-path`), a named model (`--model`), or a tiny
model built for the task's characters; then, with `sft_steps`, its copy warm-started on the task's demonstrations.
Both are cached under `run_dir/warm_start/`, keyed by everything that makes them, so reruns and async collectors
load them instead of building them again. `args`: GRPO's (`leanrl.algorithms.grpo.Args`)."""

import dataclasses
import hashlib
import json
import os

import torch
from tensordict import TensorDict
from tqdm import trange

from leanrl.cli import UsageError
from leanrl.llm.dataset_task import task_name
from leanrl.llm.models import char_tokenizer, load_model, save_cached, save_tiny_model
from leanrl.llm.packing import gather_rows, pack_tokens, token_logprobs
from leanrl.llm.tasks import demonstrations, encode
from leanrl.run import path_safe
from leanrl.threads import set_threads


def warm_start(model, tokenizer, task, args, device):
    """A short supervised run on the task's demonstrations (another problem stream than GRPO's): it teaches a
    tiny model the answer format; what it gets right is then up to RL. Its rows are packed as the update's are."""
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


def prepare_model(args, task, device) -> str:
    """The directory GRPO starts from: `--model-path`, the named `--model`, or a tiny model built for the task's
    alphabet; then, if `sft_steps`, its warm-started copy. Both are cached under `run_dir/warm_start/` (keyed by
    everything that makes them), so reruns and async collectors load them instead of rebuilding."""
    cache = os.path.join(args.run_dir, "warm_start")
    base = args.model_path or args.model
    if base == "tiny" and not args.model_path:
        alphabet = hashlib.sha1(task.alphabet.encode()).hexdigest()[:8]  # a task of yours may change it
        name = f"tiny-{path_safe(task_name(args))}-{alphabet}-{args.tiny_layers}x{args.tiny_hidden}-seed{args.seed}"
        base = os.path.join(cache, name)
        if not os.path.isfile(os.path.join(base, "config.json")):
            save_tiny_model(base, char_tokenizer(task.alphabet), num_layers=args.tiny_layers,
                            hidden_size=args.tiny_hidden, max_position_embeddings=max(512, args.max_len),
                            seed=args.seed)
    if args.sft_steps == 0:
        return base
    settings = repr(task) if dataclasses.is_dataclass(task) else task_name(args)  # not an address, new every run
    key = json.dumps([os.path.abspath(base) if os.path.isdir(base) else base, settings, args.sft_steps,
                      args.sft_batch, args.sft_learning_rate, args.max_len, args.seed, args.chat_template])
    out = os.path.join(cache, "sft-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    if not os.path.isfile(os.path.join(out, "config.json")):
        # in float32 whatever --dtype is: bfloat16 weights would round most of its steps away (see grpo.Learner)
        model, tokenizer = load_model(base, device=device, progress=False)
        set_threads(args.threads, model)
        warm_start(model, tokenizer, task, args, device)
        save_cached(model, tokenizer, out)
    return out


def check_task(args, task):
    """The task fits the model: the tiny model's character tokenizer needs the task's `alphabet`."""
    if args.model == "tiny" and not args.model_path and not isinstance(getattr(task, "alphabet", None), str):
        raise UsageError(f"--task {task_name(args)!r}: the tiny model's character tokenizer needs its `alphabet` (a "
                         "string of every character its prompts and answers use); or use --model/--model-path")


def load_policy(args, task, device, model_dir: str | None = None, processes: int = 1):
    """The model (prepared and warm-started, or loaded from `model_dir`), its tokenizer and the model's directory:
    what the sync loop, the async trainer and every async collector build identically. `processes`: those of the
    run computing at once on this machine, which share its cores (`leanrl.set_threads`)."""
    if not args.progress:  # transformers' own bars too (loading, converting a named model): a process-wide switch
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    check_task(args, task)  # before anything is built
    collector = model_dir is not None  # it loads what the trainer prepared and loaded: one "Loading weights" bar
    model_dir = model_dir or prepare_model(args, task, device)
    model, tokenizer = load_model(model_dir, device=device, dtype=getattr(torch, args.dtype), progress=not collector)
    set_threads(args.threads, model, processes=processes, quiet=collector)
    if args.chat_template:
        encode(tokenizer, "", chat=True)  # no chat template: the error here, not in a collector
    return model, tokenizer, model_dir
