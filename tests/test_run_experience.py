"""Around a run, as a CleanRL user meets it: the summary at the end and on a signal (exit codes 130/143, no
traceback), the flags saved and checked on resume, one-line errors for torn and foreign checkpoints, atomic
checkpoint writes, TensorBoard event files, range checks on flags, evaluation and video."""

import dataclasses
import functools
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import leanrl
from leanrl.algorithms import ppo, ppo_async, td3
from leanrl.envs import make_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARTPOLE = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "1", "--update-epochs", "1"]


def run_script(script, flags, run_dir, **kwargs):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *flags, "--run-dir", str(run_dir), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=run_dir, **kwargs)


def only_run(run_dir):
    (path,) = glob.glob(f"{run_dir}/*/checkpoint.pt")
    return os.path.dirname(path), path


@pytest.fixture(scope="module")
def finished_cartpole(tmp_path_factory):
    """One short PPO CartPole run from the script: its process and run directory."""
    run_dir = tmp_path_factory.mktemp("cartpole")
    proc = run_script("ppo_cartpole.py", CARTPOLE + ["--total-timesteps", "1024"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, *only_run(run_dir)


def test_a_finished_run_prints_its_summary_and_saves_its_flags(finished_cartpole):
    proc, run, checkpoint = finished_cartpole
    out = proc.stdout
    assert f"run:        {run}" in out and "1,024 steps of 1,024 in" in out and "SPS after" in out
    assert f"checkpoint: {checkpoint}" in out
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    returns = [row["charts/episodic_return"] for row in rows if "charts/episodic_return" in row]
    recent = returns[-10:]
    assert len(recent) > 1 and (f"return:     last {returns[-1]:.2f} ({sum(recent) / len(recent):.2f} over the last "
                                f"{len(recent)} logs), best {max(returns):.2f} (charts/episodic_return)") in out, out
    config = json.load(open(os.path.join(run, "config.json")))
    assert config["num_envs"] == 8 and config["env_id"] == "torch/CartPole-v1"
    state = torch.load(checkpoint, weights_only=False)
    assert state["algorithm"] == "ppo_async" and config == {k: state["args"][k] for k in config}
    # a run without --async: config.json leaves out what only --async reads; the checkpoint keeps every flag
    async_only = {"num_collectors", "max_lag", "publish_every", "deterministic", "transport", "correction", "is_clip",
                  "max_restarts"}
    assert config["async_"] is False and set(state["args"]) - set(config) == async_only


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_prints_the_summary_and_exits_quietly(tmp_path, signum, code):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ppo_cartpole.py"), *CARTPOLE, "--total-timesteps",
           "100000000", "--run-dir", str(tmp_path), "--no-progress"]
    # A shell that starts jobs in the background makes them ignore SIGINT, and Python keeps an inherited SIG_IGN:
    # give the run the default disposition a terminal gives it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not glob.glob(f"{tmp_path}/*/metrics.jsonl") or not open(glob.glob(f"{tmp_path}/*/metrics.jsonl")[0]).read():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "interrupted; checkpoint saved (resume with --resume" in out
    assert "stopped by an interrupt at step" in out and "checkpoint: " in out
    _, checkpoint = only_run(tmp_path)
    assert torch.load(checkpoint, weights_only=False)["iteration"] >= 1


def copy_checkpoint(finished_cartpole, tmp_path):
    """A copy of the finished run's checkpoint, in its own directory (a resume logs into the checkpoint's)."""
    _, run, checkpoint = finished_cartpole
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    path.write_bytes(open(checkpoint, "rb").read())
    return path


def test_resume_refuses_a_breaking_flag_and_accepts_a_harmless_one(finished_cartpole, tmp_path):
    path = copy_checkpoint(finished_cartpole, tmp_path)
    proc = run_script("ppo_cartpole.py", CARTPOLE[:1] + ["4"] + CARTPOLE[2:] +
                      ["--total-timesteps", "2048", "--async", "--resume", str(path)], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "--num-envs 8 -> 4" in line and "--total-timesteps 1024 -> 2048" in line and "config.json" in line
    assert "--async False -> True" in line  # the flag as typed (the field is async_)
    proc = run_script("ppo_cartpole.py", CARTPOLE + ["--total-timesteps", "1024", "--log-every", "3", "--compile",
                                                     "--resume", str(path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1,024 steps of 1,024" in proc.stdout


@pytest.mark.parametrize("damage", [pytest.param("truncated", marks=pytest.mark.slow), "text"])
def test_a_torn_or_garbage_checkpoint_is_one_line(finished_cartpole, tmp_path, damage):
    path = copy_checkpoint(finished_cartpole, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a checkpoint\n")
    proc = run_script("ppo_cartpole.py", CARTPOLE + ["--total-timesteps", "1024", "--resume", str(path)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"error: --resume {path}: not a readable checkpoint (cut short, or not a file leanrl wrote)"


@pytest.mark.slow
def test_a_checkpoint_of_another_script_or_algorithm_is_one_line(finished_cartpole, tmp_path):
    _, _, checkpoint = finished_cartpole
    proc = run_script("ppo_atari.py", ["--num-envs", "2", "--num-steps", "32", "--total-timesteps", "64",
                                       "--resume", checkpoint], tmp_path)
    assert proc.returncode == 2 and "Missing key" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "a checkpoint of another script or experiment ('ppo_cartpole' on 'torch/CartPole-v1')" in line
    path = str(tmp_path / "td3.pt")
    leanrl.save_checkpoint(path, {"iteration": 1}, td3.Args())
    with pytest.raises(leanrl.CheckpointError, match="a td3 checkpoint .*, not one of ppo_async"):
        leanrl.load_checkpoint(path, ppo_async.Args())


def test_a_checkpoint_written_before_a_flag_existed_resumes_with_its_default(tmp_path):
    """Every flag added to an algorithm (e.g. GRPO's --chat-template) refused the checkpoints written before it:
    the saved value was missing, not the default. Now missing counts as the default, and only a change is refused."""
    path = str(tmp_path / "old.pt")
    leanrl.save_checkpoint(path, {"iteration": 1}, td3.Args())
    state = torch.load(path, weights_only=False)
    del state["args"]["policy_noise"]  # as if written before the flag existed
    torch.save(state, path)
    assert leanrl.load_checkpoint(path, td3.Args())["iteration"] == 1
    with pytest.raises(leanrl.CheckpointError, match=r"--policy-noise 0\.2 -> 0\.3"):
        leanrl.load_checkpoint(path, td3.Args(policy_noise=0.3))


def test_a_write_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    leanrl.save_checkpoint(path, {"iteration": 1})

    def torn_save(obj, f):
        open(f, "wb").write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        leanrl.save_checkpoint(path, {"iteration": 2})
    monkeypatch.undo()
    assert leanrl.load_checkpoint(path)["iteration"] == 1 and os.listdir(tmp_path) == ["checkpoint.pt"]


def test_tensorboard_reads_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=20, progress=False, summary=False)
    for step in (10, 20):
        logger.record({"losses/value_loss": torch.tensor(step / 10)})
        logger.record_episodes(torch.tensor([float(step)]), torch.tensor([5]))
        logger.end_iteration(step)
        logger.flush()
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("losses/value_loss")] == [(10, 1.0), (20, 2.0)]
    assert [e.value for e in events.Scalars("charts/episodic_return")] == [10.0, 20.0]
    assert "hyperparameters/text_summary" in events.Tags()["tensors"]


def test_a_sigterm_during_a_log_write_waits_for_the_row(tmp_path, monkeypatch):
    # Raised inside TensorBoard's queue put, the interrupt could lose the writer thread's wake-up and hang the
    # close that follows; the logger holds it until the row is written.
    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=10, progress=False, summary=False)
    written = []
    writer = logger.tensorboard.file_writer
    add_summary = writer.add_summary

    def signal_then_add_summary(summary, step):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler would run here, between the row's JSON line and its TensorBoard event
        add_summary(summary, step)
        written.extend(v.tag for v in summary.value)

    monkeypatch.setattr(writer, "add_summary", signal_then_add_summary)
    logger.record({"losses/a": torch.tensor(1.0), "losses/b": torch.tensor(2.0)})
    logger.end_iteration(10)
    with leanrl.save_on_interrupt(str(tmp_path / "checkpoint.pt"), dict), pytest.raises(KeyboardInterrupt):
        logger.flush()
    assert written == ["losses/a", "losses/b"]
    logger.close()


@pytest.mark.parametrize("flag, value, rule", [
    ("learning_rate", -1e-3, "> 0"), ("num_envs", 0, "> 0"), ("num_minibatches", 0, "> 0"),
    ("total_timesteps", -5, "> 0"), ("gamma", 1.5, r"in \[0, 1\]"), ("gae_lambda", float("nan"), r"in \[0, 1\]"),
    ("ent_coef", -0.1, ">= 0"), ("checkpoint_every", -1, ">= 0")])
def test_bad_numbers_name_their_flag(flag, value, rule):
    with pytest.raises(ValueError, match=f"^--{flag.replace('_', '-')} {value}: must be {rule}$"):
        ppo.check_args(ppo.Args(**{flag: value}))


def test_runs_started_in_the_same_second_get_a_directory_each(tmp_path, monkeypatch):
    """A sweep launched in parallel: same env, experiment name, seed and second. They shared one directory."""
    from leanrl.plot import run_identity

    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)
    args = leanrl.RunArgs(exp_name="sweep", run_dir=str(tmp_path / "runs"))
    dirs = [leanrl.make_run_dir(args, "torch/CartPole-v1") for _ in range(3)]
    name = "torch-CartPole-v1__sweep__1__1700000000"
    assert [os.path.basename(d) for d in dirs] == [name, f"{name}-2", f"{name}-3"]
    assert all(os.path.isdir(d) for d in dirs)
    assert run_identity(dirs[2]) == ("torch-CartPole-v1", "sweep", 1)  # leanrl.plot groups it with its seeds


def test_a_device_this_machine_lacks_is_one_line():
    with pytest.raises(leanrl.UsageError, match=r"^--device gpu: not a torch device \(auto, cpu, cuda, cuda:1, "):
        leanrl.resolve_device("gpu")
    count = torch.cuda.device_count()
    lacking = f"cuda:{count}"  # one past the last GPU; on a machine without CUDA, any
    with pytest.raises(leanrl.UsageError, match=f"^--device {lacking}: "
                       + ("CUDA is not available" if count == 0 else f"this machine has {count} CUDA device")):
        leanrl.resolve_device(lacking)


PLAN = ["--total-gpus", "8", "--gpu", "H100", "--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim",
        "128", "--prompt-len", "512", "--length-median", "1000", "--length-cap", "8192", "--batch", "512"]


@pytest.mark.parametrize("script, flags, module, extra", [
    ("ppo_atari.py", ["--run-dir", "runs"], "ale_py", "atari"),
    pytest.param("td3_continuous.py", ["--run-dir", "runs"], "mujoco", "mujoco", marks=pytest.mark.slow),
    pytest.param("grpo_arith.py", ["--run-dir", "runs"], "transformers", "llm", marks=pytest.mark.slow),
    pytest.param("plan_layout.py", [*PLAN, "--out", "plan"], "matplotlib", "plots", marks=pytest.mark.slow)])
def test_a_missing_extra_is_one_line_naming_it(script, flags, module, extra, tmp_path):
    """The script as a user runs it, with the extra's package not importable: the pip line, exit code 2, nothing
    written."""
    run = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = [{script!r}, *{flags!r}]; "
           f"runpy.run_path({os.path.join(ROOT, 'scripts', script)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.endswith(f"pip install 'leanrl[{extra}]'\n"), proc.stderr
    assert proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert os.listdir(tmp_path) == []


def test_ppo_evaluates_every_n_steps_and_at_the_end(tmp_path):
    args = ppo.Args(env_id="torch/CartPole-v1", num_envs=4, num_steps=32, num_minibatches=1, update_epochs=1,
                    total_timesteps=1024, eval_every=256, eval_episodes=3, run_dir=str(tmp_path), progress=False)
    make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, seed=11)
    result = ppo.train(args, make_env(args.env_id, args.num_envs, seed=1), torch.device("cpu"), make_eval_envs)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    evaluated = [r["global_step"] for r in rows if "charts/eval_return" in r]
    assert evaluated == [256, 512, 768, 1024]  # every 256 steps, the last one at the end
    assert all(r["charts/eval_return"] >= 8 for r in rows if "charts/eval_return" in r)  # CartPole's shortest
    with pytest.raises(ValueError, match="no make_eval_envs"):
        ppo.train(args, make_env(args.env_id, args.num_envs), torch.device("cpu"))


def test_evaluations_leave_training_as_it_was_and_score_the_same_weights_the_same(tmp_path):
    """An evaluation draws (its policy's actions, the torch env's resets) from torch's generators seeded for it and
    put back after (before: from training's, so --eval-every changed what a run learned)."""
    args = ppo.Args(env_id="torch/CartPole-v1", num_envs=4, num_steps=32, num_minibatches=1, update_epochs=1,
                    total_timesteps=512, eval_episodes=3, run_dir=str(tmp_path), progress=False)
    make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, seed=11)

    def trained(eval_every):
        result = ppo.train(dataclasses.replace(args, eval_every=eval_every), make_env(args.env_id, 4, seed=1),
                           torch.device("cpu"), make_eval_envs)
        return result.agent

    evaluated, plain = trained(eval_every=128), trained(eval_every=0)
    for name, value in plain.state_dict().items():
        assert torch.equal(evaluated.state_dict()[name], value), name
    eval_envs = make_eval_envs()
    evaluate = functools.partial(ppo.evaluate_policy, plain, eval_envs, {}, args.seed + 10_000)
    assert evaluate() == evaluate()


def test_async_ppo_evaluates_the_trainers_weights(tmp_path):
    args = ppo_async.Args(env_id="torch/CartPole-v1", num_envs=4, num_steps=32, num_minibatches=1, update_epochs=1,
                          total_timesteps=1024, eval_every=512, eval_episodes=3, run_dir=str(tmp_path),
                          progress=False, async_=True, num_collectors=1, max_lag=1, transport="threads")
    make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, seed=11)
    result = ppo_async.train(args, functools.partial(make_env, args.env_id, args.num_envs),
                             make_env(args.env_id, 1), torch.device("cpu"), make_eval_envs)
    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    assert [r["global_step"] for r in rows if "charts/eval_return" in r] == [512, 1024]
    assert all(r["charts/eval_return"] >= 8 for r in rows if "charts/eval_return" in r)


@pytest.mark.slow
def test_async_ppo_evaluates_and_resumes_with_the_collectors_observation_statistics(tmp_path):
    """Each collector normalizes observations with statistics of its own; they travel with its batches, so the
    trainer evaluates with the newest batch's and checkpoints them, and a resumed run's collectors go on from them
    (before, they started afresh: a count of about 128 where the run had seen 256 observations more)."""
    args = ppo_async.Args(env_id="Pendulum-v1", num_envs=2, num_steps=32, num_minibatches=1, update_epochs=1,
                          total_timesteps=256, anneal_lr=False, eval_every=128, eval_episodes=2, run_dir=str(tmp_path),
                          progress=False, async_=True, num_collectors=1, max_lag=1, transport="processes")
    make_envs = functools.partial(make_env, args.env_id, args.num_envs)
    make_eval_envs = functools.partial(make_env, args.env_id, args.eval_episodes, seed=11, normalize_reward=False)
    first = ppo_async.train(args, make_envs, make_env(args.env_id, 1), torch.device("cpu"), make_eval_envs)
    rows = [json.loads(line) for line in open(os.path.join(first.run_dir, "metrics.jsonl"))]
    assert [r["global_step"] for r in rows if "charts/eval_return" in r] == [128, 256]
    checkpoint = os.path.join(first.run_dir, "checkpoint.pt")
    count = torch.load(checkpoint, weights_only=False)["statistics"]["obs_rms"]["count"]
    assert 256 <= count < 300  # every observation of the 4 batches, resets included
    resumed = dataclasses.replace(args, total_timesteps=512, resume=checkpoint)
    ppo_async.train(resumed, make_envs, make_env(args.env_id, 1), torch.device("cpu"), make_eval_envs)
    assert torch.load(checkpoint, weights_only=False)["statistics"]["obs_rms"]["count"] >= count + 256


@pytest.mark.slow
def test_capture_video_films_the_evaluation(tmp_path):
    """PPO on Atari: the evaluation at the end is filmed (TD3, SAC and DQN: the next test)."""
    pytest.importorskip("ale_py")
    pytest.importorskip("moviepy")
    proc = run_script("ppo_atari.py", ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "1",
                                       "--update-epochs", "1", "--total-timesteps", "32", "--capture-video",
                                       "--eval-episodes", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, _ = only_run(tmp_path)
    videos = glob.glob(f"{run}/videos/*.mp4")
    assert videos and all(os.path.getsize(v) > 1000 for v in videos)
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert "charts/eval_return" in rows[-1]


@pytest.mark.slow
def test_off_policy_capture_video_films_every_evaluation_and_a_finished_run(tmp_path):
    """TD3 on Pendulum-v1 (pygame draws it): one whole episode filmed per evaluation, at 100 steps and at the end;
    resumed once finished, with --capture-video, the run films its trained agent again without training."""
    pytest.importorskip("pygame")
    pytest.importorskip("moviepy")
    flags = ["--env-id", "Pendulum-v1", "--total-timesteps", "200", "--learning-starts", "100", "--eval-every",
             "100", "--eval-episodes", "2", "--capture-video", "--log-every", "50", "--checkpoint-every", "0"]
    proc = run_script("td3_continuous.py", flags, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, checkpoint = only_run(tmp_path)
    assert len(glob.glob(f"{run}/videos/*.mp4")) == 2  # no 1-frame video of the episode an evaluation's end began
    assert re.search(r"^eval:       last -\d+\.\d\d \(charts/eval_return\)$", proc.stdout, re.M), proc.stdout
    proc = run_script("td3_continuous.py", flags + ["--resume", checkpoint], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(glob.glob(f"{run}/videos/*.mp4")) == 3 and "Overwriting existing videos" not in proc.stderr
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["global_step"] for r in rows if "charts/eval_return" in r] == [100, 200, 200]


@pytest.mark.parametrize("script, env_id, message", [
    ("ppo_atari.py", "ALE/Breakoutt-v5", "Unknown Atari game 'Breakoutt': ale-py has no such ROM (close matches: "
                                         "['Breakout'])"),
    pytest.param("ppo_continuous.py", "Blackjack-v1", "Blackjack-v1 has a Tuple observation space; only Box is "
                 "supported", marks=pytest.mark.slow),
    pytest.param("dqn_cartpole.py", "Pendulum-v1", "DQN needs a discrete action space; got Box(-2.0, 2.0, (1,), "
                 "float32)", marks=pytest.mark.slow),
    ("td3_continuous.py", "my_envs:Nope-v0", "--env-id my_envs:Nope-v0: cannot import 'my_envs'")])
def test_an_env_the_script_cannot_train_on_is_one_line(script, env_id, message, tmp_path):
    if script == "ppo_atari.py":
        pytest.importorskip("ale_py")
    proc = run_script(script, ["--env-id", env_id, "--learning-starts", "10"] if "dqn" in script else
                      ["--env-id", env_id], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", ["ppo_cartpole.py", pytest.param("dqn_cartpole.py", marks=pytest.mark.slow)])
def test_capture_video_of_a_torch_env_is_one_line_before_anything_is_built(script, tmp_path):
    proc = run_script(script, ["--capture-video"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: 'torch/CartPole-v1' steps in torch and does "
                                                           "not render"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and os.listdir(tmp_path) == []
