"""LLM policies: local causal LMs (Llama, Qwen2, Qwen3 families) and the built-in sampler."""

from leanrl.llm.models import char_tokenizer, load_model, save_cached, save_tiny_model
from leanrl.llm.sampler import Sampler

__all__ = ["char_tokenizer", "save_tiny_model", "save_cached", "load_model", "Sampler"]
