"""PPO's math against references, optimized paths against eager, and learning on the on-device CartPole."""

import functools
import importlib.util
import os
import signal

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch._inductor.config
from tensordict import TensorDict
from torch.distributions import Categorical, Normal

import leanrl
from leanrl import cli
from leanrl.algorithms import ppo
from leanrl.envs import make_env

BOX4 = gym.spaces.Box(-1, 1, (4,))


def gae_reference(rewards, values, next_value, terminated, truncated, final_values, gamma, lam):
    """CleanRL's loop, written per element, with truncated episodes bootstrapped from their final obs."""
    T, N = rewards.shape
    adv = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if terminated[t, n]:
                next_v = 0.0
            elif truncated[t, n]:
                next_v = final_values[t, n].item()
            else:
                next_v = (values[t + 1, n] if t + 1 < T else next_value[n]).item()
            delta = rewards[t, n].item() + gamma * next_v - values[t, n].item()
            running = delta + (0.0 if terminated[t, n] or truncated[t, n] else gamma * lam * running)
            adv[t, n] = running
    return adv


def test_gae_matches_reference_loop_with_dones_and_truncations():
    torch.manual_seed(0)
    T, N = 17, 5
    rewards, values, final_values = torch.randn(T, N), torch.randn(T, N), torch.randn(T, N)
    next_value = torch.randn(N)
    terminated = torch.rand(T, N) < 0.15
    truncated = (torch.rand(T, N) < 0.15) & ~terminated
    next_values = torch.where(truncated, final_values, torch.cat([values[1:], next_value[None]]))
    adv, ret = ppo.gae(rewards, values, next_values, terminated, terminated | truncated, 0.99, 0.95)
    expected = gae_reference(rewards, values, next_value, terminated, truncated, final_values, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv + values)


@pytest.mark.parametrize("continuous", [False, True])
def test_ppo_loss_terms_against_hand_computed_values(continuous):
    torch.manual_seed(0)
    act_space = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    agent = ppo.make_agent(BOX4, act_space)
    B, clip = 6, 0.2
    obs = torch.randn(B, 4)
    actions = torch.randn(B, 2) if continuous else torch.randint(0, 3, (B,))
    old_logprobs, advantages = torch.randn(B) * 0.1 - 1.0, torch.randn(B)
    returns, old_values = torch.randn(B), torch.randn(B)
    loss, m = ppo.ppo_loss(agent, obs, actions, old_logprobs, advantages, returns, old_values, clip_coef=clip,
                           clip_vloss=True, norm_adv=True, ent_coef=0.01, vf_coef=0.5)

    # By hand, with torch.distributions as the independent reference for log-probs and entropy.
    with torch.no_grad():
        if continuous:
            dist = Normal(agent.actor(obs), agent.actor_logstd.exp().expand(B, 2))
            newlogprob, entropy = dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        else:
            dist = Categorical(logits=agent.actor(obs))
            newlogprob, entropy = dist.log_prob(actions), dist.entropy()
        newvalue = agent.critic(obs).squeeze(-1)
        ratio = torch.exp(newlogprob - old_logprobs)
        adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg = torch.stack([max(-a * r, -a * min(max(r, 1 - clip), 1 + clip)) for a, r in zip(adv, ratio)]).mean()
        v_clip = old_values + (newvalue - old_values).clamp(-clip, clip)
        v = 0.5 * torch.maximum((newvalue - returns) ** 2, (v_clip - returns) ** 2).mean()
        expected_loss = pg - 0.01 * entropy.mean() + 0.5 * v
    m = dict(zip(ppo.UPDATE_METRICS, m))  # the loss's statistics, by name
    torch.testing.assert_close(m["losses/policy_loss"], pg)
    torch.testing.assert_close(m["losses/value_loss"], v)
    torch.testing.assert_close(m["losses/entropy"], entropy.mean())
    torch.testing.assert_close(m["losses/approx_kl"], ((ratio - 1) - (newlogprob - old_logprobs)).mean())
    torch.testing.assert_close(m["losses/old_approx_kl"], (old_logprobs - newlogprob).mean())
    torch.testing.assert_close(m["losses/clipfrac"], ((ratio - 1).abs() > clip).float().mean())
    torch.testing.assert_close(loss, expected_loss)


