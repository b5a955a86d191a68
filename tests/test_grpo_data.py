"""GRPO on a data file of your own: the verifiers, the file's task and its held-out split, bad input named in one
line before anything is written, and the tiny model end to end (train, export, start again from the export,
evaluate)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from leanrl.algorithms import grpo
from leanrl.cli import UsageError
from leanrl.envs.llm_tasks import task_maker
from leanrl.llm import char_tokenizer, evaluate
from leanrl.llm.dataset_task import DatasetTask
from leanrl.llm.tasks import HELD_OUT_SEED, score
from leanrl.llm.verifiers import exact_match, final_answer, make_verifier, math_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_gsm8k(path, n=60, seed=0):
    """A GSM8K-style file of easy sums: a question, and an answer that works it out and ends on `#### N`."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
                    + "\n")
    return str(path)


# ---------------------------------------------------------------------------- verifiers
def test_final_answers_of_gsm8k_and_boxed_forms():
    assert final_answer("48/2 = 24 clips in May.\n#### 1,072") == "1072"
    assert final_answer("so \\boxed{\\frac{1}{2}} wait \\boxed{3}") == "3"
    assert final_answer("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert final_answer("no answer here") is None and final_answer("\\boxed{open") is None


@pytest.mark.parametrize("completion, answer, expected", [
    ("3+4=7\n#### 7", "3+4=7\n#### 7", 1.0),
    ("The answer is \\boxed{7}.", "#### 7", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal as mathematics, not as text
    ("#### 1,234", "#### 1234", 1.0),
    ("#### 8", "#### 7", 0.0),
    ("I do not know", "#### 7", None),  # unparsed: scores 0, counted
    ("", "#### 7", None),
])
def test_math_verifier_reads_both_answer_forms(completion, answer, expected):
    assert math_equal(completion, answer) == expected


def test_exact_verifier_compares_final_answers_as_text():
    assert exact_match("#### 1,234 ", "x\n#### 1234") == 1.0
    assert exact_match("\\boxed{1/2}", "#### 0.5") == 0.0  # as text, not mathematics
    assert exact_match("7", "#### 7") is None  # no final answer stated


def test_a_verifier_of_your_own_never_raises_into_the_run(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(
        "def strict(completion, answer):\n    if 'boom' in completion:\n        raise RuntimeError('bad text')\n"
        "    return float(completion.strip() == answer)\n")
    monkeypatch.chdir(tmp_path)
    verifier = make_verifier("my_checks:strict")
    assert verifier("7", "7") == 1.0 and verifier("8", "7") == 0.0
    assert verifier("boom", "7") is None  # raised: counted as unparsed
    with pytest.raises(UsageError, match="--verifier 'my_checks:missing': cannot import it"):
        make_verifier("my_checks:missing")
    with pytest.raises(UsageError, match="--verifier 'nope': choose one of"):
        make_verifier("nope")


# ---------------------------------------------------------------------------- the data file's task
def test_every_format_reads_the_same_rows_and_the_split_is_fixed(tmp_path):
    from datasets import Dataset

    jsonl = write_gsm8k(tmp_path / "train.jsonl", n=50)
    rows = [json.loads(line) for line in open(jsonl)]
    Dataset.from_list(rows).to_csv(str(tmp_path / "train.csv"), index=False)
    Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    tasks = [DatasetTask(str(tmp_path / f"train.{ext}"), "question") for ext in ("jsonl", "csv", "parquet")]
    assert all(t.train == tasks[0].train and t.held_out == tasks[0].held_out for t in tasks)
    task = tasks[0]
    assert len(task.held_out) == 5 and len(task.train) == 45  # --eval-fraction 0.1
    assert not set(task.held_out) & set(task.train) or len(set(task.train)) < 45  # (sums repeat; rows do not)
    assert task.held_out == DatasetTask(jsonl, "question").held_out  # the same rows in every run
    # Training passes over every row once per pass, each pass in its own order, the same in every process.
    first, second = ([task.problem(i, seed=3).prompt for i in range(k, k + 45)] for k in (0, 45))
    assert sorted(first) == sorted(second) == sorted(p for p, _ in task.train) and first != second
    assert [task.problem(i, 3) for i in range(45)] == [DatasetTask(jsonl, "question").problem(i, 3) for i in range(45)]
    held = task.problem(2, HELD_OUT_SEED)
    assert (held.prompt, held.answer) == task.held_out[2] and held.demonstration == held.answer
    assert set("What is plus?#0123456789=+\n") <= set(task.alphabet)
    # a second file holds out its own rows, and the first trains on all of its own
    other = DatasetTask(jsonl, "question", eval_path=write_gsm8k(tmp_path / "test.jsonl", n=7, seed=1))
    assert len(other.train) == 50 and len(other.held_out) == 7


def test_unparsed_completions_are_counted_apart_from_wrong_and_truncated_ones(tmp_path):
    task = DatasetTask(write_gsm8k(tmp_path / "d.jsonl", n=10), "question", eval_fraction=0.0)
    tokenizer = char_tokenizer(task.alphabet)
    answer = task.problem(0, 0).answer.rsplit("#### ", 1)[1]
    completions = [f"#### {answer}", "#### 99", "I think so", f"#### {answer}"]
    finished = [True, True, True, False]  # the last one hit max_len: 0, and not the verifier's to read
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    L = max(map(len, ids))
    batch = TensorDict(tokens=torch.tensor([i + [0] * (L - len(i)) for i in ids]),
                       prompt_length=torch.zeros(4, dtype=torch.long),
                       completion_length=torch.tensor([len(i) for i in ids]),
                       prompt_id=torch.zeros(4, dtype=torch.long),
                       finished=torch.tensor(finished), batch_size=[4])
    rewards, unparsed = score(task, tokenizer, batch, seed=0)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and unparsed.tolist() == [False, False, True, False]


# ---------------------------------------------------------------------------- bad input
def _script(tmp_path, *flags):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "grpo_arith.py"), "--run-dir",
                           str(tmp_path / "runs"), *flags], capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("make, flags, message", [
    (lambda d: str(d / "missing.jsonl"), (), "--dataset '{path}': no such file"),
    (lambda d: (d / "empty.jsonl").write_text("") or str(d / "empty.jsonl"), (), "the file is empty"),
    (lambda d: write_gsm8k(d / "g.jsonl"), ("--prompt-column", "problem"),
     "has no column 'problem' (its columns: question, answer"),
    (lambda d: write_gsm8k(d / "g.jsonl"), ("--verifier", "no_such_module:check"),
     "--verifier 'no_such_module:check': cannot import it"),
    (lambda d: write_gsm8k(d / "g.jsonl"), ("--eval-every", "1", "--eval-fraction", "0"),
     "--eval-every: --dataset holds no problems out"),
])
def test_bad_input_is_one_line_naming_it_before_anything_is_written(tmp_path, make, flags, message):
    path = make(tmp_path)
    proc = _script(tmp_path, "--dataset", path, "--prompt-column", "question", *flags)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and message.format(path=path) in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing written


# ---------------------------------------------------------------------------- end to end
def _args(tmp_path, data, **kw):
    return grpo.Args(**{**dict(dataset=data, prompt_column="question", num_prompts=8, group_size=4, max_len=40,
                               max_prompt_len=24, micro_batch=8, num_minibatches=1, update_epochs=1, sft_steps=20,
                               total_timesteps=64, eval_every=1, eval_prompts=6, checkpoint_every=1, progress=False,
                               device="cpu", run_dir=str(tmp_path / "runs")), **kw})


def test_tiny_model_trains_exports_restarts_from_the_export_and_evaluates(tmp_path):
    from transformers import AutoModelForCausalLM

    data = write_gsm8k(tmp_path / "gsm.jsonl")
    args = _args(tmp_path, data)
    logged = grpo.train(args, task_maker(args))
    assert 0 <= float(logged["charts/unparsed_frac"]) <= 1 and "charts/eval_solve_rate" in logged
    (run,) = [d for d in os.listdir(tmp_path / "runs") if d.startswith("grpo-gsm__")]
    exported = os.path.join(tmp_path, "runs", run, "model")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(exported))
    checkpoint = torch.load(os.path.join(tmp_path, "runs", run, "checkpoint.pt"), weights_only=False)
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    for name, value in reloaded.state_dict().items():  # the export is the checkpoint's policy
        assert torch.equal(value, checkpoint["model"][name]), name

    # a new run starts from it (no warm start: the export already answers in the data's format)
    again = _args(tmp_path, data, model_path=exported, sft_steps=0, exp_name="from_export")
    grpo.train(again, task_maker(again))

    out = tmp_path / "evaluation.json"
    result = evaluate.main(evaluate.Args(model_path=exported, dataset=data, prompt_column="question", samples=4,
                                         max_len=40, max_prompt_len=24, out=str(out)))
    assert json.loads(out.read_text())["problems"] == result["problems"] == 6  # the held-out tenth of 60 rows
    pass_at = [v["mean"] for v in result["pass_at_k"].values()]
    assert list(result["pass_at_k"]) == [1, 2, 4] and pass_at == sorted(pass_at)  # pass@k grows with k
    assert pass_at[0] == pytest.approx(result["solve_rate"]["mean"])  # pass@1 is the solve rate
    assert result["solve_rate"]["stderr"] >= 0


def test_evaluation_cli_prints_and_writes_and_names_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "leanrl.llm.evaluate", "--model-path", str(tmp_path / "nowhere"),
                           "--dataset", write_gsm8k(tmp_path / "g.jsonl"), "--prompt-column", "question"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "nowhere" in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "evaluation.json").exists()
