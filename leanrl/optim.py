"""Optimizers a captured graph can step, and the gradient step as functions, for a CPU.

On a CPU no CUDA graph removes what a compiled call costs (Dynamo's guards, Python), and a plain compiled gradient
step is three graphs (the backward and the optimizer step break it). Written as functions, torch.func.grad of the
algorithm's own loss and torch's Adam on the parameters as values, it is part of one graph: `functional_step`
inside a function compiled whole (an off-policy learner's step), `FunctionalAdam` carried through a compiled scan
(`leanrl.scan`). Both leave the parameters and the optimizer's state where the module, checkpoints and an eager
step afterwards find them: one optimizer."""

import torch
from torch.optim.adam import adam  # the functional Adam: what a compiled graph or scan body steps with


def make_adam(params, lr: float, *, compile: bool, cudagraphs: bool, device, **kwargs) -> torch.optim.Adam:
    """Adam with a tensor learning rate, so an annealed or restored rate reaches a captured graph (it is changed
    in place). Eager runs the fused kernel (faster than the default on a CPU); compile generates its own; graphs
    without compile need `capturable`."""
    return torch.optim.Adam(params, lr=torch.tensor(lr, device=device), capturable=cudagraphs and not compile,
                            fused=not compile, **kwargs)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore an optimizer made by `make_adam` in place (before any capture), keeping its tensor learning rate
    object (a captured graph reads its address) and copying the saved rate into it."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr.copy_(group["lr"])


class FunctionalAdam:
    """An Adam made by `make_adam` over `params` (its parameters by name), stepped as a pure function inside one
    compiled graph or a compiled scan over updates (a scan's body may not write to what it closes over). The carry
    is (parameters, exp_avg, exp_avg_sq, step), dicts by parameter name: `carry()` reads them, `step(carry, grads,
    lr)` returns the next with torch's own Adam applied to copies, and `load(carry)` writes the last one back in
    place, so the module, checkpoints and an eager step afterwards see one optimizer."""

    def __init__(self, params: dict, optimizer: torch.optim.Adam):
        (group,) = optimizer.param_groups
        if group["amsgrad"]:
            raise ValueError("FunctionalAdam: amsgrad is not supported")
        self.params, self.optimizer = params, optimizer
        self.hyper = dict(amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                          weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        self._init_state()  # now, so that a graph reads it

    def _init_state(self):
        for p in self.params.values():  # torch's Adam makes its state at its first step
            if not self.optimizer.state[p]:
                self.optimizer.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                               exp_avg_sq=torch.zeros_like(p))

    def carry(self) -> tuple:
        self._init_state()  # loading a checkpoint replaces the optimizer's state: read it at every call
        state = {name: self.optimizer.state[p] for name, p in self.params.items()}
        return ({name: p.detach() for name, p in self.params.items()}, {n: s["exp_avg"] for n, s in state.items()},
                {n: s["exp_avg_sq"] for n, s in state.items()}, next(iter(state.values()))["step"])

    def step(self, carry: tuple, grads: dict, lr: torch.Tensor) -> tuple:
        params, exp_avgs, exp_avg_sqs = ({n: x.clone() for n, x in d.items()} for d in carry[:3])
        steps = [carry[3].clone() for _ in params]
        adam(list(params.values()), [grads[n] for n in params], list(exp_avgs.values()), list(exp_avg_sqs.values()),
             [], steps, foreach=False, capturable=torch.compiler.is_compiling(), lr=lr, **self.hyper)
        return params, exp_avgs, exp_avg_sqs, steps[0]

    @torch.no_grad()
    def load(self, carry: tuple) -> None:
        params, exp_avgs, exp_avg_sqs, step = carry
        names = list(self.params)
        state = [self.optimizer.state[p] for p in self.params.values()]
        torch._foreach_copy_(list(self.params.values()), [params[n] for n in names])
        for key, values in (("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs)):
            torch._foreach_copy_([s[key] for s in state], [values[n] for n in names])
        torch._foreach_copy_([s["step"] for s in state], [step] * len(state))


def functional_step(loss, params: dict, optimizer: torch.optim.Adam):
    """`step(*inputs) -> aux`: one optimizer step on `loss(params, *inputs) -> (loss, aux)`, where `params` are the
    optimizer's parameters by name, written as functions: torch.func.grad of the loss and `FunctionalAdam`'s step,
    written back in place. Called inside a function compiled as one graph (`fullgraph=True`), the step is part of
    that graph; see the module's docstring. The same step written with `zero_grad`, `backward` and `step` is the
    algorithm's own."""
    adam = FunctionalAdam(params, optimizer)
    # The learning-rate tensor itself, taken once (`load_optimizer_state` keeps it, an annealing writes it in place):
    # read through `param_groups` the graph would depend on the groups' dicts, which a checkpoint's load replaces.
    lr = optimizer.param_groups[0]["lr"]

    def step(*inputs):
        carry = adam.carry()
        grads, aux = torch.func.grad(loss, has_aux=True)(carry[0], *inputs)
        adam.load(adam.step(carry, grads, lr))
        return aux

    return step