@pytest.mark.parametrize("continuous", [False, True])
def test_policy_samples_follow_the_distribution(continuous):
    torch.manual_seed(0)
    act_space = gym.spaces.Box(-1, 1, (1,)) if continuous else gym.spaces.Discrete(3)
    agent = ppo.make_agent(BOX4, act_space)
    obs = torch.randn(1, 4).expand(20000, 4)
    with torch.no_grad():
        action, logprob, _ = ppo.policy(agent, obs)
        if continuous:
            torch.testing.assert_close(action.mean(), agent.actor(obs[:1]).squeeze(), atol=0.03, rtol=0)
        else:
            freq = torch.bincount(action, minlength=3).float() / len(action)
            torch.testing.assert_close(freq, agent.actor(obs[:1]).softmax(-1).squeeze(0), atol=0.015, rtol=0)


LOSS = functools.partial(ppo.ppo_loss, clip_coef=0.1, clip_vloss=True, norm_adv=True, ent_coef=0.01, vf_coef=0.5)


def _update_fns(accelerated, continuous, device, obs_space=BOX4):
    """PPO's agent, its update eager or accelerated as a run on `device` takes it (compiled, and on CUDA in a CUDA
    graph), and the update's optimizer."""
    torch.manual_seed(0)
    act_space = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    accel = leanrl.Acceleration(accelerated, accelerated and device.type == "cuda", device)
    agent = ppo.make_agent(obs_space, act_space, device=device)
    optimizer = leanrl.make_adam(agent.parameters(), 1e-3, eps=1e-5, **accel.flags)
    return agent, accel(functools.partial(ppo.update, agent, optimizer, LOSS, 0.5)), optimizer


