"""What a GRPO run does with its task, the text side of the loop: prompts encoded as the sampler pulls them, the
verifier on every completion, the supervised warm start's demonstrations, the held-out solve rate.

A task (`leanrl.envs.llm_tasks` has some, `leanrl.llm.dataset_task` reads one from a file) is an object with
`problem(index, seed) -> Problem` (the problem number `index` of a fixed stream: the same index gives the same
problem in every process, so a batch carries only its prompt ids; seed `HELD_OUT_SEED` is the held-out stream) and
`score(problem, completion) -> float | None` (1.0 if the completion solves the problem, else 0.0; None when no parser
understood it, which scores 0 and is counted in charts/unparsed_frac; it never raises, whatever the text). A
`Problem` has its `prompt` and a correct `demonstration` (the warm start's), and may have a `system` prompt. A task for
the tiny model also has `alphabet`, the characters its prompts and answers use (its character tokenizer's).
"""

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from leanrl.cli import UsageError


@dataclass(frozen=True)
class Problem:
    prompt: str
    """the text the model continues"""
    answer: str
    """what the verifier checks the completion against"""
    demonstration: str
    """a correct completion (the warm start's target)"""
    system: str | None = None
    """a system prompt before it (a system message with --chat-template, else text before the prompt)"""


def encode(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """A prompt's token ids; `chat`: the text as a user message in the tokenizer's chat template, the assistant's
    turn opened (--chat-template), after `system` as a system message."""
    if not chat:
        return tokenizer(text if system is None else f"{system}\n\n{text}")["input_ids"]
    if not tokenizer.chat_template:
        raise UsageError("--chat-template: the model's tokenizer has no chat template (tokenizer_config.json's "
                                "chat_template)")
    messages = [{"role": "system", "content": system}] * (system is not None) + [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


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
        problem = self.task.problem(index, self.seed)
        return index, encode(self.tokenizer, problem.prompt, self.chat, getattr(problem, "system", None))


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
    return float(score(task, tokenizer, batch.cpu(), HELD_OUT_SEED)[0].mean())


def held_out_evaluation(sampler, task, tokenizer, args):
    """`evaluate(version)`: the held-out solve rate of `sampler` on a GRPO run's `args.eval_prompts` problems, the same
    at every call (`held_out_solve_rate`, draws from the run's evaluation seed)."""
    batch = sampler.make_batch(args.eval_prompts * args.group_size)
    return lambda version: held_out_solve_rate(sampler, task, tokenizer, batch, args.group_size, version,
                                               args.seed + 10_000, args.chat_template)


def score(task, tokenizer, host_batch: TensorDict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier on every completion of a batch copied to the host (it reads text); a completion cut at
    max_len scores 0. Returns rewards [B] (float32) and `unparsed` [B] (bool: a finished completion the verifier
    could not read, scored 0), on the host."""
    rewards, unparsed = [], []
    for tokens, start, length, pid, finished in zip(
            host_batch["tokens"].tolist(), host_batch["prompt_length"].tolist(),
            host_batch["completion_length"].tolist(), host_batch["prompt_id"].tolist(),
            host_batch["finished"].tolist()):
        text = tokenizer.decode(tokens[start:start + length], skip_special_tokens=True)
        value = task.score(task.problem(pid, seed), text) if finished else 0.0
        rewards.append(0.0 if value is None else value)
        unparsed.append(value is None)
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(unparsed)


def demonstrations(task, tokenizer, indices, seed: int, max_len: int, chat: bool = False):
    """Prompt + demonstration + EOS per problem, right-padded to max_len, the mask of the completion, and each
    sequence's length. `chat`: as in `encode`."""
    tokens = torch.full((len(indices), max_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(indices), max_len, dtype=torch.bool)
    lengths = []
    for row, index in enumerate(indices):
        problem = task.problem(index, seed)
        prompt = encode(tokenizer, problem.prompt, chat, getattr(problem, "system", None))
        completion = tokenizer(problem.demonstration, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seq = (prompt + completion)[:max_len]
        tokens[row, :len(seq)] = torch.tensor(seq)
        mask[row, len(prompt):len(seq)] = True
        lengths.append(len(seq))
    return tokens, mask, lengths
