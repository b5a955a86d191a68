"""The sampler a GRPO run's arguments ask for (`--sampler`): the built-in one or a vLLM engine, built alike."""

from tensordict import from_module

from leanrl.llm.sampler import Sampler


def make_sampler(model, tokenizer, args, model_dir: str | None = None, backend: str | None = None, **overrides):
    """The built-in sampler over `model`'s own tensors, or (`--sampler vllm`) a vLLM engine built from `model_dir`
    that follows the same tensors: both fill the same batches, and both see an in-place weight update. `args`: the
    sampling settings of GRPO's `Args` (num_slots, max_len, max_prompt_len, temperature, top_p, top_k, seed,
    sampler, compile, cudagraphs)."""
    settings = dict(num_slots=args.num_slots, max_len=args.max_len, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, max_prompt_len=args.max_prompt_len, seed=args.seed)
    if (backend or args.sampler) == "vllm":
        from leanrl.llm.vllm_sampler import VLLMSampler  # an optional extra: imported only when asked for
        return VLLMSampler(model_dir, params=from_module(model).data, **{**settings, **overrides})
    return Sampler(model, **{**settings, "compile": args.compile, "cudagraphs": args.cudagraphs, **overrides})