@pytest.mark.parametrize("continuous", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_update_matches_eager_after_k_steps(continuous, device):
    torch.manual_seed(1)
    B = 64
    batches = [(torch.randn(B, 4), torch.randn(B, 2) if continuous else torch.randint(0, 3, (B,)),
                torch.randn(B) * 0.1 - 1, torch.randn(B), torch.randn(B), torch.randn(B)) for _ in range(5)]
    (eager_agent, eager_update, _), (compiled_agent, compiled_update, _) = _update_fns(False, continuous, device), \
        _update_fns(True, continuous, device)
    for batch in batches:
        batch = [x.to(device) for x in batch]
        torch.testing.assert_close(compiled_update(*batch), eager_update(*batch), rtol=1e-4, atol=1e-5)
    for (name, e), c in zip(eager_agent.named_parameters(), compiled_agent.parameters()):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("scanned", [False, True])
def test_the_compiled_atari_update_matches_eager(scanned, device):
    """The Nature CNN's update on uint8 frame stacks (channels_last convolutions) as a run takes it: one compiled
    (on a GPU also graphed) call per minibatch, or under --compile on a CPU the epochs' compiled scan. Each step
    starts from the same state, copied in place: at this loss's curvature, rounding in one step's parameters moves
    the next step's small gradients, which Adam's normalisation turns into large parameter differences."""
    if scanned and device.type != "cpu":
        pytest.skip("the scanned epochs are a CPU's")
    torch.manual_seed(1)
    frames, B = gym.spaces.Box(0, 255, (4, 84, 84), dtype=np.uint8), 16
    rollout = (torch.randint(0, 256, (2 * B, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 3, (2 * B,)),
               torch.randn(2 * B) * 0.1 - 1, torch.randn(2 * B), torch.randn(2 * B), torch.randn(2 * B))
    rollout = tuple(x.to(device) for x in rollout)
    (eager_agent, eager_update, eager_opt), (compiled_agent, compiled_update, compiled_opt) = (
        _update_fns(accelerated, False, device, frames) for accelerated in (False, True))
    learn = (leanrl.scan_gradient_steps(LOSS, compiled_agent, compiled_opt, 0.5, leanrl.Acceleration(compile=True))
             if scanned else functools.partial(ppo.update_epochs, compiled_update))
    for mb_inds in torch.randperm(2 * B, device=device).view(2, B).repeat(2, 1):  # two epochs of two minibatches
        torch.testing.assert_close(learn(rollout, mb_inds[None]),
                                   ppo.update_epochs(eager_update, rollout, mb_inds[None]), rtol=1e-4, atol=1e-5)
        for (name, e), c in zip(eager_agent.named_parameters(), compiled_agent.parameters()):
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=name)
        with torch.no_grad():
            for e, c in zip(eager_agent.parameters(), compiled_agent.parameters()):
                e.copy_(c)
                for k, x in eager_opt.state[e].items():
                    x.copy_(compiled_opt.state[c][k])


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True])
def test_scanned_update_epochs_match_eager(continuous):
    """Every epoch's updates as one compiled scan (CPU, --compile) against eager update calls, over two batches with
    a learning rate changed between them: the same outputs, parameters and Adam state, and an eager update after
    the scan continues from the state it wrote back."""
    args = ppo.Args(num_envs=4, num_steps=32, num_minibatches=4, update_epochs=3, compile=True)
    torch.manual_seed(1)
    B = args.num_envs * args.num_steps
    batches = [(torch.randn(B, 4), torch.randn(B, 2) if continuous else torch.randint(0, 3, (B,)),
                torch.randn(B) * 0.1 - 1, torch.randn(B), torch.randn(B), torch.randn(B)) for _ in range(3)]
    results = []
    for scanned in (False, True):
        torch.manual_seed(0)
        agent = ppo.make_agent(BOX4, gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3))
        optimizer = leanrl.make_adam(agent.parameters(), 1e-3, eps=1e-5, compile=scanned, cudagraphs=False,
                                     device="cpu")
        update = functools.partial(ppo.update_epochs, functools.partial(ppo.update, agent, optimizer, LOSS, 0.5))
        learn = (leanrl.scan_gradient_steps(LOSS, agent, optimizer, 0.5, leanrl.Acceleration(compile=True)) if scanned
                 else update)
        torch.manual_seed(2)
        outs = [learn(batches[0], ppo.minibatches(args, B, "cpu"))]
        optimizer.param_groups[0]["lr"].fill_(3e-4)
        outs.append(learn(batches[1], ppo.minibatches(args, B, "cpu")))
        outs.append(update(batches[2], ppo.minibatches(args, B, "cpu")))  # eager, from the state the scan left
        results.append((outs, agent, optimizer))
    (eager_outs, eager_agent, eager_opt), (scan_outs, scan_agent, scan_opt) = results
    torch.testing.assert_close(scan_outs, eager_outs, rtol=1e-4, atol=1e-5)
    for (name, e), c in zip(eager_agent.named_parameters(), scan_agent.parameters()):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(scan_opt.state[c][key], eager_opt.state[e][key], rtol=1e-4, atol=1e-6)


