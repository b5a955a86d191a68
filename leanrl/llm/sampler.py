"""The built-in LLM sampler: a fixed number of slots over a static KV cache, continuous batching, in-flight
weight updates, the log-prob and policy version of every sampled token.

The decode step is one function of fixed shapes ([n] tokens in, per layer a [slots, kv_heads, max_len, head_dim]
cache updated in place at its first n slots, [n] tokens out) that `leanrl.accelerate` compiles and, on CUDA,
captures in a CUDA graph, once per step size n (all slots, a half, a quarter: a draining batch's running sequences
move down to its first slots and the step shrinks to them) and cache length (its attention reads the fewest of
max_len, a half, a quarter positions that hold the running sequences). It reads the weights of the transformers
model itself (no copy), so copying new values into `sampler.params` in place is a weight update that a captured
graph sees. On a CPU it multiplies by a packed copy of each weight matrix (oneDNN's blocked layout), made again
whenever the version of the weights changes.

Decoding a sequence: the prompt's tokens go into a slot's cache (prefill, one slot at a time, padded to a fixed
length); the decode step then feeds the last prompt token and samples the first completion token, so every
completion token (the first included) is sampled, scored and version-tagged in the same compiled step.
"""

import contextlib
import time
from collections import deque

import torch
import torch.nn.functional as F
from tensordict import TensorDict, from_module

from leanrl.graphs import accelerate
from leanrl.cli import UsageError
from leanrl.llm.models import FAMILIES


# The products a layer (and the head) computes, each from one or more weight matrices concatenated along the output.
PRODUCTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate", "up"), "down": ("down",),
            "lm_head": ("lm_head",)}


# `F.linear(x, weight, bias)` with `packed = pack_weight(weight)`. An opaque op to torch.compile: inductor takes a
# packed weight only as a frozen constant, and a sampler's weights change. Defined through torch.library.Library
# rather than torch.library.custom_op: custom_op's Python autograd wrapper costs more than a small product, on
# every product of every decode step (docs/samplers.md).
_library = torch.library.Library("leanrl", "FRAGMENT")
_library.define("packed_linear(Tensor x, Tensor packed, SymInt out_features, Tensor? bias) -> Tensor")
_library.impl("packed_linear", lambda x, packed, out_features, bias: torch.ops.mkldnn._linear_pointwise(
    x, packed, bias, "none", [], ""), "CompositeExplicitAutograd")
packed_linear = torch.ops.leanrl.packed_linear.default


