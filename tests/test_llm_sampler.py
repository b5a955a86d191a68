"""The built-in LLM sampler and local models (leanrl.llm): CPU, tiny models, fixed seeds."""

import json
import os

import pytest
import torch

from leanrl.llm import char_tokenizer, load_model, save_tiny_model

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