@torch._inductor.config.patch(fallback_random=True)  # compiled code draws eager's random numbers
def test_compiled_policy_matches_eager():
    agent = ppo.make_agent(BOX4, gym.spaces.Discrete(3))
    eager = functools.partial(ppo.policy, agent)
    compiled = leanrl.accelerate(functools.partial(ppo.policy, agent), compile=True)
    obs = torch.randn(32, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.manual_seed(5)
            expected = eager(obs)
            torch.manual_seed(5)
            for c, e in zip(compiled(obs), expected):
                torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_non_divisible_minibatches_fail_before_anything_is_built():
    with pytest.raises(ValueError, match="not divisible by num_minibatches = 3"):
        ppo.check_args(ppo.Args(num_envs=4, num_steps=128, num_minibatches=3))


def test_a_shape_change_under_a_graphed_policy_is_a_clear_error():
    agent = ppo.make_agent(BOX4, gym.spaces.Discrete(3))
    policy = leanrl.accelerate(functools.partial(ppo.policy, agent), cudagraphs=True, name="policy")
    with torch.no_grad():
        policy(torch.randn(8, 4))
        with pytest.raises(leanrl.ShapeChangeError, match=r"policy: argument 0 .*\[8, 4\].*\[1, 4\]"):
            policy(torch.randn(1, 4))


CARTPOLE = dict(env_id="torch/CartPole-v1", seed=1, num_envs=8, num_steps=128, total_timesteps=8192, log_every=2,
                checkpoint_every=0, progress=False)


def run_cartpole(tmp_path, on_iteration=None, **kw):
    args = ppo.Args(**{**CARTPOLE, "run_dir": str(tmp_path), **kw})
    envs = make_env(args.env_id, args.num_envs, seed=args.seed)
    return ppo.train(args, envs, torch.device("cpu"), on_iteration=on_iteration)


# compiled on a CPU: the scanned rollout and update
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_checkpoint_then_resume_equals_an_uninterrupted_run(compile, tmp_path):
    full = run_cartpole(tmp_path / "full", total_timesteps=4096, compile=compile)

    # The same schedule, stopped after two iterations by a SIGTERM (as `kill` would), then resumed.
    def sigterm_after_two(iteration, global_step):
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt):
        run_cartpole(tmp_path / "part", total_timesteps=4096, on_iteration=sigterm_after_two, compile=compile)
    (ckpt,) = (tmp_path / "part").glob("*/checkpoint.pt")
    assert torch.load(ckpt, weights_only=False)["iteration"] == 2
    resumed = run_cartpole(tmp_path / "part", total_timesteps=4096, resume=str(ckpt), compile=compile)
    assert (resumed.iteration, resumed.global_step) == (full.iteration, full.global_step) == (4, 4096)
    for (name, a), b in zip(full.agent.named_parameters(), resumed.agent.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(resumed.optimizer.state_dict()["state"][0]["exp_avg"],
                               full.optimizer.state_dict()["state"][0]["exp_avg"], rtol=0, atol=0)


def test_ppo_solves_on_device_cartpole(tmp_path):
    # rl-baselines3-zoo's CartPole settings (the defaults of scripts/ppo_cartpole.py); the last flush
    # averages every episode of the last 40 iterations (10k steps).
    trained = run_cartpole(tmp_path, num_envs=8, num_steps=32, num_minibatches=1, update_epochs=20,
                           learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, ent_coef=0.0, clip_coef=0.2,
                           anneal_clip=True, total_timesteps=100_000, log_every=40)
    assert trained.logged["charts/episodic_return"] >= 475, trained.logged


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["torch/CartPole-v1", "torch/Pendulum-v1"])
def test_whole_iteration_graph_matches_step_by_step_eager(env_id, tmp_path, monkeypatch):
    """--graph-iteration (rollout on the on-device env, GAE and every epoch in one graph, phases compiled)
    against plain eager, from the same seed, with discrete and continuous actions. On CPU the graph falls
    back, the compiled phases remain (GAE too: compiled, though on CPU --compile keeps it eager)."""
    monkeypatch.setenv("LEANRL_COMPILE_ON_CPU", "1")
    torch._dynamo.reset()  # no compiled code cached by earlier tests (under other settings) may be reused
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    agents = []
    for mode in (dict(), dict(compile=True, cudagraphs=True, graph_iteration=True)):
        args = ppo.Args(**{**CARTPOLE, "env_id": env_id, "num_steps": 16, "num_minibatches": 2, "update_epochs": 2,
                           "total_timesteps": 3 * 8 * 16, "run_dir": str(tmp_path / str(len(agents))), **mode})
        agents.append(ppo.train(args, make_env(args.env_id, args.num_envs, device=device), device).agent)
    for (name, e), g in zip(agents[0].named_parameters(), agents[1].parameters()):  # the message keeps its numbers
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda message: f"{name}: {message}")


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["torch/CartPole-v1", "torch/Pendulum-v1"])
def test_scanned_rollout_stores_what_the_eager_rollout_stores(env_id):
    """The compiled scan against eager step by step, from the same seed, over 210 steps: terminations and
    auto-resets (CartPole), time-limit truncations with their final values (Pendulum's 200 steps)."""
    args = ppo.Args(**{**CARTPOLE, "env_id": env_id, "num_steps": 210})
    cpu, results = torch.device("cpu"), []
    for scanned in (False, True):
        torch.manual_seed(0)
        envs = make_env(env_id, 8, seed=3)
        agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space).requires_grad_(False)
        storage, next_obs = ppo.make_storage(envs, args, cpu), envs.reset(seed=3)
        policy = functools.partial(ppo.policy, agent)
        if scanned:
            step = leanrl.scan_env_steps(lambda env_step, obs, noise: ppo.act(policy, agent.get_value, args, env_step,
                                                                              obs.clone(), noise), envs,
                                         leanrl.Acceleration(compile=True))
            ppo.scanned_rollout(step, agent.get_value, envs, next_obs, storage, args)
        else:
            ppo.stepwise_rollout(leanrl.Acceleration(), policy, agent.get_value, args, envs, storage, next_obs)()
        next_values, terminated = ppo.bootstrap(storage, args)
        results.append((storage, next_values, terminated, next_obs, envs.state_dict()))
    (eager, *eager_rest), (compiled, *compiled_rest) = results
    assert eager["truncated"].any() if env_id == "torch/Pendulum-v1" else eager["terminated"].any()
    for key in eager.keys():
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-5, msg=key)
    torch.testing.assert_close(compiled_rest, eager_rest, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("env_id", ["torch/CartPole-v1", "torch/Pendulum-v1"])
def test_compiled_rollout_scan_matches_eager(env_id, tmp_path, capfd, monkeypatch):
    """--compile with an on-device env on a CPU: the whole rollout one compiled scan, every epoch's updates
    another, GAE kept eager (and said so). The same parameters as eager step by step from the same seed, with
    discrete and continuous actions: both draw the rollout's random numbers up front (no fallback_random needed)."""
    monkeypatch.setattr(cli, "_said", set())  # said once per process: maybe before this test
    scanned = []
    for name in ("scan_env_steps", "scan_gradient_steps"):
        monkeypatch.setattr(leanrl, name, lambda *a, scan=getattr(leanrl, name), name=name: scanned.append(name) or
                            scan(*a))
    torch._dynamo.reset()
    agents = []
    for compile in (False, True):
        args = ppo.Args(**{**CARTPOLE, "env_id": env_id, "num_steps": 16, "num_minibatches": 2, "update_epochs": 2,
                           "total_timesteps": 3 * 8 * 16, "run_dir": str(tmp_path / str(compile)), "compile": compile})
        agents.append(ppo.train(args, make_env(args.env_id, args.num_envs), torch.device("cpu")).agent)
    assert scanned == ["scan_env_steps", "scan_gradient_steps"]  # the compiled run, only
    for (name, e), c in zip(agents[0].named_parameters(), agents[1].parameters()):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=name)
    assert "--compile keeps GAE eager" in capfd.readouterr().err


