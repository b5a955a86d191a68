"""Torch's CPU threads against model size: what `leanrl.threads` picks by default comes from this table.

Each workload is one training step of a model leanrl trains (forward, backward and Adam, eager), timed with 1 thread
and with every core the process may use, alternating in blocks, twice: on an idle machine, and with another process
spinning on one core (a machine shared with other jobs, the common case for a laptop or a CI runner). Writes
threads.json and threads.md to benchmarks/results/<machine>/ (or --out) and prints the table.

    python benchmarks/threads.py [--seconds 4] [--workloads ppo_mlp,td3_mlp,...] [--out DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

from leanrl.threads import MANY_THREADS_FROM
from measure import machine_info


def ppo_mlp():
    """PPO's MLP agent on CartPole, one update on a 256-sample minibatch."""
    from leanrl.algorithms import ppo

    import gymnasium as gym
    agent = ppo.make_agent(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))
    return agent, _ppo_step(agent, torch.randn(256, 4), torch.randint(0, 2, (256,)))


def atari_cnn():
    """PPO's Nature-CNN agent on Atari frames, one update on a 256-sample minibatch."""
    from leanrl.algorithms import ppo

    import gymnasium as gym
    agent = ppo.make_agent(gym.spaces.Box(0, 255, (4, 84, 84)), gym.spaces.Discrete(4))
    return agent, _ppo_step(agent, torch.randint(0, 256, (256, 4, 84, 84), dtype=torch.uint8),
                            torch.randint(0, 4, (256,)))


def _ppo_step(agent, obs, actions):
    from leanrl.algorithms import ppo

    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4, fused=True)
    n = obs.shape[0]
    batch = (obs, actions, torch.randn(n) - 1, torch.randn(n), torch.randn(n), torch.randn(n))

    def step():
        loss, _ = ppo.ppo_loss(agent, *batch, clip_coef=0.1, clip_vloss=True, norm_adv=True, ent_coef=0.01,
                               vf_coef=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def td3_mlp():
    """TD3's twin critic (256 x 256) on HalfCheetah's shapes, one critic update on a 256-sample batch."""
    critic = nn.Sequential(nn.Linear(17 + 6, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    return critic, _regression_step(critic, torch.randn(256, 23), torch.randn(256, 2))


def _regression_step(model, x, y):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def _causal_lm(hidden, layers, heads, kv_heads, intermediate, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, vocab, (8, 48))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5, fused=True)

    def step():
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, step


def grpo_tiny():
    """GRPO's default policy: a 2-layer model of hidden size 64 on a character vocabulary, 8 x 48 tokens."""
    return _causal_lm(64, 2, 4, 2, 256, 32)


def grpo_small():
    """A 6-layer model of hidden size 256 (a few million parameters), 8 x 48 tokens."""
    return _causal_lm(256, 6, 4, 2, 1024, 4096)


def smollm2_135m():
    """SmolLM2-135M's architecture (random weights), 8 x 48 tokens."""
    return _causal_lm(576, 30, 9, 3, 1536, 49152)


WORKLOADS = {f.__name__: f for f in (ppo_mlp, td3_mlp, grpo_tiny, atari_cnn, grpo_small, smollm2_135m)}


def measure(step, threads: list[int], seconds: float) -> dict:
    """Median seconds per step for each thread count, taken in alternating blocks of about 0.2 s."""
    times = {n: [] for n in threads}
    for n in threads:  # warm up each setting once
        torch.set_num_threads(n)
        step()
    t = time.perf_counter()
    step()
    per_block = max(1, round(0.2 / (time.perf_counter() - t)))
    deadline = time.perf_counter() + seconds * len(threads)
    while time.perf_counter() < deadline or min(len(v) for v in times.values()) < 5:
        for n in threads:
            torch.set_num_threads(n)
            t = time.perf_counter()
            for _ in range(per_block):
                step()
            times[n].append((time.perf_counter() - t) / per_block)
    return {n: statistics.median(v) for n, v in times.items()}


def spinner():
    """Another process keeping one core busy, as a job sharing the machine does."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def markdown(result: dict) -> str:
    cores = result["cores"]
    lines = [f"# Torch CPU threads against model size ({result['machine']['slug']}: {result['machine']['cpu']})", "",
             f"One eager training step (forward, backward, Adam) per workload, median ms; 1 thread against {cores} "
             f"(every core this process may use), in alternating blocks. *Shared*: another process spinning on one "
             f"core meanwhile. Command: `python benchmarks/threads.py`. torch {torch.__version__}, "
             f"{result['created']}.", "",
             f"| workload | parameters | idle: 1 thread | idle: {cores} | {cores}/1 | shared: 1 thread | "
             f"shared: {cores} | {cores}/1 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, w in result["workloads"].items():
        cells = []
        for condition in ("idle", "shared"):
            one, many = w[condition]["1"], w[condition][str(cores)]
            cells += [f"{one * 1e3:.2f}", f"{many * 1e3:.2f}", f"{one / many:.2f}x"]
        lines.append(f"| {name} | {w['parameters']:,} | " + " | ".join(cells) + " |")
    lines += ["", f"`{cores}/1` is the speed-up of {cores} threads over one (below 1: slower). By default "
              f"`leanrl.set_threads` computes on one thread below {MANY_THREADS_FROM:,} parameters, and above on one "
              "per core the load average leaves free."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="timing per thread count, workload and condition")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--out", help="results folder (default: benchmarks/results/<machine>)")
    a = p.parse_args()
    names = a.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        p.error("this process may use one core only: there is nothing to compare")
    machine = machine_info(torch.device("cpu"))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", machine["slug"])
    result = dict(machine=machine, cores=cores, created=time.strftime("%Y-%m-%d %H:%M"),
                  load_average_at_start=os.getloadavg()[0], workloads={})
    torch.manual_seed(0)
    for name in names:
        model, step = WORKLOADS[name]()
        w = result["workloads"][name] = dict(parameters=sum(p.numel() for p in model.parameters()))
        w["idle"] = {str(n): s for n, s in measure(step, [1, cores], a.seconds).items()}
        busy = spinner()
        try:
            w["shared"] = {str(n): s for n, s in measure(step, [1, cores], a.seconds).items()}
        finally:
            busy.kill()
        print(f"{name}: {w['parameters']:,} parameters; idle 1: {w['idle']['1'] * 1e3:.2f} ms, {cores}: "
              f"{w['idle'][str(cores)] * 1e3:.2f} ms; shared 1: {w['shared']['1'] * 1e3:.2f} ms, {cores}: "
              f"{w['shared'][str(cores)] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "threads.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(out, "threads.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
