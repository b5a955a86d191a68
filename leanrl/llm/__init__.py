"""LLM policies: local causal LMs (Llama, Qwen2, Qwen3 families) and the built-in sampler."""