def test_graph_iteration_needs_an_on_device_env():
    with pytest.raises(ValueError, match="--graph-iteration needs an on-device env"):
        ppo.train(ppo.Args(graph_iteration=True, num_envs=1, num_steps=8, num_minibatches=1, total_timesteps=8),
                  make_env("Pendulum-v1", 1), torch.device("cpu"))


class GameCounter:
    """ale-py's vector interface, counting whole games on its own: the score and frames of each game that ends
    (ale-py reports a game over as terminated or truncated; the lives are AtariEnv's business)."""

    def __init__(self, ale, num_envs: int):
        self.env, self.scores, self.lengths = ale, [], []
        self.score, self.length = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)

    def recv(self):  # (AtariEnv sends each step's actions, then receives its results)
        obs, reward, terminated, truncated, info = self.env.recv()
        self.score += reward
        self.length += 1
        for i in np.flatnonzero(terminated | truncated):
            self.scores.append(self.score[i])
            self.lengths.append(self.length[i])
            self.score[i], self.length[i] = 0, 0
        return obs, reward, terminated, truncated, info

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_ppo_on_atari_logs_the_mean_game_score_and_length(tmp_path):
    """With episodic life every lost life is `terminated`, yet an episode is the whole game: the logged return and
    length are the mean score and length of the games that ended, counted here from ale-py's own steps."""
    pytest.importorskip("ale_py")
    envs = make_env("BreakoutNoFrameskip-v4", 8, seed=1)
    envs.env.ale = counter = GameCounter(envs.env.ale, 8)
    args = ppo.Args(env_id="BreakoutNoFrameskip-v4", num_envs=8, num_steps=128, num_minibatches=4, update_epochs=1,
                    total_timesteps=2 * 8 * 128, log_every=2, checkpoint_every=0, clip_reward=True,
                    bootstrap_truncated=False, progress=False, run_dir=str(tmp_path))
    logged = ppo.train(args, envs, torch.device("cpu")).logged
    envs.close()
    assert len(counter.scores) >= 5  # random play loses a game in about 175 steps
    assert logged["charts/episodic_return"] == pytest.approx(np.mean(counter.scores))
    assert logged["charts/episodic_length"] == pytest.approx(np.mean(counter.lengths))


