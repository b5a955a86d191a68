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
