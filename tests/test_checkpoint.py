"""leanrl.checkpoint: checkpoints written atomically, the random streams a resumed run continues, a save on
Ctrl-C/SIGTERM."""

import os
import signal

import pytest
import torch

import leanrl


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


def test_save_on_interrupt_saves_on_sigterm_reraises_and_restores_the_handler(tmp_path, capsys):
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


WRITER = """
import sys, torch, leanrl
path, start = sys.argv[1], int(sys.argv[2])
big = torch.ones(4_000_000)  # a write long enough for a kill to land inside it
for n in range(start, start + 10_000):
    leanrl.save_checkpoint(path, dict(n=n, weights=big * n))
    print(n, flush=True)
"""


def test_a_sigkill_during_checkpoint_writes_leaves_a_checkpoint_that_loads(tmp_path):
    """A process writing checkpoints back to back, SIGKILLed at random moments (most land inside a write): every
    time, the checkpoint there loads whole, and it is the newest the process finished."""
    import random
    import subprocess
    import sys
    import time

    path, rng, done = str(tmp_path / "checkpoint.pt"), random.Random(0), 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(done)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # one checkpoint written
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        finished = [int(line) for line in proc.communicate()[0].split()]
        state = leanrl.load_checkpoint(path)
        assert state["n"] >= max(finished, default=done)  # a finished write is never lost
        assert torch.equal(state["weights"], torch.full_like(state["weights"], state["n"]))  # and none is torn
        done = state["n"] + 1


def test_resume_auto_finds_this_experiments_newest_checkpoint_or_starts_fresh(tmp_path):
    """`--resume auto` (a job torchrun starts again): the newest checkpoint of the runs of this experiment and seed
    under --run-dir, none before the first is written (a fresh start, in a new run directory)."""
    from leanrl.algorithms import ppo

    args = ppo.Args(env_id="torch/CartPole-v1", exp_name="exp", seed=3, run_dir=str(tmp_path), resume="auto")
    assert leanrl.load_checkpoint("auto", args) is None
    fresh = leanrl.make_run_dir(args, args.env_id)
    assert os.path.dirname(fresh) == str(tmp_path)
    for name, n in (("torch-CartPole-v1__exp__3__100", 1), ("torch-CartPole-v1__exp__3__200", 2),
                    ("torch-CartPole-v1__other__3__300", 3), ("torch-CartPole-v1__exp__4__400", 4)):
        leanrl.save_checkpoint(str(tmp_path / name / "checkpoint.pt"), dict(n=n))
        os.utime(tmp_path / name / "checkpoint.pt", (n, n))  # written in this order
    assert leanrl.load_checkpoint("auto", args)["n"] == 2  # not another experiment's, nor another seed's
    assert leanrl.make_run_dir(args, args.env_id) == str(tmp_path / "torch-CartPole-v1__exp__3__200")