# ------------------------------------------------------------------ host envs: one call per step, env buffers
def reference_rollouts(envs, agent, args, iterations: int) -> list:
    """CleanRL's rollout loop, key by key, with the same random numbers (`ppo.draw_noise`) and the final
    observations' values: per iteration, what the rollout stores of each step and the last observation's value."""
    obs, rollouts = envs.reset(seed=args.seed), []
    for _ in range(iterations):
        noise, steps = ppo.draw_noise(envs, args.num_steps, torch.device("cpu"))[0], []
        for t in range(args.num_steps):
            action, logprob, value = ppo.policy(agent, obs, noise[t])
            out = envs.step(action)
            steps.append(dict(obs=obs, actions=action, logprobs=logprob, values=value, rewards=out["reward"],
                              terminated=out["terminated"], truncated=out["truncated"],
                              final_values=agent.get_value(out["final_obs"]), episode_return=out["episode_return"],
                              episode_length=out["episode_length"].float()))
            obs = out["next_obs"]
        rollouts.append((TensorDict({k: torch.stack([s[k] for s in steps]) for k in steps[0]}), agent.get_value(obs)))
    return rollouts


def stepwise_rollouts(envs, agent, args, iterations: int, accel=leanrl.Acceleration()) -> list:
    storage = ppo.make_storage(envs, args, torch.device("cpu"))
    collect = ppo.stepwise_rollout(accel, functools.partial(ppo.policy, agent), agent.get_value, args, envs, storage,
                                   envs.reset(seed=args.seed))
    rollouts = []
    for _ in range(iterations):
        collect()
        rollouts.append((storage[:-1].clone(), storage["values"][-1].clone()))
    return rollouts


def host_envs(env_id: str, num_envs: int, buffers: int, seed: int):
    return leanrl.EnvBuffers.of(functools.partial(make_env, env_id), num_envs, buffers, seed=seed)


HOST_IDS = ["CartPole-v1", pytest.param("BreakoutNoFrameskip-v4", marks=pytest.mark.skipif(
    importlib.util.find_spec("ale_py") is None, reason="the atari extra is not installed"))]