@torch.library.register_fake("leanrl::packed_linear")
def _(x, packed, out_features, bias):
    return x.new_empty(*x.shape[:-1], out_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


# A packed weight multiplies faster from about this size up; below it oneDNN's fixed cost per call is more than it
# saves (docs/samplers.md), so smaller products stay plain.
PACK_MIN_ELEMENTS = 512 * 512

# The shortest cache length a decode step shrinks to (`shrink_cache`): each length is a graph of its own.
MIN_SHRUNK_CACHE = 64


class _Group:
    """One prompt and its G completions; `done[j]` is member j's finished record."""

    def __init__(self, order, prompt_id, tokens, group_size):
        self.order, self.prompt_id, self.tokens, self.done = order, prompt_id, tokens, [None] * group_size
        self.kv_slot, self.kv_version = None, None  # the slot whose prefill holds the prompt's cache, its version


def check_settings(num_slots, max_len, max_prompt_len, temperature, top_p, top_k) -> int:
    """The settings every sampler takes, each bad one a clear error naming it; returns `max_prompt_len` (by default
    `max_len - 1`)."""
    max_prompt_len = max_len - 1 if max_prompt_len is None else max_prompt_len
    if num_slots < 1 or max_len < 2 or not 1 <= max_prompt_len <= max_len - 1:
        raise UsageError(f"num_slots={num_slots}, max_len={max_len}, max_prompt_len={max_prompt_len}: need "
                         "num_slots >= 1 and 1 <= max_prompt_len <= max_len - 1")
    if not temperature > 0:
        raise UsageError(f"temperature={temperature}: must be > 0 (for greedy decoding use top_k=1)")
    if not 0 < top_p <= 1 or top_k < 0:
        raise UsageError(f"top_p={top_p}, top_k={top_k}: need 0 < top_p <= 1 and top_k >= 0")
    return max_prompt_len


def check_token_ids(vocab_size: int, **token_ids):
    for name, value in token_ids.items():
        if value is None or not 0 <= value < vocab_size:
            raise UsageError(f"{name}={value}: must be a token id of the model's vocabulary [0, {vocab_size})")


def may_admit(ahead: int, need: int, version: int, min_version: int, carry_over: bool, min_version_step: int):
    """Whether `fill` may start another group now. With `ahead` groups admitted before it, it lands in the batch
    `ahead // need` fills after this one (groups complete about in admission order), whose min_version is higher by
    `min_version_step` per fill: it starts only once this step's version reaches that, else it would be restarted
    there (PipelineRL's admission). Without carry_over only this batch's groups start, and none outlives the call."""
    later = ahead // need
    if not carry_over:
        return later == 0
    return version >= min_version + min_version_step * later


class Sampler:
    def __init__(self, model, *, num_slots: int, max_len: int, eos_token_id: int, pad_token_id: int,
                 temperature=1.0, top_p=1.0, top_k=0, recompute_kv=False, compile=False, cudagraphs=False,
                 max_prompt_len: int | None = None, seed: int = 0, pack_weights: bool | None = None,
                 shrink_steps: bool = True, shrink_cache: bool = True):
        """`max_prompt_len` (default `max_len - 1`): the longest prompt accepted. A prompt is prefilled at its length
        rounded up to a power of two (at least 8, at most max_prompt_len): one function per length used. `seed`:
        the sampler's own random generator (the noise of the Gumbel-max draw), so sampling does not depend on other
        users of torch's global generator. `pack_weights` (default: on a CPU, for float32 and bfloat16 weights):
        a product of PRODUCTS with at least PACK_MIN_ELEMENTS weights multiplies by one packed copy of its
        concatenated weight matrices (the others stay plain), made at construction and again whenever the version
        given to `fill`'s step_boundary() or to `decode` changes. Weights changed in place under the same version
        are then not seen. `shrink_steps`: `fill`'s decode step runs over the first num_slots, num_slots / 2 or
        num_slots / 4 slots, the fewest that hold every running sequence (those above move down first), so the
        steps that drain a batch cost what its running sequences need; False: every step runs over all slots.
        `shrink_cache`: its attention reads the first max_len, max_len / 2 or max_len / 4 cache positions (not
        under MIN_SHRUNK_CACHE), the fewest that hold every running sequence's tokens, so short sequences under a
        long max_len read a short cache; False: the whole cache. Each pair of sizes is compiled (and captured) on
        first use."""
        config = model.config
        self.family = config.model_type
        if self.family not in FAMILIES:
            raise UsageError(f"model: model_type {self.family!r} is not supported (supported: {FAMILIES})")
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            raise UsageError(f"model: layer_types {config.layer_types}: only full attention is supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UsageError(f"model: hidden_act {config.hidden_act!r}: only silu is supported")
        vocab = config.vocab_size
        check_token_ids(vocab, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        max_prompt_len = check_settings(num_slots, max_len, max_prompt_len, temperature, top_p, top_k)
        self.num_slots, self.max_len, self.max_prompt_len = num_slots, max_len, max_prompt_len
        self.eos_token_id, self.pad_token_id, self.vocab_size = eos_token_id, pad_token_id, vocab
        self.temperature, self.top_p, self.top_k, self.recompute_kv = temperature, top_p, top_k, recompute_kv

        # The weights: aliases of the model's own tensors (same storage), never copies (packed ones follow: _pack).
        self.params = from_module(model).data
        base = model.model
        self.embed, self.norm = base.embed_tokens.weight.data, base.norm.weight.data
        self.head = dict(lm_head=model.lm_head.weight.data)  # the embedding itself when tied (SmolLM2)
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
            linears.update(gate=mlp.gate_proj, up=mlp.up_proj, down=mlp.down_proj)
            w = {n: m.weight.data for n, m in linears.items()}
            # Qwen2's q/k/v biases; Llama's attention_bias / mlp_bias options
            w.update({n + "_bias": m.bias.data for n, m in linears.items() if m.bias is not None})
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of each head's query and key
                w.update(q_norm=attn.q_norm.weight.data, k_norm=attn.k_norm.weight.data)
            w.update(ln1=layer.input_layernorm.weight.data, ln2=layer.post_attention_layernorm.weight.data)
            self.layers.append(w)
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        rotary = base.rotary_emb  # its inv_freq and scaling cover every static RoPE variant of these families
        self.inv_freq, self.rope_scale = rotary.inv_freq.detach().float(), float(rotary.attention_scaling)

        # Static buffers: every step reads and writes these in place, so a captured graph stays valid.
        device, dtype = self.embed.device, self.embed.dtype
        self.device = device
        packable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        if pack_weights is None:
            pack_weights = packable and torch.backends.mkldnn.is_available()
        elif pack_weights and not packable:
            raise ValueError(f"pack_weights=True: weights on {device} in {dtype}; packing is for float32 or bfloat16 "
                             "weights on a CPU")
        self.pack_weights, self._packed_version = pack_weights, None
        self._pack()
        S, L = num_slots, max_len
        # The KV cache: per layer a [slots, kv_heads, max_len, head_dim] tensor of its own. One tensor for all
        # layers would make each layer's cache a view, and inductor then copies the whole cache at every write
        # (far slower than the in-place write it does on a tensor of its own).
        shape = (S, self.num_kv_heads, L, self.head_dim)
        self.k_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.pos = torch.zeros(S, dtype=torch.long, device=device)  # cache position of the token fed next
        self.last = torch.zeros(S, dtype=torch.long, device=device)  # the token fed next
        self.active = torch.zeros(S, dtype=torch.bool, device=device)
        self.ended = torch.zeros(S, dtype=torch.long, device=device)  # 0 running, 1 EOS, 2 cut at max_len
        self.seq_tokens = torch.full((S, L), pad_token_id, dtype=torch.long, device=device)
        self.seq_logprobs = torch.zeros(S, L, dtype=torch.float32, device=device)
        self.seq_version = torch.zeros(S, L, dtype=torch.long, device=device)
        self.version = torch.zeros((), dtype=torch.long, device=device)
        self.noise = torch.ones(S, vocab, dtype=torch.float32, device=device)
        self.slot_index = torch.zeros(1, dtype=torch.long, device=device)
        self.source_index = torch.zeros(1, dtype=torch.long, device=device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._arange_s = torch.arange(S, device=device)
        self._arange_l = torch.arange(L, device=device)

        if compile:  # one static graph per shape: a new slot count must not turn on dynamic shapes
            for buf in (*self.k_cache, *self.v_cache, self.pos, self.last, self.active, self.ended, self.seq_tokens,
                        self.seq_logprobs, self.seq_version, self.noise, self._arange_s, self._arange_l):
                torch._dynamo.mark_static(buf)
        acc = dict(compile=compile, cudagraphs=cudagraphs, device=device)
        # On a CPU a step's time grows with its slots, and a batch's last sequences run alone in a full-width step.
        self.step_sizes = sorted({max(S >> i, 1) for i in range(3 if shrink_steps else 1)})
        # The attention reads the cache up to its length T, so a shorter cache is a cheaper step.
        self.cache_sizes = sorted({L} | {L >> i for i in range(1, 3 if shrink_cache else 1)
                                         if L >> i >= MIN_SHRUNK_CACHE})
        # dynamic=False: a size is a constant of its own graph, never a symbolic dimension shared by the sizes.
        # On a CPU inductor's C++ wrapper runs the step's kernels with no Python between them (faster steps of a
        # tiny model; a larger one's are matrix products either way).
        step_kwargs = dict(dynamic=False, options=dict(cpp_wrapper=device.type == "cpu"))
        self._decodes = {(n, T): accelerate(self._decode_step_fn(n, T), name=f"decode_step_{n}x{T}",
                                            compile_kwargs=step_kwargs, **acc)
                         for n in self.step_sizes for T in self.cache_sizes}
        self._acc, self._prefills = acc, {}
        self._copy_cache = accelerate(self._copy_cache_fn, name="copy_cache", **acc)

        # Host-side scheduling state (Python ints only: no device reads besides `ended`, once per step).
        self._slot = [None] * S  # per slot: [group, member, prompt_length, generated, first_version]
        self._queue = deque()  # (group, member) waiting for a slot
        self._ready = []  # complete groups not yet in a batch (carry_over)
        self._order = 0
        self._version_now = None

    # ---- the model (the same math as transformers' Llama / Qwen2 / Qwen3 forward) ----

    def _pack(self):
        if self.pack_weights:
            for w in (*self.layers, self.head):
                w["packed"] = {}
                for product, names in PRODUCTS.items():
                    if not all(n in w for n in names) or sum(w[n].numel() for n in names) < PACK_MIN_ELEMENTS:
                        continue
                    sizes = [w[n].shape[0] for n in names]
                    bias = [w.get(n + "_bias") for n in names]
                    bias = None if all(b is None for b in bias) else torch.cat(
                        [w[n].new_zeros(size) if b is None else b for n, size, b in zip(names, sizes, bias)])
                    w["packed"][product] = (pack_weight(torch.cat([w[n] for n in names])), sizes, bias)

    def use_version(self, version: int):
        """The weights are now those of `version`: packed again if it changed (fill and decode call it)."""
        if self.pack_weights and version != self._packed_version:
            self._pack()
            self._packed_version = version

    def _products(self, x, w, product):
        """x times each weight matrix of PRODUCTS[product] (plus bias): one packed product split, or one each."""
        if self.pack_weights and product in w["packed"]:
            packed, sizes, bias = w["packed"][product]
            return packed_linear(x, packed, sum(sizes), bias).split(sizes, dim=-1)
        return [F.linear(x, w[n], w.get(n + "_bias")) for n in PRODUCTS[product]]

    def _rms(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, positions):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.embed.dtype), (emb.sin() * self.rope_scale).to(self.embed.dtype)

    @staticmethod
    def _rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _qkv(self, w, h, cos, sin):
        """h [N, hidden] -> q [N, heads, hd], k and v [N, kv_heads, hd], RoPE applied."""
        n = h.shape[0]
        q, k, v = self._products(h, w, "qkv")
        q = q.view(n, self.num_heads, self.head_dim)
        k, v = k.view(n, self.num_kv_heads, self.head_dim), v.view(n, self.num_kv_heads, self.head_dim)
        if "q_norm" in w:
            q, k = self._rms(q, w["q_norm"]), self._rms(k, w["k_norm"])
        cos, sin = cos[:, None], sin[:, None]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _attend(self, q, keys, values, mask):
        """q [N, heads, hd] against keys/values [N, kv_heads, T, hd] (one cache row per query) or [kv_heads, T,
        hd] (one sequence, prefill); mask [N, T] (True = visible)."""
        n, g = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(n, self.num_kv_heads, g, self.head_dim)  # query head i reads kv head i // g (repeat_kv)
        kv = "nktd" if keys.dim() == 4 else "ktd"
        scores = torch.einsum(f"nkgd,{kv}->nkgt", q, keys) * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum(f"nkgt,{kv}->nkgd", probs, values).reshape(n, self.num_heads * self.head_dim)

    def _mlp_residual(self, w, x, attn):
        x = x + self._products(attn, w, "o")[0]
        h = self._rms(x, w["ln2"])
        gate, up = self._products(h, w, "gate_up")
        return x + self._products(F.silu(gate) * up, w, "down")[0]

    def _prefill_fn(self, length):
        def prefill(slot):
            """Write the cache of positions [0, length) of `slot` from its token row (causal attention); the
            rest of the slot's cache is zeroed (padding the write to the whole slot keeps it off a view)."""
            tokens = self.seq_tokens.index_select(0, slot)[0, :length]
            pad = (0, 0, 0, self.max_len - length)
            positions = self._arange_l[:length]
            cos, sin = self._rope(positions)
            causal = positions[None, :] <= positions[:, None]
            x = self.embed[tokens]
            for i, w in enumerate(self.layers):
                q, k, v = self._qkv(w, self._rms(x, w["ln1"]), cos, sin)
                k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, length, hd]
                self.k_cache[i].index_copy_(0, slot, F.pad(k, pad)[None])
                self.v_cache[i].index_copy_(0, slot, F.pad(v, pad)[None])
                x = self._mlp_residual(w, x, self._attend(q, k, v, causal))
        return prefill

    def _prefill(self, length):
        """The prefill of positions [0, length), accelerated once per length."""
        if length not in self._prefills:
            self._prefills[length] = accelerate(self._prefill_fn(length), name=f"prefill_{length}", **self._acc)
        return self._prefills[length]

    def _prompt_length(self, P):  # the prefill length of a prompt of P tokens
        return min(max(1 << (P - 1).bit_length(), 8), self.max_prompt_len)

    def _copy_cache_fn(self, source, slot):
        """The cache of `source` into `slot`: a group's members share their prompt's keys and values. Positions
        past the prompt hold the source's own tokens; the slot overwrites each before it can see it."""
        for k, v in zip(self.k_cache, self.v_cache):
            k.index_copy_(0, slot, k.index_select(0, source))
            v.index_copy_(0, slot, v.index_select(0, source))

    def logits(self, tokens, positions, cache_len: int | None = None):
        """Logits of one token for each of the first len(tokens) slots at its position, writing its key/value
        into the cache; attention reads the first `cache_len` positions (default max_len), past every position."""
        n, T = tokens.shape[0], cache_len or self.max_len
        slots = self._arange_s[:n]
        cos, sin = self._rope(positions)
        visible = self._arange_l[None, :T] <= positions[:, None]  # never the earlier occupants' entries
        x = self.embed[tokens]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(w, self._rms(x, w["ln1"]), cos, sin)
            self.k_cache[i][slots, :, positions] = k  # in place into the whole cache: the graph's buffers stay put
            self.v_cache[i][slots, :, positions] = v
            keys, values = self.k_cache[i][:n, :, :T], self.v_cache[i][:n, :, :T]
            x = self._mlp_residual(w, x, self._attend(q, keys, values, visible))
        return self._products(self._rms(x, self.norm), self.head, "lm_head")[0].float().view(n, -1)

    # ---- the decode step (compiled; CUDA-graphed on CUDA: no arguments, no outputs, buffers only) ----

    def _decode_step_fn(self, n, T):
        def decode_step():
            """Sample the next token of slots [0, n) (idle slots compute and are ignored), attending over the
            first T cache positions."""
            slots, active, pos = self._arange_s[:n], self.active[:n], self.pos[:n]
            logits = self.logits(self.last[:n], pos, T) / self.temperature
            logprobs = logits.log_softmax(-1)  # over the full vocabulary: top-k/top-p restrict sampling only
            filtered = logits
            if self.top_k > 0:
                kth = filtered.topk(min(self.top_k, self.vocab_size), dim=-1).values[:, -1:]
                filtered = filtered.masked_fill(filtered < kth, float("-inf"))
            if self.top_p < 1:
                sorted_logits, order = filtered.sort(dim=-1, descending=True)
                probs = sorted_logits.softmax(-1)
                drop = probs.cumsum(-1) - probs > self.top_p  # keep the smallest prefix reaching top_p
                filtered = filtered.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
            # Gumbel-max as an exponential race: argmax p_i / E_i, E_i ~ Exp(1) drawn outside the step into a buffer.
            token = (filtered - self.noise[:n].log()).argmax(-1)
            at = (pos + 1).clamp(max=self.max_len - 1)
            keep = ~active
            self.seq_tokens[slots, at] = torch.where(keep, self.seq_tokens[slots, at], token)
            self.seq_logprobs[slots, at] = logprobs.gather(1, token[:, None])[:, 0]
            self.seq_version[slots, at] = self.version
            ended = torch.where(token == self.eos_token_id, 1, torch.where(at == self.max_len - 1, 2, 0))
            self.ended[:n].copy_(ended * active)
            self.last[:n].copy_(torch.where(keep, self.last[:n], token))
            pos.add_(active.long())
        return decode_step

    def decode(self, version: int, num_slots: int | None = None, cache_len: int | None = None) -> list[int]:
        """One decode step over the first `num_slots` slots (one of step_sizes; default all) and `cache_len` cache
        positions (one of cache_sizes, past every stepped slot's position; default max_len) with weights of
        `version`; returns per slot 0 (running, idle or not stepped), 1 (ended with EOS) or 2 (cut at max_len)."""
        n = num_slots or self.num_slots
        self.use_version(version)
        self.version.fill_(version)
        self.noise[:n].exponential_(generator=self.generator)
        self._decodes[n, cache_len or self.max_len]()
        # The scheduling boundary: the one device read of a step (which slots just ended).
        return self.ended[:n].tolist() + [0] * (self.num_slots - n)

    @contextlib.contextmanager
    def seeded(self, seed: int):
        """Within it, sampling draws from `seed`; after it, the sampler draws as if it had sampled nothing within.
        Evaluations: the same weights sample the same tokens every time, and training samples as without them."""
        state = self.generator.get_state()
        self.generator.manual_seed(seed)
        try:
            yield
        finally:
            self.generator.set_state(state)

    # ---- scheduling (host) ----

    def make_batch(self, num_sequences: int) -> TensorDict:
        B, L, d = num_sequences, self.max_len, self.device
        return TensorDict(
            tokens=torch.full((B, L), self.pad_token_id, dtype=torch.long, device=d),
            prompt_length=torch.zeros(B, dtype=torch.long, device=d),
            completion_length=torch.zeros(B, dtype=torch.long, device=d),
            prompt_id=torch.zeros(B, dtype=torch.long, device=d),
            completion_mask=torch.zeros(B, L, dtype=torch.bool, device=d),
            logprobs=torch.zeros(B, L, dtype=torch.float32, device=d),
            version=torch.zeros(B, L, dtype=torch.long, device=d),
            finished=torch.zeros(B, dtype=torch.bool, device=d),
            batch_size=[B], device=d)

    def _check_prompt(self, prompt_id, tokens):
        if not 1 <= len(tokens) <= self.max_prompt_len:
            raise UsageError(f"prompt_id {prompt_id}: {len(tokens)} tokens; a prompt needs 1 to "
                             f"{self.max_prompt_len} tokens (max_len={self.max_len} holds prompt + completion)")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise UsageError(f"prompt_id {prompt_id}: token ids outside the model's vocabulary [0, {self.vocab_size})"
                             " (vocabulary mismatch between tokenizer and model?)")

    def _check_batch(self, batch, group_size: int) -> int:
        """The number of groups `batch` holds, or a clear error if it cannot hold whole ones of this sampler."""
        B = batch.batch_size[0]
        if group_size < 1 or B % group_size:
            raise ValueError(f"batch of {B} sequences is not divisible by group_size={group_size}")
        if batch["tokens"].shape[1] != self.max_len:
            raise ValueError(f"batch: tokens of length {batch['tokens'].shape[1]}, the sampler's max_len is "
                             f"{self.max_len} (make it with sampler.make_batch)")
        return B // group_size

    def _queue_group(self, prompts, group_size: int) -> bool:
        """Queue the members of the next prompt's group, checked; False when `prompts` has run out."""
        try:
            prompt_id, tokens = next(prompts)
        except StopIteration:
            return False
        tokens = list(tokens)
        self._check_prompt(prompt_id, tokens)
        group = _Group(self._order, prompt_id, tokens, group_size)
        self._order += 1
        self._queue.extend((group, j) for j in range(group_size))
        return True

    def _start(self, s, group, member) -> bool:
        """Put a queued sequence into free slot s: its token row, then its prompt's cache, copied from the slot
        of a member of its group still running on the prompt prefilled with the same weights, else prefilled
        (and that slot becomes the group's source). Returns whether it prefilled."""
        P = len(group.tokens)
        row = torch.full((self.max_len,), self.pad_token_id, dtype=torch.long)
        row[:P] = torch.tensor(group.tokens)
        self.seq_tokens[s].copy_(row)
        self.slot_index.fill_(s)
        src = group.kv_slot
        share = (src is not None and self._slot[src] is not None and self._slot[src][0] is group
                 and group.kv_version == self._version_now)
        if share:
            self.source_index.fill_(src)
            self._copy_cache(self.source_index, self.slot_index)
        else:
            self._prefill(self._prompt_length(P))(self.slot_index)
            group.kv_slot, group.kv_version = s, self._version_now
        self.pos[s] = P - 1
        self.last[s] = group.tokens[-1]
        self.active[s] = True
        self._slot[s] = [group, member, P, 0, None]
        return not share

    def _release(self, s):
        self.active[s] = False
        self.pos[s] = 0
        self._slot[s] = None

    def _move_down(self, busy: list[int]) -> tuple[int, int]:
        """The step size for `busy` slots, the smallest of step_sizes holding them all, after moving the running
        sequences above it into free slots below it (cache, token rows and host record); and how many moved."""
        n = next(n for n in self.step_sizes if n >= len(busy))
        free = (t for t in range(n) if self._slot[t] is None)
        for s in busy:
            if s < n:
                continue
            t = next(free)
            self.source_index.fill_(s)
            self.slot_index.fill_(t)
            self._copy_cache(self.source_index, self.slot_index)
            for buffer in (self.seq_tokens, self.seq_logprobs, self.seq_version, self.pos, self.last, self.active):
                buffer[t] = buffer[s]
            self._slot[t] = self._slot[s]
            group = self._slot[t][0]
            if group.kv_slot == s:  # members restarted later still copy the prompt's cache from here
                group.kv_slot = t
            self._release(s)
        return n, sum(s >= n for s in busy)

    def _finish(self, s, finished, min_version):
        """Slot s ended: keep its record in its group, which may be complete now."""
        group, member, P, C, v0 = self._slot[s]
        group.done[member] = (self.seq_tokens[s].clone(), self.seq_logprobs[s].clone(), self.seq_version[s].clone(),
                              P, C, finished, v0)
        self._release(s)
        return self._complete(group, min_version)

    def _complete(self, group, min_version):
        """If every member of `group` is done, restart the stale ones (members finished in an earlier call, before
        min_version rose) and return their count, or mark the group ready."""
        if any(r is None for r in group.done):
            return 0
        stale = [j for j, r in enumerate(group.done) if r[6] < min_version]
        for j in stale:
            group.done[j] = None
            self._queue.appendleft((group, j))
        if not stale:
            self._ready.append(group)
        return len(stale)

    def fill(self, batch, prompts, *, group_size: int, step_boundary=lambda: 0, min_version=0,
             carry_over=True, min_version_step=0) -> dict:
        """Fill `batch` with `len(batch) // group_size` complete groups of `group_size` completions each.

        `prompts` yields `(prompt_id, token ids)`, pulled lazily. `step_boundary()` runs before every decode step
        and returns the version of the weights that step uses (it may copy newer weights into `self.params` in
        place); versions never decrease, so a sequence's oldest version is that of its first token. A sequence
        whose first token is older than `min_version` is restarted from its prompt (stats["dropped"]).
        `carry_over=True` leaves the sequences still running when the batch is full in their slots for the next
        call; `carry_over=False` admits only this batch's groups, so none outlives the call. `min_version_step`: how
        much min_version rises from one call to the next (an async collector: the number of collectors); a group
        for a later call then starts only once its tokens will be recent enough there (`may_admit`); 0: admit
        whenever a slot is free. If `prompts` runs out, the batch holds stats["groups"] groups and its other rows
        are empty (no completion tokens)."""
        need = self._check_batch(batch, group_size)
        prompts = iter(prompts)
        t0 = time.perf_counter()
        stats = dict(decode_steps=0, dropped=0, busy=0, stepped_slots=0, stepped_positions=0, moves=0, prefills=0,
                     cache_copies=0, recomputes=0)

        # Carried over from the previous call: restart what the new min_version forbids.
        for s, slot in enumerate(self._slot):
            if slot is not None and slot[4] is not None and slot[4] < min_version:
                self._queue.appendleft((slot[0], slot[1]))
                self._release(s)
                stats["dropped"] += 1
        for group in self._ready[:]:
            self._ready.remove(group)
            stats["dropped"] += self._complete(group, min_version)
        in_flight = {id(g): g for g, _ in self._queue}
        in_flight.update({id(s[0]): s[0] for s in self._slot if s is not None})
        ahead = len(self._ready) + len(in_flight)  # groups admitted before the next one
        exhausted = False

        while len(self._ready) < need:
            version = step_boundary()
            if version < min_version:  # everything sampled now would be dropped: an endless loop otherwise
                raise ValueError(f"step_boundary() returned version {version} < min_version={min_version}")
            self.use_version(version)  # before any prefill with them
            changed = self._version_now is not None and version != self._version_now
            self._version_now = version
            if changed and self.recompute_kv:  # AReaL: the running sequences' cache under the new weights
                for s, slot in enumerate(self._slot):
                    if slot is not None:
                        self.slot_index.fill_(s)
                        self._prefill(self.max_len - 1)(self.slot_index)
                        stats["recomputes"] += 1
            for s in range(self.num_slots):
                if self._slot[s] is not None:
                    continue
                if not self._queue and not exhausted and may_admit(ahead, need, version, min_version, carry_over,
                                                                    min_version_step):
                    exhausted = not self._queue_group(prompts, group_size)
                    ahead += not exhausted
                if not self._queue:
                    break
                prefilled = self._start(s, *self._queue.popleft())
                stats["prefills" if prefilled else "cache_copies"] += 1
            busy = [s for s in range(self.num_slots) if self._slot[s] is not None]
            if not busy:
                break  # prompts ran out: the batch keeps fewer groups (stats["groups"])
            n, moved = self._move_down(busy)
            stats["moves"] += moved
            busy = [s for s in range(n) if self._slot[s] is not None]
            for s in busy:
                if self._slot[s][4] is None:
                    self._slot[s][4] = version
            # a slot's next position is its prompt length + generated tokens - 1: below T
            T = next(T for T in self.cache_sizes if T >= max(self._slot[s][2] + self._slot[s][3] for s in busy))
            ended = self.decode(version, n, T)
            stats["stepped_slots"] += n
            stats["stepped_positions"] += T
            stats["decode_steps"] += 1
            stats["busy"] += len(busy)
            for s in busy:
                self._slot[s][3] += 1
                if ended[s]:
                    stats["dropped"] += self._finish(s, ended[s] == 1, min_version)

        groups = self._ready[:need]
        del self._ready[:need]
        if not carry_over:
            groups.sort(key=lambda g: g.order)
        self._write(batch, groups, group_size)
        steps = max(stats["decode_steps"], 1)  # every busy slot samples one token per step
        return dict(sampled_tokens=float(stats["busy"]), decode_steps=float(stats["decode_steps"]),
                    dropped=float(stats["dropped"]), slot_utilization=stats["busy"] / (steps * self.num_slots),
                    time_s=time.perf_counter() - t0, groups=float(len(groups)), prefills=float(stats["prefills"]),
                    cache_copies=float(stats["cache_copies"]), recomputes=float(stats["recomputes"]),
                    stepped_slots=float(stats["stepped_slots"]), stepped_positions=float(stats["stepped_positions"]),
                    moves=float(stats["moves"]))

    def _write(self, batch, groups, group_size):
        """Rows [k*G, (k+1)*G) <- the members of groups[k]; rows past the last group are reset."""
        records = [r for g in groups for r in g.done]
        n, d = len(records), self.device
        batch["tokens"].fill_(self.pad_token_id)
        for key in ("prompt_length", "completion_length", "prompt_id", "completion_mask", "logprobs", "version",
                    "finished"):
            batch[key].zero_()
        if not n:
            return
        P = torch.tensor([r[3] for r in records], device=d)
        C = torch.tensor([r[4] for r in records], device=d)
        v0 = torch.tensor([r[6] for r in records], device=d)
        mask = (self._arange_l >= P[:, None]) & (self._arange_l < (P + C)[:, None])
        batch["tokens"][:n] = torch.stack([r[0] for r in records])
        batch["logprobs"][:n] = torch.where(mask, torch.stack([r[1] for r in records]), 0.0)
        batch["version"][:n] = torch.where(mask, torch.stack([r[2] for r in records]), v0[:, None])
        batch["completion_mask"][:n] = mask
        batch["prompt_length"][:n] = P
        batch["completion_length"][:n] = C
        batch["prompt_id"][:n] = torch.tensor([g.prompt_id for g in groups for _ in range(group_size)], device=d)
        batch["finished"][:n] = torch.tensor([r[5] for r in records], device=d)
