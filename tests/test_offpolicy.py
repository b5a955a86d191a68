"""The off-policy loops of TD3, SAC and DQN, what they share: the transitions they store, one learner call per env
step whose accelerated form samples and updates what eager does, resume with and without the buffer, the SPS
clock, and the clear errors."""

import json

import gymnasium as gym
import pytest
import torch
import torch._inductor.config
from offpolicy_helpers import TORQUE, ScriptedEnv, small

import leanrl
from leanrl.algorithms import dqn, sac, td3
from leanrl.envs import make_env
from leanrl.replay import burn_in


@pytest.mark.parametrize("module", [td3, sac, dqn])
def test_a_transition_keeps_the_true_next_obs_and_a_truncation_is_no_termination(module, tmp_path):
    torch.manual_seed(0)
    space = gym.spaces.Discrete(2) if module is dqn else TORQUE
    # step 2: env 0 terminates, env 1 is truncated (a time limit)
    env = ScriptedEnv(num_envs=2, action_space=space, ends={2: ([True, False], [False, True])})
    replay = module.train(small(module, learning_starts=5, total_timesteps=6, run_dir=str(tmp_path)), env,
                          "cpu").replay
    data = {k: v[:len(replay)] for k, v in replay.storage.items()}
    assert len(replay) == 6
    step2 = {k: v[2:4] for k, v in data.items()}  # transitions are stored in env order, step by step
    torch.testing.assert_close(step2["obs"], env.obs(1))
    torch.testing.assert_close(step2["next_obs"], env.obs(2))  # the true last obs, not the reset one
    assert step2["terminated"].tolist() == [True, False]  # the truncated one bootstraps
    torch.testing.assert_close(data["obs"][4:6], env.obs(2, reset=True))  # after the reset, from the reset obs


# The learner's call as a run on this device takes it (a CPU: one compiled graph, its gradient steps functions; a GPU:
# compiled and CUDA-graphed), against eager, from the same seed: the same replay contents and samples (compiled code
# drawing eager's random numbers), the same updates.
@pytest.mark.parametrize("module, env_id", [(td3, "torch/Pendulum-v1"), (sac, "torch/Pendulum-v1"),
                                            (dqn, "torch/CartPole-v1"), (dqn, "BreakoutNoFrameskip-v4")])
def test_the_accelerated_learner_samples_and_updates_what_eager_does(module, env_id, device, tmp_path):
    results = []
    for accelerated in (False, True):
        args = small(module, env_id=env_id, num_envs=2, total_timesteps=120, learning_starts=40, batch_size=16,
                     buffer_size=80, compile=accelerated, cudagraphs=accelerated and device.type == "cuda",
                     run_dir=str(tmp_path / str(accelerated)), log_every=10, **({"train_frequency": 2} if module is
                                                                                  dqn else {}))
        with torch._inductor.config.patch(fallback_random=True):
            run = module.train(args, make_env(env_id, 2, device=device, seed=1), device)
        results.append(run)
    eager, fast = results
    n = len(eager.replay)
    assert n == len(fast.replay) == 80
    for k, x in eager.replay.storage.items():
        torch.testing.assert_close(fast.replay.storage[k][:n], x[:n], msg=k)
    params = lambda run: {k: v for k, v in leanrl.state_of(run.learner.parts()).items() if "optimizer" not in k}  # noqa: E731
    for name, e in params(eager).items():
        e, f = (e if isinstance(e, dict) else {name: e}), (params(fast)[name] if isinstance(e, dict) else
                                                            {name: params(fast)[name]})
        for k in e:
            torch.testing.assert_close(f[k], e[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
    losses = [k for k in eager.logged if k.startswith("losses/")]
    assert losses and all(fast.logged[k] == pytest.approx(eager.logged[k], rel=1e-3, abs=1e-5) for k in losses)


@pytest.mark.parametrize("module", [td3, sac, dqn])
def test_bad_settings_fail_before_anything_is_built(module):
    with pytest.raises(ValueError, match="batch_size = 512 must be at most buffer_size = 100"):
        module.check_args(module.Args(batch_size=512, buffer_size=100))
    lr = "policy_lr" if module is sac else "learning_rate"
    for flag, value, rule in ((lr, -1e-3, "> 0"), ("gamma", 1.5, "in \\[0, 1\\]"), ("batch_size", 0, "> 0"),
                              ("learning_starts", -1, ">= 0"), ("total_timesteps", 0, "> 0")):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} {value}: must be {rule}"):
            module.check_args(module.Args(**{flag: value}))
    with pytest.raises(ValueError, match="no update would ever run"):
        module.check_args(module.Args(learning_starts=5000, total_timesteps=5000))
    with pytest.raises(ValueError, match="less than one step"):
        module.check_args(module.Args(total_timesteps=1, num_envs=2))


@pytest.mark.parametrize("module", [td3, sac])
def test_a_discrete_env_given_to_td3_or_sac_is_a_clear_error(module, tmp_path):
    with pytest.raises(ValueError, match="needs a continuous \\(Box\\) action space"):
        module.train(small(module, run_dir=str(tmp_path)), ScriptedEnv(action_space=gym.spaces.Discrete(2)), "cpu")


def test_a_continuous_env_given_to_dqn_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="DQN needs a discrete action space"):
        dqn.train(small(dqn, run_dir=str(tmp_path)), ScriptedEnv(action_space=TORQUE), "cpu")


