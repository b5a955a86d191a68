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
    in place). Eager runs the fused kernel (about 3x the default on CPU); compile generates its own; graphs
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
        self.params, self.optimizer = params, optimizer
        self.hyper = dict(amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                          weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        if group["amsgrad"]:
            raise ValueError("FunctionalAdam: amsgrad is not supported")

    def carry(self) -> tuple:
        state = self.optimizer.state  # read at every call: loading a checkpoint replaces it
        for p in self.params.values():
            if not state[p]:  # torch's Adam makes its state at its first step
                state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state = {name: state[p] for name, p in self.params.items()}
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
        for name, p in self.params.items():
            p.copy_(params[name])
            for key, value in (("exp_avg", exp_avgs[name]), ("exp_avg_sq", exp_avg_sqs[name]), ("step", step)):
                self.optimizer.state[p][key].copy_(value)


def functional_step(loss, params: dict, optimizer: torch.optim.Adam):
    """`step(*inputs) -> aux`: one optimizer step on `loss(params, *inputs) -> (loss, aux)`, where `params` are the
    optimizer's parameters by name, written as functions: torch.func.grad of the loss and torch's Adam on the
    parameters as values, the results copied into the parameters and the optimizer's state in place (a foreach copy
    each). Called inside a function compiled as one graph (`fullgraph=True`), the step is part of that graph; see
    the module's docstring. The same step written with `zero_grad`, `backward` and `step` is the algorithm's own."""
    (group,) = optimizer.param_groups
    if group["amsgrad"]:
        raise ValueError("functional_step: amsgrad is not supported")
    hyper = dict(amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group["maximize"])
    names, tensors = list(params), list(params.values())
    for p in tensors:  # torch's Adam makes its state at its first step; this one before, so a graph can read it
        if not optimizer.state[p]:
            optimizer.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))

    def step(*inputs):
        state = [optimizer.state[p] for p in tensors]  # read at every call: loading a checkpoint replaces it
        grads, aux = torch.func.grad(loss, has_aux=True)({n: p.detach() for n, p in params.items()}, *inputs)
        with torch.no_grad():
            new = [p.detach().clone() for p in tensors]
            moments = [[s[key].clone() for s in state] for key in ("exp_avg", "exp_avg_sq", "step")]
            adam(new, [grads[n] for n in names], moments[0], moments[1], [], moments[2], foreach=False,
                 capturable=torch.compiler.is_compiling(), lr=group["lr"], **hyper)
            torch._foreach_copy_(tensors, new)
            for key, values in zip(("exp_avg", "exp_avg_sq", "step"), moments):
                torch._foreach_copy_([s[key] for s in state], values)
        return aux

    return step
