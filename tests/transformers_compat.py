"""transformers renamed its models' `past_key_values` argument to `cache` (5.24 warns on the old name, to be removed
in 5.40; 5.19, in the vLLM environment, knows only the old one): the tests pass a KV cache by whichever name the
installed version takes."""

import inspect


def with_cache(model, cache) -> dict:
    """Keyword arguments that give `model.forward` the KV cache `cache` (updated in place by the call)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
