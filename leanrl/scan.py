"""A loop as one compiled call, for a CPU. A CPU has no CUDA graphs to replay, so a loop of small compiled calls pays
Dynamo's guards and Python on every call; these transforms take an algorithm's own per-step function and run the
loop inside one compiled graph, a scan (torch's scan operator) whose loop runs in inductor's generated code:
- `scan_env_steps`: a rollout's steps on an on-device env (its pure `transition` carried through the scan);
- `scan_gradient_steps`: every minibatch's gradient step of an update, with the parameters and Adam's state
  carried (`leanrl.optim.FunctionalAdam`).
Each returns a callable with the plain loop's effect: the env's state, the parameters and the optimizer's state are
written back after the call. `accel`: the run's `leanrl.Acceleration` (the scan is compiled whatever it says; its
--cudagraphs, which a CPU has not, still guards the shapes)."""

import torch
from torch._higher_order_ops.scan import scan

from leanrl import torch_fixes
from leanrl.graphs import Acceleration
from leanrl.optim import FunctionalAdam


def scan_env_steps(step, envs, accel: Acceleration, name: str = "rollout"):
    """`run(obs, xs) -> (last_obs, outputs)`: `step(env_step, obs, x) -> (next_obs, output)` for every row x of
    `xs` (a pytree of tensors with the steps along dim 0, e.g. each step's random numbers), the outputs stacked.
    Inside, `env_step(action, *noise)` is `envs.step` as a pure function (`envs.transition`, the env's state carried
    through the scan); the last state is written back into `envs`."""

    def body(carry, x):
        obs, env_carry = carry
        box = []

        def env_step(action, *noise):
            next_carry, out = envs.transition(env_carry, action, *noise)
            box.append(next_carry)
            return out

        next_obs, output = step(env_step, obs, x)
        return (next_obs, box[0]), output

    scanned = accel(lambda obs, env_carry, xs: scan(body, (obs, env_carry), xs), compile=True, name=name,
                    compile_kwargs=torch_fixes.scan_compile_kwargs())

    def run(obs, xs):
        (last_obs, env_carry), outputs = scanned(obs, envs.carry, xs)
        envs.set_carry(env_carry)
        return last_obs, outputs

    return run


def scan_gradient_steps(loss, module: torch.nn.Module, optimizer: torch.optim.Adam, max_grad_norm: float,
                        accel: Acceleration, name: str = "update"):
    """`steps(batch, indices) -> (aux, grad_norm)`: for every row of `indices` (one minibatch's indices into each
    tensor of the tuple `batch`), one optimizer step on `loss(module, *minibatch) -> (value, aux)` (`aux` a
    tensor), its gradients clipped to `max_grad_norm`, at the optimizer's learning rate; the last step's `aux` and
    gradient norm, as a loop of plain steps returns them. The same `loss` a plain update calls: it runs on the
    carried parameters, swapped into `module` for the call."""
    adam = FunctionalAdam(dict(module.named_parameters()), optimizer)

    def params_loss(params, minibatch):
        with torch.nn.utils.stateless._reparametrize_module(module, params):
            return loss(module, *minibatch)

    def scan_steps(carry, batch, indices, lr):
        def step(carry, inds):
            grads, aux = torch.func.grad(params_loss, has_aux=True)(carry[0], tuple(x[inds] for x in batch))
            grads, grad_norm = torch_fixes.clip_grad_norm(grads, max_grad_norm)
            return adam.step(carry, grads, lr), (aux, grad_norm)

        carry, (aux, grad_norms) = scan(step, carry, indices)
        adam.load(carry)  # in the graph: the parameters and Adam's state written in place, not returned
        return aux[-1], grad_norms[-1]

    scanned = accel(scan_steps, compile=True, name=name,
                    compile_kwargs=torch_fixes.scan_compile_kwargs())

    def steps(batch, indices):
        return scanned(adam.carry(), batch, indices, optimizer.param_groups[0]["lr"])

    return steps