def test_eval_every_without_an_eval_env_is_a_clear_error(tmp_path):
    for flag in ("eval_every", "capture_video"):
        with pytest.raises(ValueError, match="--eval-every / --capture-video: train\\(\\) was given no make_eval_envs"):
            td3.train(small(td3, run_dir=str(tmp_path), **{flag: 100 if flag == "eval_every" else True}),
                      ScriptedEnv(), "cpu")


def test_the_sps_clock_restarts_once_the_learner_is_compiled(tmp_path):
    """Off-policy runs compile at learning_starts, long after the logger's burn-in: the clock starts after the
    first few updates, so compile and capture time never dilute SPS (it is in perf/warmup_time)."""
    args = small(td3, learning_starts=10, policy_frequency=2, total_timesteps=40, log_every=1, run_dir=str(tmp_path))
    restart_step = 10 + 2 * 7  # the 7th update (the actor's third call, WARMUP + 1) is at step 24
    assert burn_in(args, 0, 0, (leanrl.WARMUP + 1) * 2 + 1) * args.num_envs == restart_step
    td3.train(args, ScriptedEnv(num_envs=2), "cpu")
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["global_step"] for r in rows if "perf/warmup_time" in r][0] == restart_step
    assert [r["global_step"] for r in rows if "charts/SPS" in r][0] == restart_step + 2


PENDULUM = dict(env_id="torch/Pendulum-v1", seed=1, num_envs=1, hidden_dim=16, batch_size=16, buffer_size=1000,
                learning_starts=50, total_timesteps=160, log_every=20, checkpoint_every=0, progress=False)


def run_pendulum(module, tmp_path, on_iteration=None, **kw):
    args = module.Args(**{**PENDULUM, "run_dir": str(tmp_path), **kw})
    return module.train(args, make_env(args.env_id, args.num_envs, seed=args.seed), torch.device("cpu"),
                        on_iteration=on_iteration)


def interrupted_then_resumed(module, tmp_path, after, **kw):
    """Ctrl-C at the end of iteration `after`, then a resume from the checkpoint it saved."""
    def interrupt(iteration, global_step):
        if iteration == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pendulum(module, tmp_path, on_iteration=interrupt, **kw)
    (ckpt,) = tmp_path.glob("*/checkpoint.pt")
    return run_pendulum(module, tmp_path, resume=str(ckpt), **kw)


@pytest.mark.parametrize("compile", [False, True])  # compiled on a CPU: the learner's step one graph
@pytest.mark.parametrize("module", [td3, pytest.param(sac, marks=pytest.mark.slow)])
def test_resume_with_the_buffer_equals_an_uninterrupted_run(module, compile, tmp_path):
    full = run_pendulum(module, tmp_path / "full", save_buffer=True, compile=compile)
    resumed = interrupted_then_resumed(module, tmp_path / "part", after=100, save_buffer=True, compile=compile)
    assert (resumed.iteration, resumed.global_step) == (full.iteration, full.global_step) == (160, 160)
    for (name, a), b in zip(full.learner.actor.named_parameters(), resumed.learner.actor.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    for k, v in full.learner.q_params.items(True, True):
        torch.testing.assert_close(resumed.learner.q_params[k], v, rtol=0, atol=0)
    n = len(full.replay)
    for k, x in full.replay.storage.items():
        assert torch.equal(resumed.replay.storage[k][:n], x[:n]), k


def test_resume_without_the_buffer_says_so_and_refills_it(tmp_path, capfd):
    resumed = interrupted_then_resumed(td3, tmp_path, after=100, total_timesteps=200)
    assert "holds no replay buffer" in capfd.readouterr().err
    assert resumed.fill_start == 100 and len(resumed.replay) == 100  # only what the resumed run collected