@pytest.mark.parametrize("env_id", HOST_IDS)
@pytest.mark.parametrize("buffers", [1, 2])
def test_a_host_rollout_stores_what_cleanrls_loop_stores(env_id, buffers):
    """One call per step (the previous step's outcome stored with the next action) over two iterations, episode
    ends and the rollout boundary included: with one buffer exactly CleanRL's loop on the same envs; with two
    buffers (each stepping in the background while the policy acts on the other) the same transitions."""
    args = ppo.Args(env_id=env_id, seed=3, num_envs=4, num_steps=64, num_env_buffers=buffers, clip_reward=False)
    torch.manual_seed(0)
    probe = make_env(env_id, 4, seed=3)
    agent = ppo.make_agent(probe.single_observation_space, probe.single_action_space).requires_grad_(False)
    probe.close()
    results = []
    for make in (functools.partial(reference_rollouts, make_env(env_id, 4, seed=3)),
                 functools.partial(stepwise_rollouts, host_envs(env_id, 4, buffers, seed=3))):
        torch.manual_seed(1)
        with torch.no_grad():
            results.append(make(agent, args, iterations=2))
    ended = 0
    for (expected, last_value), (stored, stored_last_value) in zip(*results):
        ended += int((expected["episode_length"] > 0).sum())
        for key in expected.keys():
            if buffers == 1:
                assert torch.equal(stored[key].to(expected[key].dtype), expected[key]), key
            else:  # a policy's batch of 2 rounds as one of 4 does, within float error
                torch.testing.assert_close(stored[key].to(expected[key].dtype), expected[key], rtol=1e-5, atol=1e-5,
                                           msg=key)
        torch.testing.assert_close(stored_last_value, last_value, rtol=1e-5, atol=1e-5)
    assert ended > 0


def test_a_compiled_host_step_stores_what_the_eager_one_stores():
    """--compile on a CPU with host envs in two buffers: each buffer's step one compiled graph (policy, critic,
    storing), the same storage as eager over two iterations."""
    args = ppo.Args(env_id="CartPole-v1", seed=3, num_envs=4, num_steps=64, num_env_buffers=2)
    torch.manual_seed(0)
    probe = make_env("CartPole-v1", 1)
    agent = ppo.make_agent(probe.single_observation_space, probe.single_action_space).requires_grad_(False)
    results = []
    for accel in (leanrl.Acceleration(), leanrl.Acceleration(compile=True)):
        torch.manual_seed(1)
        results.append(stepwise_rollouts(host_envs("CartPole-v1", 4, 2, seed=3), agent, args, 2, accel))
    for (eager, eager_last), (compiled, compiled_last) in zip(*results):
        for key in eager.keys():
            torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-5, msg=key)
        torch.testing.assert_close(compiled_last, eager_last, rtol=1e-5, atol=1e-5)


def test_ppo_with_env_buffers_is_deterministic_and_resumes(tmp_path):
    """Two buffers of gymnasium envs (each stepped by a thread of its own): two runs from one seed end with the
    same parameters; a checkpoint of the buffered envs resumes."""
    def run(name, on_iteration=None, **kw):
        args = ppo.Args(**{**CARTPOLE, "env_id": "CartPole-v1", "num_envs": 4, "num_env_buffers": 2, "num_steps": 32,
                           "total_timesteps": 3 * 128, "run_dir": str(tmp_path / name), **kw})
        envs = host_envs(args.env_id, args.num_envs, args.num_env_buffers, seed=args.seed)
        try:
            return ppo.train(args, envs, torch.device("cpu"), on_iteration=on_iteration)
        finally:
            envs.close()

    first, second = run("a"), run("b")
    for (name, a), b in zip(first.agent.named_parameters(), second.agent.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert run("c", on_iteration=lambda iteration, step: iteration == 2).global_step == 2 * 128
    (ckpt,) = (tmp_path / "c").glob("*/checkpoint.pt")
    assert run("c", resume=str(ckpt)).global_step == 3 * 128


def test_env_buffers_fail_clearly_where_they_cannot_work():
    with pytest.raises(leanrl.UsageError, match="num_envs = 6 is not divisible by num_env_buffers = 4"):
        ppo.check_args(ppo.Args(num_envs=6, num_env_buffers=4))
    with pytest.raises(leanrl.UsageError, match="on-device env"):
        host_envs("torch/CartPole-v1", 4, 2, seed=0)
    args = ppo.Args(env_id="CartPole-v1", num_envs=4, num_steps=32, num_env_buffers=2, progress=False)
    with pytest.raises(leanrl.UsageError, match="envs in 1 buffers, num_env_buffers = 2"):
        ppo.train(args, make_env("CartPole-v1", 4), torch.device("cpu"))
