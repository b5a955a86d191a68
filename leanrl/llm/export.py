"""Exporting a trained policy as a Hugging Face transformers model directory, which transformers, vLLM and other
servers load as they load any pretrained model."""

import copy
import os
import shutil

from leanrl.llm.models import _save, _staged


def export_model(model, tokenizer, directory: str, *, generation: dict | None = None) -> str:
    """Write `model` (its weights in its own dtype, as safetensors), `tokenizer` and a `generation_config.json` as
    the transformers model directory `directory`, replacing an earlier export only once the new one is complete: a
    failed export leaves the earlier one as it was. Returns the absolute path.

    The generation config is the model's with the tokenizer's EOS/pad/BOS ids (those the sampler ends and pads
    with) and the `generation` fields as given, e.g. `dict(do_sample=True, temperature=0.7, top_p=1.0, top_k=0)`:
    top_k 0 and top_p 1.0 are off for transformers and vLLM alike, where a top_k left out is transformers' 50.
    `model` is left as it is (the live training model: not moved, cast or reconfigured)."""
    # The same weights with configs of their own: save_pretrained writes the dtype it saves into the model's config.
    saved = copy.copy(model)
    saved.config, saved.generation_config = copy.deepcopy(model.config), copy.deepcopy(model.generation_config)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)
    unknown = saved.generation_config.update(**{k: v for k, v in ids.items() if v is not None} | (generation or {}))
    if unknown:
        raise ValueError(f"generation: {sorted(unknown)} are not GenerationConfig fields")
    directory = os.path.abspath(directory)
    with _staged(directory) as tmp:
        _save(saved, tokenizer, tmp)
        old = f"{tmp}.old"  # as unique as tmp
        if os.path.exists(directory):
            os.replace(directory, old)  # a rename replaces no directory that holds files: the earlier export aside
        try:
            os.replace(tmp, directory)
        except BaseException:
            if os.path.exists(old):
                os.replace(old, directory)
            raise
        shutil.rmtree(old, ignore_errors=True)
    return directory
