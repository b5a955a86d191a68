"""leanrl.optim: Adam with a tensor learning rate, its state restored in place, and the gradient step written as
functions (FunctionalAdam, functional_step), which must step as torch's Adam does."""

import copy

import pytest
import torch

import leanrl


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


def test_functional_adam_steps_as_torch_adam_and_writes_its_state_back():
    """Including after a checkpoint's optimizer state is loaded (it replaces the optimizer's state dict)."""
    torch.manual_seed(0)
    modules = [torch.nn.Linear(3, 2) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    opts = [leanrl.make_adam(m.parameters(), 1e-2, eps=1e-5, compile=c, cudagraphs=False, device="cpu")
            for m, c in zip(modules, (False, True))]
    adam = leanrl.FunctionalAdam(dict(modules[1].named_parameters()), opts[1])
    x = torch.randn(5, 3)
    for i in range(4):
        if i == 2:  # a resumed run: the state loaded after the FunctionalAdam was made is the one it steps from
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


def test_functional_step_compiled_as_one_graph_matches_the_plain_step():
    """An algorithm's plain step (zero_grad, backward, step) eager and compiled, against `functional_step` eager and
    inside one fullgraph compile (a CPU's off-policy learner): the same outputs, parameters and Adam state after K
    steps, also across a checkpoint's optimizer state loaded in between."""
    x, y = torch.randn(16, 3), torch.randn(16, 2)

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        params = dict(net.named_parameters())
        return net, params

    def loss(net, params, x, y):
        value = (torch.func.functional_call(net, params, (x,)) - y).square().mean()
        return value, value.detach()

    results, saved = [], None
    for variant in ("plain", "plain compiled", "functional", "functional one graph"):
        net, params = make()
        opt = leanrl.make_adam(list(params.values()), 1e-2, compile="compiled" in variant or "graph" in variant,
                               cudagraphs=False, device="cpu")
        if variant.startswith("plain"):
            def step(x, y, net=net, params=params, opt=opt):
                value, aux = loss(net, params, x, y)
                opt.zero_grad()
                value.backward()
                opt.step()
                return aux
        else:
            step = leanrl.functional_step(lambda p, x, y, net=net: loss(net, p, x, y), params, opt)
        if variant.endswith("compiled"):
            step = leanrl.accelerate(step, compile=True, name="step")
        elif variant.endswith("one graph"):
            step = leanrl.accelerate(step, compile=True, compile_kwargs=dict(fullgraph=True), name="step")
        outs = [step(x, y) for _ in range(3)]
        if saved is None:
            saved = copy.deepcopy(opt.state_dict())
        leanrl.load_optimizer_state(opt, copy.deepcopy(saved))  # a resumed run's optimizer: the same object
        outs += [step(x, y) for _ in range(2)]
        results.append((outs, {k: v.detach().clone() for k, v in params.items()},
                        [opt.state[p]["exp_avg"].clone() for p in params.values()]))
    for outs, params, exp_avgs in results[1:]:
        torch.testing.assert_close(outs, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, results[0][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp_avgs, results[0][2], rtol=1e-5, atol=1e-6)


def test_the_functional_adam_refuses_amsgrad():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        leanrl.FunctionalAdam({"w": w}, opt)


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

            def step(x, net=net, opt=opt):
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()

            step = leanrl.accelerate(step, compile=True, name="step")
            before = net.weight.detach().clone()
            step(x)
            assert not torch.equal(net.weight, before)
