"""leanrl.graphs: accelerate (compile inside, CUDA graph outside), Acceleration (a run's flags, bound once), the
shape guard."""

import inspect

import pytest
import torch
from tensordict import TensorDict

import leanrl
from leanrl import cli


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
    accel = leanrl.Acceleration.of(leanrl.RunArgs(compile=True), "cpu")
    for _ in range(2):
        assert accel.eager_on_cpu("X's update", "it is slower").compile is False
    assert capfd.readouterr().err.count("on a CPU, --compile keeps X's update eager: it is slower (") == 1
    assert accel.compile is True  # nothing named: compiled
    assert accel.replace(device=torch.device("cuda")).eager_on_cpu("X's update", "it is slower").compile is True
    assert leanrl.Acceleration().eager_on_cpu("X's update", "it is slower").compile is False
    monkeypatch.setenv("LEANRL_COMPILE_ON_CPU", "1")
    assert accel.eager_on_cpu("X's update", "it is slower").compile is True


def test_acceleration_binds_the_runs_flags():
    accel = leanrl.Acceleration.of(leanrl.RunArgs(compile=True, cudagraphs=True), "cpu")
    assert accel.flags == dict(compile=True, cudagraphs=True, device=torch.device("cpu")) and accel.cpu_compile
    assert not accel.replace(device=torch.device("cuda")).cpu_compile
    fn = accel.replace(compile=False)(affine, name="affine")  # --cudagraphs on a CPU: the shape guard alone
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    torch.testing.assert_close(fn(x, w), affine(x, w))
    with pytest.raises(leanrl.ShapeChangeError, match="affine"):
        fn(torch.randn(2, 4), w)


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


def test_shape_guard_looks_inside_dicts_and_tuples():
    """An env step's dict of tensors and a tuple of random numbers, as PPO's step takes them: a smaller tensor in
    either is named by its path."""
    fn = leanrl.accelerate(lambda out, noise: out["reward"] + noise[0], cudagraphs=True, name="act")
    fn(dict(reward=torch.ones(4), terminated=torch.zeros(4, dtype=torch.bool)), (torch.ones(4),))
    with pytest.raises(leanrl.ShapeChangeError, match=r"act: argument 0\['reward'\] .*\[4\].*\[1\]"):
        fn(dict(reward=torch.ones(1), terminated=torch.zeros(4, dtype=torch.bool)), (torch.ones(4),))
    with pytest.raises(leanrl.ShapeChangeError, match=r"act: argument 1\[0\] .*float64"):
        fn(dict(reward=torch.ones(4), terminated=torch.zeros(4, dtype=torch.bool)), (torch.ones(4).double(),))


def test_warmup_is_read_by_accelerate_and_the_logger(tmp_path):
    assert inspect.signature(leanrl.accelerate).parameters["warmup"].default == leanrl.WARMUP
    logger = leanrl.Logger(str(tmp_path), {}, total_steps=10, progress=False)
    assert logger.burn_in == leanrl.WARMUP
    logger.close()
