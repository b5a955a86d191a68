"""Smoke: the off-policy scripts run end to end in each mode this machine supports (see MODES), with buffers,
batches and learning starts small enough that the update path really runs, write their losses and a checkpoint,
and resume."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"eager": [], "compile": ["--compile"], "cudagraphs": ["--cudagraphs"],
         "compile+cudagraphs": ["--compile", "--cudagraphs"]}
if not torch.cuda.is_available():
    # --cudagraphs is then a shape guard over the same functions: compile+cudagraphs compiles all that compile
    # does, so compile alone (minutes of CI on a CPU) runs only where CUDA graphs are real.
    del MODES["compile"]
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
EXTRAS = ("dqn_cartpole.py", "compile+cudagraphs")


def run_script(script, flags, cwd, steps=STEPS):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *flags, "--total-timesteps", str(steps),
           "--run-dir", str(cwd), "--no-progress", "--log-every", "20", "--checkpoint-every", "50"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=cwd)


def rows_of(run_dir):
    (metrics,) = run_dir.glob("*/metrics.jsonl")
    return metrics, [json.loads(line) for line in open(metrics)]


FAST = {("td3_continuous.py", "eager"), ("sac_continuous.py", "eager"), ("dqn_cartpole.py", "compile+cudagraphs")}


@pytest.mark.parametrize("script, mode", [(s, m) if (s, m) in FAST else pytest.param(s, m, marks=pytest.mark.slow)
                                          for s in SCRIPTS for m in MODES])
def test_script_runs_in_every_mode_and_resumes(script, mode, tmp_path):
    flags, losses = SCRIPTS[script]
    # One eager run also saves its buffer and evaluates (an evaluation env of its own, charts/eval_return).
    extra = ["--save-buffer", "--eval-every", "80", "--eval-episodes", "3"] if (script, mode) == EXTRAS else []
    proc = run_script(script, flags + extra + MODES[mode], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "cudagraphs" in mode and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs a CUDA device") == 1
    metrics, rows = rows_of(tmp_path)
    assert rows[-1]["global_step"] == STEPS
    trained = rows[-2] if extra else rows[-1]  # an evaluating run ends with a row of its final evaluation
    assert all(k in trained for k in losses), trained
    assert "charts/SPS" in trained  # its clock restarts once the update functions are compiled (or captured)
    ckpt = metrics.parent / "checkpoint.pt"
    assert ckpt.is_file()
    if mode != "eager":
        return
    saved = torch.load(ckpt, weights_only=False)["replay_buffer"]
    if extra:
        assert [r["global_step"] for r in rows if "charts/eval_return" in r] == [80, 160]  # the last at the end
        assert len(saved["_storage"]["_storage"]["obs"]) == 512  # the whole buffer
    else:
        assert saved is None
    # --resume continues the same run directory to a longer horizon where no schedule depends on it (TD3, SAC);
    # DQN's epsilon schedule does, so it refuses in one line. Without the buffer a resumed run says so, and
    # updates start again once the buffer holds learning_starts new transitions.
    if script.startswith("dqn"):
        proc = run_script(script, flags + extra + ["--resume", str(ckpt)], tmp_path, steps=STEPS + 40)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"--total-timesteps {STEPS} -> {STEPS + 40}" in proc.stderr.strip().splitlines()[-1]
        return
    proc = run_script(script, flags + extra + ["--resume", str(ckpt), "--learning-starts", "16"], tmp_path,
                      steps=STEPS + 40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("holds no replay buffer" in proc.stderr) == (not extra)
    _, resumed = rows_of(tmp_path)
    assert resumed[: len(rows)] == rows and resumed[len(rows)]["global_step"] > STEPS
    assert resumed[-1]["global_step"] == STEPS + 40 and all(k in resumed[-1] for k in losses)


@pytest.mark.parametrize("script, flags, message", [
    ("td3_continuous.py", ["--batch-size", "512", "--buffer-size", "100"],
     "batch_size = 512 must be at most buffer_size = 100"),
    ("sac_continuous.py", ["--env-id", "CartPole-v1", "--learning-starts", "10"], "SAC needs a continuous (Box)"),
])
def test_bad_input_fails_before_any_compile(script, flags, message, tmp_path):
    """The scripts check their arguments, and the algorithms their env, before anything is compiled
    (every check is unit-tested in test_offpolicy.py; these two show the scripts reach them), and say so in one
    line, with exit code 2."""
    proc = run_script(script, flags + ["--compile"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert "torch._dynamo" not in proc.stderr and "inductor" not in proc.stderr
