"""The shared core: accelerate, the shape guard, the sync-free logger and checkpoints."""

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import leanrl
from leanrl import acceleration, cli


def affine(x, w):
    return x @ w + 1


@pytest.mark.parametrize("compile", [False, True])
def test_accelerate_matches_eager(compile):
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    fn = leanrl.accelerate(affine, compile=compile)
    torch.testing.assert_close(fn(x, w), affine(x, w))


def test_cudagraphs_without_cuda_says_so_once_and_runs(capfd, monkeypatch):
    monkeypatch.setattr(cli, "_said", set())
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    f1 = leanrl.accelerate(affine, cudagraphs=True, device="cpu")
    f2 = leanrl.accelerate(affine, cudagraphs=True, device="cpu")
    torch.testing.assert_close(f1(x, w), affine(x, w))
    torch.testing.assert_close(f2(x, w), affine(x, w))
    err = capfd.readouterr().err
    assert err.count("--cudagraphs needs a CUDA device") == 1
    assert "CudaGraphModule" not in type(f1.fn).__name__


def test_compile_keeps_what_does_not_pay_on_cpu_eager_and_says_so_once(capfd, monkeypatch):
    monkeypatch.setattr(cli, "_said", set())
    monkeypatch.delenv("LEANRL_COMPILE_ON_CPU", raising=False)
    args = leanrl.RunArgs(compile=True)
    for _ in range(2):
        assert leanrl.wrap_flags(args, "cpu", eager_on_cpu="X's update")["compile"] is False
    assert capfd.readouterr().err.count("on a CPU, --compile keeps eager X's update (") == 1
    assert leanrl.wrap_flags(args, "cpu")["compile"] is True  # nothing named: compiled
    assert leanrl.wrap_flags(args, "cuda", eager_on_cpu="X's update")["compile"] is True
    assert leanrl.wrap_flags(leanrl.RunArgs(), "cpu", eager_on_cpu="X's update")["compile"] is False
    monkeypatch.setenv("LEANRL_COMPILE_ON_CPU", "1")
    assert leanrl.wrap_flags(args, "cpu", eager_on_cpu="X's update")["compile"] is True


def test_shape_guard_rejects_a_smaller_broadcastable_input():
    fn = leanrl.accelerate(affine, cudagraphs=True, name="affine")
    fn(torch.randn(8, 4), torch.randn(4, 3))
    fn(torch.randn(8, 4), torch.randn(4, 3))  # same shapes: fine
    with pytest.raises(leanrl.ShapeChangeError, match=r"affine: argument 0 .*\[8, 4\].*\[1, 4\]"):
        fn(torch.randn(1, 4), torch.randn(4, 3))
    with pytest.raises(leanrl.ShapeChangeError, match="float64"):
        fn(torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 3))


def test_shape_guard_on_tensordicts_and_keywords():
    fn = leanrl.accelerate(lambda td, scale: td["a"] * scale, cudagraphs=True, name="f")
    fn(TensorDict(a=torch.ones(4, 2), batch_size=[4]), scale=torch.ones(2))
    with pytest.raises(leanrl.ShapeChangeError, match=r"argument 0 .*a: shape \[4, 2\].*a: shape \[4, 3\]"):
        fn(TensorDict(a=torch.ones(4, 3), batch_size=[4]), scale=torch.ones(2))
    with pytest.raises(leanrl.ShapeChangeError, match="scale"):
        fn(TensorDict(a=torch.ones(4, 2), batch_size=[4]), scale=torch.ones(1))


def test_logger_reads_device_metrics_at_flush_with_cleanrl_keys(tmp_path):
    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=100, burn_in=1, progress=False)
    # an env reports an ended episode by its length; 0 elsewhere (a lost Atari life is terminated, no episode)
    logger.record_episodes(torch.tensor([10.0, 0.0, 20.0]), torch.tensor([5, 0, 7]))
    logger.record_episodes(torch.tensor([0.0, 30.0, 0.0]), torch.tensor([0, 3, 0]))
    logger.record({"losses/value_loss": torch.tensor(0.5), "charts/learning_rate": 1e-3})
    logger.end_iteration(50)
    logger.end_iteration(100)
    row = logger.flush()
    logger.close()
    assert row["charts/episodic_return"] == pytest.approx(20.0)
    assert row["charts/episodic_length"] == pytest.approx(5.0)
    assert row["losses/value_loss"] == 0.5 and row["charts/SPS"] > 0 and row["perf/warmup_time"] >= 0
    lines = [json.loads(s) for s in open(tmp_path / "metrics.jsonl")]
    assert lines[-1]["global_step"] == 100 and lines[-1]["charts/episodic_return"] == pytest.approx(20.0)


