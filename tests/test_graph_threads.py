"""leanrl.graph_threads: CUDA graphs captured and replayed in several threads at once (async GRPO's collectors and
trainer), and the capture lock's rule, checked on any machine with plain functions."""

import threading
import time

import pytest
import torch

import leanrl
from leanrl import graph_threads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the failure was CUDA's")
def test_a_compiled_optimizer_step_compiles_in_any_thread():
    """On torch 2.11 dynamo failed to compile an optimizer step on CUDA in a thread other than the one that imported
    inductor's CUDA graph trees (every compiled benchmark turn, which runs in a thread)."""
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
    meanwhile. Torch's default capture mode forbids another thread's cudaMalloc (one failure seen); CUDA forbids a
    device-wide synchronize in any thread during a capture, and CudaGraphModule does one before every replay (the
    other). Here three threads each capture eight graphs and replay each twenty times, allocating fresh
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
            seen.append((name, torch.cuda.graph is graph_threads._ThreadLocalCapture))
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
    call_a = graph_threads.GraphedAmongThreads(graphed("a", gate_a), warmup=9)
    a = start(call_a)
    assert entered("a", 5)
    graph_threads.GraphedAmongThreads(graphed("b"), warmup=9)()  # another call runs beside a
    capture_c = graph_threads.GraphedAmongThreads(graphed("c", gate_c), warmup=1)
    c = start(capture_c)
    assert not entered("c", 0.3)  # waits for a
    d = start(graph_threads.GraphedAmongThreads(graphed("d"), warmup=9))
    gate_a.set()
    assert entered("c", 5)
    assert not entered("d", 0.3)  # came while c waited: waits for c
    gate_c.set()
    for thread in (a, c, d):
        thread.join()
    assert not errors, errors
    assert seen == [("a", False), ("b", False), ("c", True), ("d", False)]

    seen.clear()
    failing = graph_threads.GraphedAmongThreads(graphed("e", fail=True), warmup=1)
    with pytest.raises(RuntimeError, match="capture failed"):
        failing()
    assert torch.cuda.graph is original
    start(graph_threads.GraphedAmongThreads(graphed("f"), warmup=1)).join()  # the lock was released
    nested = graph_threads.GraphedAmongThreads(graphed("g"), warmup=1)
    graph_threads.GraphedAmongThreads(graphed("h", inner=nested), warmup=9)()
    failing()  # captured again after it failed
    assert seen == [("e", True), ("f", True), ("h", False), ("g", True), ("e", True)] and not errors
    assert torch.cuda.graph is original

def _record_errors(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (reported by the test's main thread)
        errors.append(e)
