"""A GRPO task read from a local file of problems and their answers (GSM8K, MATH, yours): `--dataset FILE`.

JSONL, JSON, CSV or parquet, read with Hugging Face `datasets` from the file alone (nothing is fetched from a hub).
A row's `--prompt-column` is a prompt, its `--answer-column` the reference answer that `--verifier`
(leanrl/llm/verifiers.py) checks completions against, and the warm start's demonstration. The held-out problems, of
`--eval-every` and of `python -m leanrl.llm.evaluate`, are `--eval-dataset`'s rows, or else a fixed
`--eval-fraction` of `--dataset`'s, which training never sees.
"""

import functools
import hashlib
import os
import random
import tempfile
from dataclasses import dataclass, field

from leanrl.cli import UsageError, require_extra
from leanrl.llm.tasks import HELD_OUT_SEED, Problem
from leanrl.llm.verifiers import make_verifier

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # `datasets`' builders


@dataclass
class DatasetArgs:
    dataset: str | None = None
    """a local JSONL, JSON, CSV or parquet file of problems and answers, read with Hugging Face `datasets` (nothing
    is fetched from a hub); replaces --task"""
    prompt_column: str = "prompt"
    """--dataset's column of prompts (GSM8K's is `question`, MATH's `problem`)"""
    answer_column: str = "answer"
    """--dataset's column of reference answers (GSM8K's `... #### 42`, MATH's `solution` with its `\\boxed{}`)"""
    system_prompt: str | None = None
    """a system prompt before every --dataset prompt (a system message with --chat-template)"""
    eval_dataset: str | None = None
    """the held-out problems: a second file with the same columns; else --eval-fraction of --dataset's rows"""
    eval_fraction: float = 0.1
    """without --eval-dataset, the fraction of --dataset's rows held out (the same rows every run), never trained on"""
    verifier: str = "math"
    """how --dataset's completions score: `math` (math-verify), `exact`, or yours as `module:function` (completion,
    answer) -> float, None when it cannot read the completion"""


def task_name(args) -> str:
    """What a run's directory and caches call its task: the --dataset file's name, else --task."""
    return os.path.splitext(os.path.basename(args.dataset))[0] if args.dataset else args.task


def read_rows(path: str, columns: tuple[str, str], flag: str) -> list[tuple[str, str]]:
    """The (prompt, answer) pairs of a local data file; anything wrong with it is a one-line UsageError naming it."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r}: no such file")
    builder = FORMATS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise UsageError(f"{flag} {path!r}: not a {', '.join(FORMATS)} file (by its extension)")
    if os.path.getsize(path) == 0:
        raise UsageError(f"{flag} {path!r}: the file is empty")
    require_extra(flag, "datasets", "llm")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local file needs no hub; never ask one
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    with tempfile.TemporaryDirectory() as cache:  # a cache of its own: a run's processes read the file at once
        try:
            data = load_dataset(builder, data_files=os.path.abspath(path), split="train", cache_dir=cache,
                                keep_in_memory=True)
        except Exception as e:  # datasets' parsers raise their own kinds
            raise UsageError(f"{flag} {path!r}: cannot be read as {builder} ({type(e).__name__}: {e})") from None
    for column in columns:
        if column not in data.column_names:
            raise UsageError(f"{flag} {path!r}: has no column {column!r} (its columns: {', '.join(data.column_names)}"
                             "; choose with --prompt-column / --answer-column)")
    if len(data) == 0:
        raise UsageError(f"{flag} {path!r}: has no rows")
    return [(str(p), str(a)) for p, a in zip(data[columns[0]], data[columns[1]])]


@functools.lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> list[int]:
    """A pass's order of the training rows: every pass its own shuffle, the same in every process."""
    return random.Random(f"{seed}:{epoch}").sample(range(n), n)


@dataclass(frozen=True)
class DatasetTask:
    """The training rows in a new shuffle each pass (seed by seed), the held-out ones in file order."""

    path: str
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    system_prompt: str | None = None
    eval_path: str | None = None
    eval_fraction: float = 0.1
    verifier: str = "math"
    digest: str = field(init=False)
    """the files' contents: an edited file is another task (a key of the warm start's cache)"""
    train: list = field(init=False, repr=False, compare=False)
    held_out: list = field(init=False, repr=False, compare=False)
    alphabet: str = field(init=False, repr=False, compare=False)
    """every character of the prompts and answers (the tiny model's character tokenizer)"""
    _score: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not 0 <= self.eval_fraction < 1:
            raise UsageError(f"--eval-fraction {self.eval_fraction}: must be in [0, 1)")
        score = make_verifier(self.verifier)  # a bad verifier fails before the file is read
        columns = (self.prompt_column, self.answer_column)
        rows = read_rows(self.path, columns, "--dataset")
        if self.eval_path:
            train, held_out = rows, read_rows(self.eval_path, columns, "--eval-dataset")
        else:  # a fixed split: the same rows are held out in every run and by the evaluation tool
            order = random.Random(0).sample(range(len(rows)), len(rows))
            k = round(self.eval_fraction * len(rows))
            held_out, train = [rows[i] for i in sorted(order[:k])], [rows[i] for i in sorted(order[k:])]
            if not train:
                raise UsageError(f"--eval-fraction {self.eval_fraction}: leaves none of --dataset's {len(rows)} rows "
                                 "to train on")
        digest = hashlib.sha1()
        for path in filter(None, (self.path, self.eval_path)):
            with open(path, "rb") as f:
                digest.update(f.read())
        text = "".join(p + a for p, a in rows + held_out) + (self.system_prompt or "")
        for name, value in dict(digest=digest.hexdigest()[:12], train=train, held_out=held_out,
                                alphabet="".join(sorted(set(text))), _score=score).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_args(cls, args) -> "DatasetTask":
        """The task of a run's `DatasetArgs`; with --eval-every, it must hold problems out."""
        task = cls(args.dataset, args.prompt_column, args.answer_column, args.system_prompt, args.eval_dataset,
                   args.eval_fraction, args.verifier)
        if getattr(args, "eval_every", 0) and not task.held_out:
            raise UsageError("--eval-every: --dataset holds no problems out (--eval-fraction 0 and no --eval-dataset)")
        return task

    def problem(self, index: int, seed: int = 0) -> Problem:
        if seed == HELD_OUT_SEED:
            prompt, answer = self.held_out[index % len(self.held_out)]
        else:
            epoch, i = divmod(index, len(self.train))
            prompt, answer = self.train[_order(len(self.train), seed, epoch)[i]]
        return Problem(prompt, answer, answer, self.system_prompt)

    def score(self, problem: Problem, completion: str) -> float | None:
        return self._score(completion, problem.answer)