def test_logger_raises_on_a_non_finite_loss(tmp_path):
    logger = leanrl.Logger(str(tmp_path), {}, total_steps=10, progress=False)
    logger.record({"losses/policy_loss": torch.tensor(float("nan"))})
    with pytest.raises(FloatingPointError, match="losses/policy_loss"):
        logger.flush()
    logger.close()


def test_read_metrics_as_the_run_stands(tmp_path):
    """A final evaluation row joins the row of its step, a resume replaces the rows after its checkpoint, a last
    line cut short is left out, and any other bad line is an error naming file and line."""
    from leanrl.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"global_step": 10, "a": 1}, {"global_step": 20, "a": 2}, {"global_step": 20, "eval": 9},
            {"global_step": 30, "a": 3}, {"global_step": 20, "a": 5}, {"global_step": 30, "a": 6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"global_step": 40, "a"')
    assert read_metrics(str(path)) == [{"global_step": 10, "a": 1}, {"global_step": 20, "a": 5},
                                       {"global_step": 30, "a": 6}]
    path.write_text('{"global_step": 10}\n\n{"global_step": 20, "a":\n{"global_step": 30}\n')
    with pytest.raises(leanrl.UsageError, match=r"metrics.jsonl:3: not a metrics row"):
        read_metrics(str(path))
    path.write_text('{"step": 10}\n')
    with pytest.raises(leanrl.UsageError, match=r"metrics.jsonl:1: not a metrics row \(JSON with a global_step\)"):
        read_metrics(str(path))
    with pytest.raises(leanrl.UsageError, match="missing.jsonl'?: No such file"):
        read_metrics(str(tmp_path / "missing.jsonl"))


def test_the_commands_that_need_no_torch_import_none():
    """`leanrl`'s names load their modules on first use: the plot and the layout planner start without torch's 3-4 s
    of imports (2-core CPU), and every exported name still resolves, to its module's object."""
    code = textwrap.dedent("""
        import sys
        import leanrl, leanrl.layout, leanrl.plot
        assert "torch" not in sys.modules, "torch imported"
        for name in leanrl.__all__:
            assert getattr(leanrl, name) is getattr(sys.modules["leanrl." + leanrl._MODULE_OF[name]], name), name
        """)
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="module 'leanrl' has no attribute 'nonexistent'"):
        leanrl.nonexistent


class _Timed(Exception):
    stop_reason = "the benchmark, once timed"


@pytest.mark.parametrize("exc, words", [(RuntimeError, "stopped by an error (RuntimeError) at step 0"),
                                        (_Timed, "stopped by the benchmark, once timed at step 0")])
def test_run_summary_names_what_stopped_the_run(tmp_path, capsys, exc, words):
    with pytest.raises(exc), leanrl.Logger(str(tmp_path), {}, total_steps=10, progress=False):
        raise exc
    assert words in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_offline_writes_files_disabled_leaves_none(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=10, track=True, wandb_mode=mode, progress=False)
    logger.record({"losses/value_loss": 1.0})
    logger.end_iteration(10)
    logger.flush()
    logger.close()
    assert os.path.isdir(tmp_path / "wandb") == (mode == "offline")


def test_checkpoint_round_trip_restores_rng(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    torch.manual_seed(3)
    leanrl.save_checkpoint(path, {"step": 7, "w": torch.arange(3)})
    expected = torch.rand(4)
    torch.rand(100)
    state = leanrl.load_checkpoint(path)
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(3))
    leanrl.restore_rng(state)
    torch.testing.assert_close(torch.rand(4), expected)


def test_resume_from_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(leanrl.CheckpointError, match="no checkpoint at that path"):
        leanrl.load_checkpoint(str(tmp_path / "nope.pt"))


def test_clean_exit_keeps_the_imported_modules_out_of_the_garbage_collector_until_exit():
    """What exists on entry is frozen (full collections skip it); on the way out everything is collectable again,
    so the interpreter's teardown frees it as usual."""
    with leanrl.clean_exit():
        frozen = gc.get_freeze_count()
        created = []
        assert any(x is created for x in gc.get_objects())  # made after entry: collectable
    assert frozen > 0 and gc.get_freeze_count() == 0


