"""Verifiable text tasks for GRPO, generated locally: a prompt generator plus a verifier each (what a task is:
leanrl/llm/tasks.py). To add your own, copy one class into a module of yours and run it as `--task module:Class`
(`make_task`); a file of problems and answers runs as `--dataset FILE` (leanrl/llm/dataset_task.py).
`demonstration` is a correct completion, for the supervised warm start that teaches a tiny model the answer format.
A frozen dataclass, as these: its repr (its settings) keys the cached warm start (another class's name does).
"""

import random
import re
from dataclasses import dataclass
from functools import partial

from leanrl.cli import UsageError, import_user_module
from leanrl.llm.dataset_task import DatasetTask
from leanrl.llm.tasks import Problem

DIGITS = "0123456789"


def _rng(index: int, seed: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def _last_field(completion: str, sep: str) -> str:
    return completion.strip().split(sep)[-1].strip()


@dataclass(frozen=True)
class Arithmetic:
    """Sums of `max_digits`-digit numbers; the number of terms is log-normal, so response lengths are
    heavy-tailed and synchronous generation waits on stragglers. The completion writes the running sums,
    `12+7+30=` -> `19,49`: one field per term, the last field is the answer."""

    max_digits: int = 1
    terms_mu: float = 0.0
    """log-normal location of the number of terms (median exp(mu) + 1)"""
    terms_sigma: float = 0.8
    """log-normal scale of the number of terms: the tail of response lengths"""
    max_terms: int = 12
    alphabet: str = DIGITS + "+=,"

    def problem(self, index: int, seed: int = 0) -> Problem:
        rng = _rng(index, seed)
        n = min(2 + int(rng.lognormvariate(self.terms_mu, self.terms_sigma)), self.max_terms)
        terms = [rng.randrange(10 ** rng.randint(1, self.max_digits)) for _ in range(n)]
        sums = [sum(terms[: k + 1]) for k in range(1, n)]
        return Problem("+".join(map(str, terms)) + "=", str(sums[-1]), ",".join(map(str, sums)))

    def score(self, problem: Problem, completion: str) -> float:
        return float(_last_field(completion, ",") == problem.answer)


@dataclass(frozen=True)
class LetterCount:
    """PipelineRL's counting task: how many times a letter occurs in a random word. `r:strawberry?` -> `3`."""

    min_len: int = 3
    max_len: int = 12
    letters: str = "abcdefgh"
    alphabet: str = DIGITS + "abcdefghijklmnopqrstuvwxyz:?"

    def problem(self, index: int, seed: int = 0) -> Problem:
        rng = _rng(index, seed)
        word = "".join(rng.choice(self.letters) for _ in range(rng.randint(self.min_len, self.max_len)))
        letter = rng.choice(self.letters)
        count = str(word.count(letter))
        return Problem(f"{letter}:{word}?", count, count)

    def score(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)


@dataclass(frozen=True)
class Countdown:
    """Reach a target with +, -, * over some of the given numbers, each used at most once.
    `3,5,7>22:` -> `3*5+7` (any correct expression scores)."""

    num_numbers: int = 3
    max_number: int = 9
    alphabet: str = DIGITS + "+-*(),>:"

    def problem(self, index: int, seed: int = 0) -> Problem:
        rng = _rng(index, seed)
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        used = rng.sample(numbers, rng.randint(2, self.num_numbers))
        expr = str(used[0])
        for x in used[1:]:
            expr += rng.choice("+-*") + str(x)
        target = _evaluate(expr)
        return Problem(",".join(map(str, numbers)) + f">{target}:", str(target), expr)

    def score(self, problem: Problem, completion: str) -> float:
        expr = completion.strip()
        numbers = problem.prompt.split(">")[0].split(",")
        used = re.findall(r"\d+", expr)
        if not used or any(used.count(x) > numbers.count(x) for x in set(used)):
            return 0.0
        value = _evaluate(expr)
        return float(value is not None and str(value) == problem.answer)


def _evaluate(expr: str) -> int | None:
    """Integer value of an expression of non-negative integers, + - * and parentheses; None if malformed.
    A small recursive-descent parser: never `eval` model output."""
    tokens = re.findall(r"\d+|[-+*()]|\S", expr)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def atom():
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ValueError
        pos += 1
        if tok.isdigit() and len(tok) <= 6:
            return int(tok)
        if tok == "(":
            value = sum_()
            if peek() != ")":
                raise ValueError
            pos += 1
            return value
        raise ValueError

    def product():
        nonlocal pos
        value = atom()
        while peek() == "*":
            pos += 1
            value *= atom()
            if abs(value) > 10**12:
                raise ValueError
        return value

    def sum_():
        nonlocal pos
        value = product()
        while peek() in ("+", "-"):
            op = tokens[pos]
            pos += 1
            value = value + product() if op == "+" else value - product()
        return value

    try:
        value = sum_()
        return value if pos == len(tokens) else None
    except (ValueError, RecursionError):
        return None


TASKS = {"arithmetic": Arithmetic, "letter_count": LetterCount, "countdown": Countdown}


def make_task(name: str, **kwargs):
    """The task `name` built with `kwargs`: one of TASKS, or yours as `module:Class`, imported from the Python path
    or the directory the run was launched from (every process of a run imports it, so it must be importable there).
    A bad name is a ValueError that says why."""
    if ":" in name:
        module, _, cls_name = name.partition(":")
        try:
            cls = getattr(import_user_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--task {name!r}: cannot import it ({e})") from None
    elif name in TASKS:
        cls = TASKS[name]
    else:
        raise ValueError(f"--task {name!r}: choose one of {sorted(TASKS)}, or your own class as module:Class")
    try:
        task = cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"--task {name!r}: cannot build it ({e})") from None
    missing = [method for method in ("problem", "score") if not callable(getattr(task, method, None))]
    if missing:
        raise ValueError(f"--task {name!r}: has no {' and no '.join(missing)} method (see envs/llm_tasks.py)")
    return task


def task_maker(args):
    """`make_task()` for a GRPO run's arguments: the `--dataset` file's task, else `--task`'s. Built once here, so
    that a bad one is a one-line UsageError before anything else; every process of the run builds it again."""
    make = partial(DatasetTask.from_args, args) if args.dataset else partial(make_task, args.task)
    try:
        make()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return make
