"""Smoke: every script runs end to end in each mode this machine supports (see MODES), as a user would run it."""

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
SCRIPTS = {
    "ppo_atari.py": ["--num-envs", "2", "--num-steps", "32", "--total-timesteps", "2048"],
    "ppo_continuous.py": ["--num-steps", "256", "--num-minibatches", "4", "--update-epochs", "2",
                          "--total-timesteps", "2048"],
    "ppo_cartpole.py": ["--total-timesteps", "4096"],
}


def run_script(script, flags, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *flags, "--run-dir", str(tmp_path),
           "--no-progress", "--log-every", "4", "--checkpoint-every", "8"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", [s if s == "ppo_cartpole.py" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in SCRIPTS])
def test_script_runs_in_every_mode(script, mode, tmp_path):
    proc = run_script(script, SCRIPTS[script] + MODES[mode], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "cudagraphs" in mode and not torch.cuda.is_available():
        assert proc.stderr.count("--cudagraphs needs a CUDA device") == 1
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    assert rows[-1]["global_step"] >= 2048
    assert all(k in rows[-1] for k in ("losses/value_loss", "losses/policy_loss", "charts/SPS"))
    assert (metrics.parent / "checkpoint.pt").is_file()


@pytest.mark.parametrize("env", [
    ["--env-id", "torch/Pendulum-v1"],
    ["--num-envs", "2", "--num-env-buffers", "2", "--vectorization-mode", "async"]])  # HalfCheetah
def test_continuous_script_steps_torch_envs_and_gymnasium_envs_in_worker_processes(env, tmp_path):
    if "async" in env:
        pytest.importorskip("mujoco")
    proc = run_script("ppo_continuous.py", SCRIPTS["ppo_continuous.py"] + env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    assert json.loads(open(metrics).readlines()[-1])["global_step"] == 2048


def test_unknown_env_id_fails_before_any_compile(tmp_path):
    proc = run_script("ppo_cartpole.py", ["--env-id", "torch/CartPoleX-v9", "--compile"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line == "error: --env-id 'torch/CartPoleX-v9': unknown; did you mean 'torch/CartPole-v1'?"


def test_resume_from_a_missing_file_fails_before_any_compile(tmp_path):
    proc = run_script("ppo_cartpole.py", ["--resume", str(tmp_path / "missing.pt"), "--compile"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: --resume {tmp_path / 'missing.pt'}: no checkpoint at that path"


def test_cartpole_runs_as_one_graph_per_iteration(tmp_path):
    proc = run_script("ppo_cartpole.py", SCRIPTS["ppo_cartpole.py"] + ["--graph-iteration", "--cudagraphs"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    assert json.loads(open(metrics).readlines()[-1])["global_step"] == 4096


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo_atari.py", "ppo_continuous.py"])
def test_host_env_runs_resume_from_their_checkpoint(script, tmp_path):
    # without annealing, nothing depends on the horizon: a resumed run may go on longer
    assert run_script(script, SCRIPTS[script] + ["--no-anneal-lr"], tmp_path).returncode == 0
    (ckpt,) = tmp_path.glob("*/checkpoint.pt")
    flags = [f for f in SCRIPTS[script] if f != "2048"] + ["4096", "--no-anneal-lr", "--resume", str(ckpt)]
    proc = run_script(script, flags, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(ckpt.parent / "metrics.jsonl")]
    assert rows[-1]["global_step"] == 4096