def test_clean_exit_ends_a_script_without_the_interpreters_teardown(tmp_path):
    """Run as a script, a completed run ends with what Python does at exit (non-daemon threads joined, atexit
    handlers, stdout flushed) and exit code 0, but not the teardown that frees each module's objects. Under a
    wrapper with work left after the script (runpy here, as cProfile and coverage), the process goes on."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading, time
        import leanrl

        class Loud:
            def __del__(self):
                print("teardown", flush=True)

        freed_by_the_teardown = Loud()
        atexit.register(print, "atexit")
        with leanrl.clean_exit():
            threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
            print("body")  # stdout is a pipe: buffered
        """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["body", "thread", "atexit"], run.stderr
    wrapper = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__'); print('wrapper')"
    run = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert {"body", "wrapper", "thread", "atexit", "teardown"} == set(run.stdout.split())


def test_save_on_interrupt_saves_on_sigterm_reraises_and_restores_the_handler(tmp_path, capsys):
    import signal
    path = str(tmp_path / "ckpt.pt")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with leanrl.save_on_interrupt(path, lambda: {"step": 3}):
            os.kill(os.getpid(), signal.SIGTERM)
    assert leanrl.load_checkpoint(path)["step"] == 3
    assert f"--resume {path}" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
    with leanrl.save_on_interrupt(str(tmp_path / "other.pt"), lambda: {}):
        pass  # no interrupt: nothing saved
    assert not os.path.exists(tmp_path / "other.pt") and signal.getsignal(signal.SIGTERM) is before


def test_warmup_is_read_by_accelerate_and_the_logger(tmp_path):
    import inspect
    assert inspect.signature(leanrl.accelerate).parameters["warmup"].default == leanrl.WARMUP
    logger = leanrl.Logger(str(tmp_path), {}, total_steps=10, progress=False)
    assert logger.burn_in == leanrl.WARMUP
    logger.close()


def test_load_optimizer_state_keeps_the_tensor_learning_rate():
    w = torch.nn.Parameter(torch.ones(3))
    opt = leanrl.make_adam([w], 1e-3, compile=False, cudagraphs=False, device="cpu")
    lr = opt.param_groups[0]["lr"]
    w.sum().backward()
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(5e-4)
    fresh = leanrl.make_adam([w], 1e-3, compile=False, cudagraphs=False, device="cpu")
    fresh_lr = fresh.param_groups[0]["lr"]
    leanrl.load_optimizer_state(fresh, saved)
    assert fresh.param_groups[0]["lr"] is fresh_lr and float(fresh_lr) == pytest.approx(5e-4)
    assert torch.equal(fresh.state[w]["exp_avg"], opt.state[w]["exp_avg"]) and lr is not fresh_lr


def test_vec_isa_check_runs_once_per_inductor_cache(tmp_path, monkeypatch):
    """The first compiled run in a cache checks the CPU's vector ISAs as inductor would, and records the answer;
    later runs trust it without the check, and check again when the record no longer matches the CPU's claim."""
    from torch._inductor import config, cpu_vec_isa
    real = cpu_vec_isa.valid_vec_isa_list
    checks = []

    def valid_vec_isa_list():  # inductor's check, counted
        checks.append(1)
        return real()

    valid_vec_isa_list.__wrapped__ = real.__wrapped__
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    passed = [str(isa) for isa in real()]
    with config.patch({"cpp.vec_isa_ok": True}):
        claimed = [str(isa) for isa in real.__wrapped__()]
    record = tmp_path / f"leanrl-vec-isa-ok-{torch.__version__}"
    for expect_check in (True, False, "tampered"):
        if expect_check == "tampered":
            record.write_text("not-an-isa")  # not "avx2": an AVX2-only CPU's real record (it failed on one)
        # config.patch, not monkeypatch: on torch 2.11 monkeypatch's undo deletes the entry, failing later compiles
        with config.patch({"cpp.vec_isa_ok": None}):
            checks.clear()
            acceleration._trust_vec_isa_probed_before.__wrapped__()
            assert bool(checks) == (expect_check is not False)
            assert config.cpp.vec_isa_ok is (True if passed == claimed else None)
        assert record.exists() == (passed == claimed)
    with config.patch({"cpp.vec_isa_ok": False}):  # TORCHINDUCTOR_VEC_ISA_OK=0: the user decides
        acceleration._trust_vec_isa_probed_before.__wrapped__()
        assert config.cpp.vec_isa_ok is False


