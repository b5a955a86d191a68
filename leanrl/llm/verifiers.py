"""Verifiers of a data file's problems: `verifier(completion, answer) -> float | None`, the completion's score
against the problem's reference answer, None when no parser understood the completion (it scores 0 and is counted
in charts/unparsed_frac). `safe` makes any verifier one that never raises into a run.

- `math`: Hugging Face's math-verify, the checker open-r1 and TRL use: the final answer, after GSM8K's `####`, else
  the last `\\boxed{...}` or expression, equal to the reference's as mathematics (`\\frac{1}{2}` is `0.5`).
- `exact`: the final answer equal to the reference's as text (spaces and thousands separators ignored).
- `module:function`: yours, importable from where the run is launched.
"""

import re
import threading

from leanrl.cli import UsageError, import_user_module, require_extra

GSM8K_MARK = "####"


def final_answer(text: str) -> str | None:
    """The answer a text ends on: what follows its last `####` (GSM8K), else the content of its last `\\boxed{}`,
    else None."""
    if GSM8K_MARK in text:
        return text.rsplit(GSM8K_MARK, 1)[1].strip().replace(",", "") or None
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # an unclosed brace


def math_equal(completion: str, answer: str) -> float | None:
    from math_verify import parse, verify

    # math-verify's timeouts are SIGALRM's, which only the main thread can set (threads collectors have none).
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(final_answer(answer) or answer, parsing_timeout=timeout)
    marked = final_answer(completion) if GSM8K_MARK in completion else None
    predicted = parse(marked or completion, parsing_timeout=timeout)
    if not gold or not predicted:
        return None
    return float(verify(gold, predicted, timeout_seconds=timeout))


def exact_match(completion: str, answer: str) -> float | None:
    predicted = final_answer(completion)
    if predicted is None:
        return None
    normalize = lambda s: re.sub(r"[\s,]", "", s)  # noqa: E731
    return float(normalize(predicted) == normalize(final_answer(answer) or answer))


VERIFIERS = {"math": math_equal, "exact": exact_match}


def make_verifier(name: str):
    """The verifier `name` (one of VERIFIERS, or `module:function`), wrapped by `safe`; a bad name is a one-line
    UsageError naming it."""
    if name == "math":
        require_extra("--verifier math", "math_verify", "llm")
    if name in VERIFIERS:
        return safe(VERIFIERS[name])
    module, _, function = name.partition(":")
    if not function:
        raise UsageError(f"--verifier {name!r}: choose one of {sorted(VERIFIERS)}, or your own as module:function")
    try:
        verifier = getattr(import_user_module(module), function)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--verifier {name!r}: cannot import it ({e})") from None
    if not callable(verifier):
        raise UsageError(f"--verifier {name!r}: is not a function")
    return safe(verifier)


def safe(verifier):
    """`verifier` that never raises: an error inside it, or a score that is not a number, counts as unparsed."""
    def score(completion: str, answer: str) -> float | None:
        try:
            value = verifier(completion, answer)
            return None if value is None else float(value)
        except Exception:  # a user's parser on any text a policy writes: nothing it does may stop the run
            return None
    score.__name__ = getattr(verifier, "__name__", "verifier")
    return score
