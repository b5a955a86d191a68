"""A one-graph compile's trace, saved by one run and loaded by the next (`leanrl.precompiled`): a loaded trace computes
what eager computes with this run's objects, and anything it depended on that changed makes it traced again."""

import importlib
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import leanrl
from leanrl import precompiled

pytestmark = pytest.mark.skipif(not precompiled.available(), reason="this torch cannot save compiled traces")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """An empty inductor cache directory, as a new machine has."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor" / "leanrl-precompiled"


def make_policy(seed: int, coef: float):
    """A closure over a module and a hyperparameter object, as the algorithms' compiled functions are."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    hyper = types.SimpleNamespace(coef=coef)

    def policy(obs):
        return net(obs).softmax(-1) * hyper.coef

    return policy


def precompile(fn):
    return leanrl.accelerate(fn, compile=True, compile_kwargs=dict(fullgraph=True), name="policy")


@pytest.mark.slow
def test_a_loaded_trace_reads_this_runs_objects_and_a_changed_value_is_traced_again():
    obs = torch.randn(5, 4)
    first = make_policy(seed=0, coef=1.0)
    compiled = precompile(first)
    torch.testing.assert_close(compiled(obs), first(obs))
    assert not compiled.loaded

    # A new run's network, other weights: loaded, and computing with these weights, not the saved run's.
    second = make_policy(seed=1, coef=1.0)
    compiled = precompile(second)
    torch.testing.assert_close(compiled(obs), second(obs))
    assert compiled.loaded
    assert not torch.allclose(second(obs), first(obs))

    # A hyperparameter the trace baked in changed: traced again, not loaded; the first value's trace is kept.
    third = make_policy(seed=1, coef=0.5)
    compiled = precompile(third)
    torch.testing.assert_close(compiled(obs), third(obs))
    assert not compiled.loaded
    again = precompile(make_policy(seed=2, coef=1.0))
    again(obs)
    assert again.loaded

    # A call with arguments unlike the first call's: its guards reject it; compiled the ordinary way, still right.
    wide = torch.randn(7, 4)
    torch.testing.assert_close(compiled(wide), third(wide))


def add_sums(a, b, out: tuple):
    """Writes into two outputs, which a call may pass as one tensor."""
    out[0].add_(a.sum())
    out[1].add_(2 * b.sum())
    return a + b


@pytest.mark.parametrize("first_aliased", [True, False])
def test_a_trace_made_for_arguments_that_are_one_tensor_is_not_used_for_two(first_aliased):
    """A trace is specialized to which of its arguments are one tensor (Dynamo dedupes them): called first with one
    tensor twice, then with two (or the other way round), in this process and in a run that loads the trace, every
    call computes what eager does. Before, the first call's trace was used for both: wrong sums, no error."""
    def calls():
        x, y, z = torch.ones(3), torch.full((3,), 2.0), torch.zeros(1)
        aliased, separate = (x, x, (z, z)), (x, y, (torch.zeros(1), torch.zeros(1)))
        return [aliased, separate] if first_aliased else [separate, aliased]

    for run in range(2):  # the second run loads the trace the first saved
        compiled = leanrl.accelerate(add_sums, compile=True, compile_kwargs=dict(fullgraph=True), name="add_sums")
        for args, expected in zip(calls(), calls()):
            torch.testing.assert_close(compiled(*args), add_sums(*expected))
            torch.testing.assert_close(args[2], expected[2])
        assert compiled.loaded == (run == 1)


def test_a_changed_source_is_traced_again_and_its_old_trace_removed(tmp_path, own_cache, monkeypatch):
    module = tmp_path / "my_policy.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    x = torch.randn(3, 4)
    outputs = []
    for scale in (2.0, 3.0, 3.0):  # a module constant, read by the trace from the module's globals
        module.write_text(f"SCALE = {scale}\n\ndef scaled(x):\n    return (x * SCALE).sin()\n")
        sys.modules.pop("my_policy", None)
        importlib.invalidate_caches()
        scaled = importlib.import_module("my_policy").scaled
        compiled = precompile(scaled)
        outputs.append((compiled(x), scaled(x), compiled.loaded))
    assert [loaded for *_, loaded in outputs] == [False, False, True]
    for out, expected, _ in outputs:
        torch.testing.assert_close(out, expected)
    assert len(os.listdir(own_cache)) == 1  # the trace of SCALE = 2.0 could never be valid again: removed


GRADIENT_STEPS = """
import json, sys
import torch
import leanrl
from leanrl import precompiled

from torch._dynamo.utils import counters

seed, compile = int(sys.argv[1]), sys.argv[2] == "compile"
torch.manual_seed(seed)
net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
params = dict(net.named_parameters())
x, y = torch.randn(16, 3), torch.randn(16, 2)


def loss(params, x, y):
    value = (torch.func.functional_call(net, params, (x,)) - y).square().mean()
    return value, value.detach()


opt = leanrl.make_adam(list(params.values()), 1e-2, compile=compile, cudagraphs=False, device="cpu")
step = leanrl.functional_step(loss, params, opt)
if compile:  # the off-policy learners' CPU step: one fullgraph compile, whose trace a later run loads
    step = leanrl.accelerate(step, compile=True, compile_kwargs=dict(fullgraph=True), name="step")
losses = [step(x, y).item() for _ in range(3)]
print(json.dumps(dict(loads=counters["leanrl"]["traces_loaded"], losses=losses, params=[p.tolist() for p in params.values()])))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_one_graph_gradient_step_and_matches_eager(tmp_path):
    """`functional_step` compiled as one graph, the off-policy algorithms' CPU step, whose closure holds an optimizer
    and its parameters, in a second run (a new process, other initial weights): loaded, it steps that run's
    parameters and Adam state as eager does."""
    script = tmp_path / "gradient_steps.py"
    script.write_text(GRADIENT_STEPS)

    def run(seed: int, mode: str) -> dict:
        out = subprocess.run([sys.executable, str(script), str(seed), mode], capture_output=True, text=True,
                             check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run(seed=0, mode="compile")["loads"] == 0
    loaded, eager = run(seed=1, mode="compile"), run(seed=1, mode="eager")
    assert loaded["loads"] == 1
    torch.testing.assert_close(loaded["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
    for p, q in zip(loaded["params"], eager["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)