def test_scannable_adam_steps_as_torch_adam_and_writes_its_state_back():
    """Including after a checkpoint's optimizer state is loaded (it replaces the optimizer's state dict)."""
    torch.manual_seed(0)
    modules = [torch.nn.Linear(3, 2) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    opts = [leanrl.make_adam(m.parameters(), 1e-2, eps=1e-5, compile=c, cudagraphs=False, device="cpu")
            for m, c in zip(modules, (False, True))]
    adam = leanrl.ScannableAdam(dict(modules[1].named_parameters()), opts[1])
    x = torch.randn(5, 3)
    for i in range(4):
        if i == 2:  # a resumed run: the state loaded after the ScannableAdam was made is the one it steps from
            leanrl.load_optimizer_state(opts[1], copy.deepcopy(opts[0].state_dict()))
        opts[0].zero_grad()
        modules[0](x).square().sum().backward()
        opts[0].step()
        carry = adam.carry()
        grads = torch.func.grad(lambda p: torch.func.functional_call(modules[1], p, (x,)).square().sum())(carry[0])
        adam.load(adam.step(carry, grads, opts[1].param_groups[0]["lr"]))
    for (name, p), q in zip(modules[0].named_parameters(), modules[1].parameters()):
        torch.testing.assert_close(q, p, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opts[1].state[q][key], opts[0].state[p][key], msg=key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the failure was CUDA's")
def test_a_compiled_optimizer_step_compiles_in_any_thread():
    """On torch 2.11 dynamo failed to compile an optimizer step on CUDA in a thread other than the one that imported
    inductor's CUDA graph trees (seen on an H200: every compiled benchmark turn, which runs in a thread)."""
    import torch._inductor.cudagraph_trees  # noqa: F401  (imported here, in the main thread, as by any earlier compile)

    net = torch.nn.Linear(3, 2, device="cuda")
    opt = leanrl.make_adam(net.parameters(), 1e-2, compile=True, cudagraphs=False, device="cuda")

    def step(x):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()

    step = leanrl.accelerate(step, compile=True, device="cuda")
    before, errors = net.weight.detach().clone(), []
    thread = threading.Thread(target=lambda: _record_errors(errors, step, torch.randn(4, 3, device="cuda")))
    thread.start()
    thread.join()
    assert not errors, errors
    assert not torch.equal(net.weight, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_graphs_captured_and_replayed_in_several_threads_at_once():
    """Async GRPO's collector threads and its trainer each capture their graphs and replay them, and allocate,
    meanwhile. Torch's default capture mode forbids another thread's cudaMalloc (an H100's failure); CUDA forbids a
    device-wide synchronize in any thread during a capture, and CudaGraphModule does one before every replay (an
    H200's failure). Here three threads each capture eight graphs and replay each twenty times, allocating fresh
    memory and waiting for their own stream between calls."""
    errors, results = [], {}
    x = torch.arange(64.0, device="cuda")
    torch.cuda.synchronize()

    def work(t):
        with torch.cuda.stream(torch.cuda.Stream()):
            outs, xt = [], x + t
            for k in range(8):
                fn = leanrl.accelerate(lambda x: (x * 2 + 1).cumsum(0).sin().exp(), cudagraphs=True, device="cuda",
                                       name=f"fn{t}_{k}")
                for i in range(leanrl.WARMUP + 20):
                    torch.empty(2**20 * (1 + i % 32), device="cuda").fill_(1.0)
                    outs.append(fn(xt).clone())
                    leanrl.sync_cuda()
            results[t] = outs

    workers = [threading.Thread(target=_record_errors, args=(errors, work, t)) for t in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for t, outs in results.items():  # warm-up calls, the capture calls, and the replays
        expected = ((x + t) * 2 + 1).cumsum(0).sin().exp()
        for out in outs:
            torch.testing.assert_close(out, expected)


def test_a_capture_waits_for_the_graphed_calls_of_other_threads_and_holds_off_new_ones():
    """The rule of the test above, on any machine, with plain functions for graphs: graphed calls in several threads
    run together; a capture (the `warmup`-th call) waits for the calls in flight, runs with torch.cuda.graph
    capturing thread-locally, and holds off calls that come meanwhile; torch.cuda.graph is restored after it, also
    when it raises, and a capture inside a call of the same thread does not wait for itself."""
    original, seen, failures = torch.cuda.graph, [], [RuntimeError("capture failed")]

    def graphed(name, gate=None, fail=False, inner=None):
        def fn():
            seen.append((name, torch.cuda.graph is acceleration._ThreadLocalCapture))
            if inner:
                inner()
            if gate:
                assert gate.wait(10)
            if fail and failures:  # the first time
                raise failures.pop()
        return fn

    def start(fn):
        thread = threading.Thread(target=_record_errors, args=(errors, fn))
        thread.start()
        return thread

    def entered(name, wait):  # whether `name` has run, `wait` seconds at most
        deadline = time.monotonic() + wait
        while name not in (n for n, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        return name in (n for n, _ in seen)

    errors, gate_a, gate_c = [], threading.Event(), threading.Event()
    call_a = acceleration._GraphedAmongThreads(graphed("a", gate_a), warmup=9)
    a = start(call_a)
    assert entered("a", 5)
    acceleration._GraphedAmongThreads(graphed("b"), warmup=9)()  # another call runs beside a
    capture_c = acceleration._GraphedAmongThreads(graphed("c", gate_c), warmup=1)
    c = start(capture_c)
    assert not entered("c", 0.3)  # waits for a
    d = start(acceleration._GraphedAmongThreads(graphed("d"), warmup=9))
    gate_a.set()
    assert entered("c", 5)
    assert not entered("d", 0.3)  # came while c waited: waits for c
    gate_c.set()
    for thread in (a, c, d):
        thread.join()
    assert not errors, errors
    assert seen == [("a", False), ("b", False), ("c", True), ("d", False)]

    seen.clear()
    failing = acceleration._GraphedAmongThreads(graphed("e", fail=True), warmup=1)
    with pytest.raises(RuntimeError, match="capture failed"):
        failing()
    assert torch.cuda.graph is original
    start(acceleration._GraphedAmongThreads(graphed("f"), warmup=1)).join()  # the lock was released
    nested = acceleration._GraphedAmongThreads(graphed("g"), warmup=1)
    acceleration._GraphedAmongThreads(graphed("h", inner=nested), warmup=9)()
    failing()  # captured again after it failed
    assert seen == [("e", True), ("f", True), ("h", False), ("g", True), ("e", True)] and not errors
    assert torch.cuda.graph is original


def _record_errors(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (reported by the test's main thread)
        errors.append(e)


def test_gradient_step_plain_compiled_and_one_graph_match_eager():
    """The plain step eager and compiled (what a GPU captures), and the one-graph step of a CPU under --compile:
    the same parameters and Adam state after K steps."""
    x, y = torch.randn(16, 3), torch.randn(16, 2)

    def loss(params, x, y):
        out = torch.func.functional_call(net, params, (x,))
        value = (out - y).square().mean()
        return value, value.detach()

    results = []
    for compile, one_graph in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        params = dict(net.named_parameters())
        opt = leanrl.make_adam(list(params.values()), 1e-2, compile=compile, cudagraphs=False, device="cpu")
        step = leanrl.gradient_step(loss, params, opt, one_graph=one_graph)
        step = step if one_graph else leanrl.accelerate(step, compile=compile)
        outs = [step(x, y) for _ in range(4)]
        results.append((outs, {k: v.detach().clone() for k, v in params.items()},
                        [opt.state[p]["exp_avg"].clone() for p in params.values()]))
    for outs, params, exp_avgs in results[1:]:
        torch.testing.assert_close(outs, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, results[0][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avgs, results[0][2], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_ninth_optimizer_in_a_process_still_steps_compiled():
    """Dynamo compiles torch's Adam.step once per optimizer; by default the ninth ran eagerly (on a GPU, under a
    CUDA graph, that failed the capture). Nine agents' compiled steps, each compiled, none falling back."""
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(9):
            net = torch.nn.Linear(3, 1)
            opt = leanrl.make_adam(net.parameters(), 1e-2, compile=True, cudagraphs=False, device="cpu")
            params = dict(net.named_parameters())
            step = leanrl.accelerate(leanrl.gradient_step(
                lambda p, x: (torch.func.functional_call(net, p, (x,)).square().mean(), None), params, opt),
                compile=True, name="step")
            before = net.weight.detach().clone()
            step(x)
            assert not torch.equal(net.weight, before)
