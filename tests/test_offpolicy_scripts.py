"""Smoke: the off-policy scripts run end to end in every mode this machine supports, with buffers, batches and
learning starts small enough that the update path really runs, write their losses and a checkpoint, and resume."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"eager": [], "compile": ["--compile"], "cudagraphs": ["--cudagraphs"],
         "compile+cudagraphs": ["--compile", "--cudagraphs"]}
STEPS = 160
SMALL = ["--learning-starts", "64", "--buffer-size", "512", "--batch-size", "32"]
SCRIPTS = {  # flags, the losses the log must hold
    "td3_continuous.py": (SMALL, ("losses/qf_loss", "losses/qf1_values", "losses/actor_loss")),
    "sac_continuous.py": (SMALL, ("losses/qf_loss", "losses/actor_loss", "losses/alpha", "losses/alpha_loss")),
    "dqn_cartpole.py": (SMALL + ["--train-frequency", "2", "--target-network-frequency", "32"],
                        ("losses/td_loss", "losses/q_values", "charts/epsilon")),
    "dqn_atari.py": (["--learning-starts", "64", "--buffer-size", "256", "--batch-size", "8",
                      "--target-network-frequency", "32"], ("losses/td_loss", "losses/q_values")),
}


def run_script(script, flags, cwd, steps=STEPS):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *flags, "--total-timesteps", str(steps),
           "--run-dir", str(cwd), "--no-progress", "--log-every", "20", "--checkpoint-every", "50"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd)


def rows_of(run_dir):
    (metrics,) = run_dir.glob("*/metrics.jsonl")
    return metrics, [json.loads(line) for line in open(metrics)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_runs_in_every_mode_and_resumes(script, mode, tmp_path):
    flags, losses = SCRIPTS[script]
    proc = run_script(script, flags + MODES[mode], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "cudagraphs" in mode and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs a CUDA device") == 1
    metrics, rows = rows_of(tmp_path)
    assert rows[-1]["global_step"] == STEPS
    assert all(k in rows[-1] for k in losses), rows[-1]
    assert all(rows[-1][k] == rows[-1][k] for k in losses)  # finite (the logger raises on non-finite losses)
    ckpt = metrics.parent / "checkpoint.pt"
    assert ckpt.is_file()
    if mode != "eager":
        return
    # --resume continues the same run directory to a longer horizon; the buffer was not saved, and it says so:
    # updates start again once it holds learning_starts new transitions.
    proc = run_script(script, flags + ["--resume", str(ckpt), "--learning-starts", "16"], tmp_path, steps=STEPS + 40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holds no replay buffer" in proc.stderr
    _, resumed = rows_of(tmp_path)
    assert resumed[: len(rows)] == rows and resumed[len(rows)]["global_step"] > STEPS
    assert resumed[-1]["global_step"] == STEPS + 40 and all(k in resumed[-1] for k in losses)


def test_save_buffer_and_evaluation(tmp_path):
    """--save-buffer puts the buffer in the checkpoint (a resume then says nothing about refilling);
    --eval-every logs charts/eval_return from an evaluation env of its own."""
    flags = SCRIPTS["dqn_cartpole.py"][0] + ["--save-buffer", "--eval-every", "80", "--eval-episodes", "3"]
    proc = run_script("dqn_cartpole.py", flags, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, rows = rows_of(tmp_path)
    assert sum("charts/eval_return" in r for r in rows) == 2
    ckpt = metrics.parent / "checkpoint.pt"
    assert len(torch.load(ckpt, weights_only=False)["replay_buffer"]["_storage"]["_storage"]["obs"]) == 512
    proc = run_script("dqn_cartpole.py", flags + ["--resume", str(ckpt)], tmp_path, steps=STEPS + 40)
    assert proc.returncode == 0 and "holds no replay buffer" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("script, flags, message", [
    ("td3_continuous.py", ["--batch-size", "512", "--buffer-size", "100"], "batch_size = 512 must be between 1 and"),
    ("sac_continuous.py", ["--learning-starts", "200"], "no update would ever run"),
    ("td3_continuous.py", ["--env-id", "CartPole-v1", "--learning-starts", "10"], "TD3 needs a continuous (Box) action"),
    ("dqn_cartpole.py", ["--env-id", "Pendulum-v1", "--learning-starts", "10"], "DQN needs a discrete action space"),
])
def test_bad_input_fails_before_any_compile(script, flags, message, tmp_path):
    proc = run_script(script, flags + ["--compile"], tmp_path)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-3000:]
    assert "torch._dynamo" not in proc.stderr and "inductor" not in proc.stderr
