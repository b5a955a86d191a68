"""The layout planner: formulas against hand-computed values, the simulator against closed forms where they are
exact, admission control in simulation, the sweep against brute-force simulation, --compare, bad input."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from leanrl import layout as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M7B = L.Model(7e9, 32, 8, 128)  # Llama-2-7B-like with 8 KV heads, bf16


def setup(**kw):
    base = dict(total_gpus=8, model=M7B, gpu=L.GPUS["H100"], lengths=L.Lengths("constant", 1536, cap=1536),
                prompt_len=512, batch=64, max_lag=2, pause_s=0.0)
    return L.Setup(**{**base, **kw})


def flat(step_s, **kw):
    """A system whose decode step takes step_s at any batch (a measured flat curve): exact closed forms."""
    return setup(latency=L.LatencyCurve((1, 1024), (step_s, step_s)), **kw)


def test_roofline_knee_kv_cap_and_step_time():
    s = setup()
    assert L.knee(s) == pytest.approx(989e12 * 2 / (2 * 3.35e12))  # 295.2
    assert M7B.kv_per_token == 2 * 32 * 8 * 128 * 2  # 131072 bytes
    # (80e9 * 0.9 - 14e9) bytes / (131072 bytes * 2048 tokens) = 216.07
    assert L.kv_cap(s) == 216
    # B = 1: memory-bound, weights plus one context of p + E[l^2]/(2E[l]) = 512 + 768 tokens
    assert L.step_time(s, 1) == pytest.approx((14e9 + 1280 * 131072) / 3.35e12)
    big = setup(model=L.Model(7e9, 1, 1, 1), lengths=L.Lengths("constant", 8, cap=8), prompt_len=0)
    assert L.step_time(big, 1000) == pytest.approx(2 * 7e9 * 1000 / 989e12)  # past the knee: compute-bound


def test_balance_and_trainer_time():
    s = flat(0.02, train_tokens_per_s=20_000.0, max_lag=4)
    # trainer: 64 sequences x 2048 tokens / (2 GPUs x 20k tokens/s) = 3.2768 s per step
    assert L.train_step_time(s, 2) == pytest.approx(64 * 2048 / 40_000)
    # 6 samplers x 32 slots: 6 / (1536 x 0.02 / 32) = 6.25 seq/s < trainer 64 / 3.2768 = 19.5 seq/s
    # admission: 5 x 64 sequences per (1536 x 0.02 + 3.2768) s = 9.4 seq/s, not binding
    p = L.predict(s, 6, 32)
    assert p.bound == "sampler" and p.seqs_per_s == pytest.approx(6.25)
    assert p.trainer_idle == pytest.approx(1 - 6.25 / (64 / 3.2768))
    # 7 replicas of 128 slots: 29 seq/s; one trainer GPU: 64 / 6.5536 = 9.77 seq/s; admission (max_lag 8):
    # 9 x 64 / (30.72 + 6.55) = 15.5 seq/s
    q = L.predict(dataclasses.replace(s, max_lag=8), 7, 128)
    assert q.bound == "trainer" and q.seqs_per_s == pytest.approx(64 / 6.5536) and q.lag_mean == 8
    r = L.predict(dataclasses.replace(s, max_lag=1), 7, 128)  # 2 x 64 / 37.27 s: the admission binds
    assert r.bound == "admission" and r.seqs_per_s == pytest.approx(128 / (1536 * 0.02 + 6.5536))
    mfu = setup(mfu=0.5)  # 6P FLOPs per token at 50% of 989 TFLOP/s
    assert L.train_step_time(mfu, 4) == pytest.approx(64 * 2048 * 6 * 7e9 / (4 * 989e12 * 0.5))


def test_expected_max_of_lengths():
    u = L.Lengths("empirical", values=(1, 2, 3, 4))
    assert u.moment(1) == pytest.approx(2.5)
    assert u.expected_max(2) == pytest.approx(sum(max(a, b) for a in (1, 2, 3, 4) for b in (1, 2, 3, 4)) / 16,
                                              rel=1e-3)
    ln = L.Lengths("lognormal", 100, 1.0, cap=10**9)
    assert ln.moment(1) == pytest.approx(100 * 2.718281828 ** 0.5, rel=0.01)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_simulator_equals_closed_form_batch_modes(mode):
    s = flat(0.01, mode=mode, max_lag=2 if mode != "sync" else 0, train_step_s=3.0, pause_s=0.5, total_gpus=8)
    n = 8 if mode == "sync" else 4
    p, sim = L.predict(s, n, 16), L.simulate(s, n, 16, steps=40, warmup=5)
    assert sim.seqs_per_s == pytest.approx(p.seqs_per_s, rel=1e-6)
    assert sim.lag_mean == p.lag_mean and sim.token_lag_mean == p.token_lag_mean


def test_simulator_equals_closed_form_pipelined():
    trainer_bound = flat(0.01, train_step_s=5.0, max_lag=5)
    p, sim = L.predict(trainer_bound, 6, 64), L.simulate(trainer_bound, 6, 64, steps=60, warmup=10)
    assert p.bound == "trainer"
    assert sim.seqs_per_s == pytest.approx(p.seqs_per_s, rel=1e-6) and sim.lag_mean == p.lag_mean == 5
    sampler_bound = flat(0.01, train_step_s=0.5, max_lag=3)
    p, sim = L.predict(sampler_bound, 2, 16), L.simulate(sampler_bound, 2, 16, steps=60, warmup=10)
    assert p.bound == "sampler"
    assert sim.seqs_per_s == pytest.approx(p.seqs_per_s, rel=0.01)
    assert sim.lag_mean == pytest.approx(p.lag_mean, abs=0.15)


def test_handoff_lengthens_the_admission_loop_in_model_and_simulator():
    # D = 1536 x 0.01 = 15.36 s per sequence, T = 1 s: the admission bound, (max_lag + 1)·b / (D + T + h)
    for h in (0.0, 4.0):
        s = flat(0.01, train_step_s=1.0, max_lag=1, handoff_s=h)
        p, sim = L.predict(s, 4, 64), L.simulate(s, 4, 64, steps=60, warmup=10)
        assert p.bound == "admission"
        assert p.seqs_per_s == pytest.approx(2 * 64 / (15.36 + 1.0 + h))
        assert sim.seqs_per_s == pytest.approx(p.seqs_per_s, rel=1e-6) and sim.lag_mean == p.lag_mean == 1
    # sampler-bound: the rate stays, the lag grows by (X/b)·h
    fast, slow = (flat(0.01, train_step_s=0.5, max_lag=3, handoff_s=h) for h in (0.0, 2.0))
    p0, p1 = L.predict(fast, 2, 16), L.predict(slow, 2, 16)
    assert p0.bound == p1.bound == "sampler" and p1.seqs_per_s == p0.seqs_per_s
    assert p1.lag_mean == pytest.approx(p0.lag_mean + p0.seqs_per_s / 64 * 2.0)
    sim = L.simulate(slow, 2, 16, steps=60, warmup=10)
    assert sim.seqs_per_s == pytest.approx(p1.seqs_per_s, rel=0.01)
    assert sim.lag_mean == pytest.approx(p1.lag_mean, abs=0.15)


def test_model_and_simulator_agree_heavy_tail():
    s = setup(lengths=L.Lengths("lognormal", 1000, 1.0, cap=8192), batch=256, max_lag=4)
    for n, b in [(4, 50), (5, 32), (3, 50)]:
        p, sim = L.predict(s, n, b), L.simulate(s, n, b, steps=100, warmup=10)
        assert sim.seqs_per_s == pytest.approx(p.seqs_per_s, rel=0.05), (n, b)


def test_ticket_order_admission_bound_matches_the_simulator():
    """PPO's trainer takes rollouts in start order: one done early waits for the ones before it, so Little's law
    on the mean rollout time overestimates the admission bound (by 10 % here); the recursion (10) follows the
    simulator. One-slot replicas, rollouts of ~0.2 s (2000 steps of 0.1 ms, CV 0.3), 14 ms updates, h = 3 ms."""
    s = L.Setup(total_gpus=5, model=L.Model(1e4, 1, 1, 1), gpu=L.GPUS["CPU"], batch=1, max_lag=2, mode="pipelined",
                lengths=L.Lengths("lognormal", 2000, 0.3, cap=10**6), train_step_s=0.014, pause_s=0.0,
                handoff_s=0.003, latency=L.LatencyCurve((1,), (1e-4,)), consume="ticket")
    p, sim = L.predict(s, 4, 1), L.simulate(s, 4, 1, steps=4000, warmup=50)
    little = 3 / (s.lengths.moment(1) * 1e-4 + 0.014 + 0.003)
    assert p.bound == "admission" and little > 1.05 * sim.seqs_per_s
    assert p.seqs_per_s == pytest.approx(sim.seqs_per_s, rel=0.02)


@settings(max_examples=25, deadline=None)
@given(replicas=st.integers(1, 4), slots=st.integers(1, 8), batch=st.integers(1, 12), max_lag=st.integers(1, 4),
       train_s=st.floats(0.01, 2.0), sigma=st.floats(0.0, 1.5), consume=st.sampled_from(["finish", "ticket"]),
       handoff=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 1000))
def test_admission_never_exceeded(replicas, slots, batch, max_lag, train_s, sigma, consume, handoff, seed):
    s = L.Setup(total_gpus=replicas + 1, model=L.Model(1e6, 1, 1, 1), gpu=L.GPUS["CPU"], batch=batch,
                lengths=L.Lengths("lognormal", 20, sigma, cap=400), max_lag=max_lag, train_step_s=train_s,
                latency=L.LatencyCurve((1, 8), (0.01, 0.02)), pause_s=0.05, consume=consume, handoff_s=handoff)
    trace = {}
    L.simulate(s, replicas, slots, steps=30, warmup=3, seed=seed, trace=trace)
    started = trace["start_version"]
    # sequence i starts only while i < (max_lag + v + 1) * batch, v the trainer's version at its start
    assert all(i < (max_lag + v + 1) * batch for i, v in enumerate(started))
    consumed = trace["consumed_at"] >= 0
    lags = trace["consumed_at"][consumed] - started[consumed]
    # the bound holds for every consumed sequence: in start order by admission, in finish order because what would
    # be consumed later than the bound is restarted (its last start is the one traced)
    assert (lags >= 0).all() and (lags <= max_lag).all()


def test_the_simulated_lag_is_the_bounded_lag_a_run_logs():
    """The worked example's pipelined layout (finish order, heavy-tailed lengths): the simulator's lag histogram
    ends at max_lag for sequences and tokens, as a run's lag/ metrics do; the long sequences the bound would
    have consumed late are restarted instead, and counted; the idle fractions are fractions."""
    s = setup(lengths=L.Lengths("lognormal", 1000, 1.0, cap=8192), batch=512, max_lag=4, extra_forwards=1, mfu=0.4)
    sim = L.simulate(s, 4, 50, steps=60, warmup=10)
    assert sim.lag_max == 4 and len(sim.lag_hist) > 5 and sim.lag_hist[5:] == sim.token_lag_hist[5:] == [0.0]
    assert sim.token_lag_mean <= 4 and sim.restarts > 0
    assert 0 <= sim.trainer_idle <= 1 and 0 <= sim.sampler_idle <= 1


def test_sweep_matches_brute_force_simulation():
    s = flat(0.01, total_gpus=5, train_tokens_per_s=40_000.0, batch=32, max_lag=2,
             lengths=L.Lengths("constant", 200, cap=200), prompt_len=0)
    batches = [4, 8, 16, 32]
    best = L.sweep(s, batches)[0]
    brute = max(((n, b) for n in L.splits(s) for b in batches),
                key=lambda nb: L.simulate(s, *nb, steps=40, warmup=5).seqs_per_s)
    sim_best = L.simulate(s, *brute, steps=40, warmup=5).seqs_per_s
    assert L.simulate(s, best.n_sample, best.slots, steps=40, warmup=5).seqs_per_s == pytest.approx(sim_best,
                                                                                                      rel=0.01)
    assert best.n_sample == brute[0]


def test_latency_curve_file_and_model_dir(tmp_path):
    curve = {"machine": "m", "device": "d", "model": {}, "cache_len": 128,
             "points": [{"mode": "eager", "batch": 1, "step_time_s": 0.001},
                        {"mode": "eager", "batch": 8, "step_time_s": 0.002},
                        {"mode": "compile", "batch": 1, "step_time_s": 0.0005}]}
    path = tmp_path / "lat.json"
    path.write_text(json.dumps(curve))
    c = L.LatencyCurve.from_file(str(path), "eager")
    assert c(4.5) == pytest.approx(0.0015) and c(15) == pytest.approx(0.003)  # interpolated, extrapolated
    with pytest.raises(ValueError, match="no points for mode 'compile\\+cudagraphs'"):
        L.LatencyCurve.from_file(str(path), "compile+cudagraphs")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, torch_dtype="bfloat16")))
    m = L.Model.from_dir(str(tmp_path))
    assert m.params == pytest.approx(6.74e9, rel=0.01) and m.kv_heads == 32 and m.head_dim == 128  # Llama-2-7B


@pytest.mark.parametrize("change, match", [
    (dict(model=L.Model(70e9, 80, 8, 128)), "do not fit"),
    (dict(mode="pipelined", max_lag=0), "max_lag 0 with mode pipelined"),
    (dict(batch=10, group_size=4), "multiple of group_size"),
    (dict(mode="async"), "mode 'async'"),
    (dict(handoff_s=-0.1), "handoff_s -0.1: cannot be negative"),
])
def test_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        setup(**change)


def test_bad_input_batch_and_missing_field():
    with pytest.raises(ValueError, match="above the KV-cache cap 216"):
        L.predict(setup(), 4, 300)
    with pytest.raises(ValueError, match=r"missing gpu \(needed by the planner\): --gpu \(H100"):
        L.load_setup(dict(total_gpus=8, model=dict(params=7e9, layers=32, kv_heads=8, head_dim=128)))
    with pytest.raises(ValueError, match=r"model: missing \['kv_heads'\]"):
        L.load_setup(dict(total_gpus=8, gpu="H100", model=dict(params=7e9, layers=32, head_dim=128)))


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan_layout.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_compare_on_committed_metrics(tmp_path):
    """A measured async PPO run (4 collectors, max_lag 2, rollouts of 0.273 s, 13 ms per update) against the
    planner: one collector is a one-slot replica, a rollout a sequence of 2730 steps of 0.1 ms."""
    curve = tmp_path / "tick.json"
    curve.write_text(json.dumps({"points": [{"mode": "eager", "batch": 1, "step_time_s": 1e-4}]}))
    cfg = tmp_path / "ppo.yaml"
    cfg.write_text(f"total_gpus: 5\ngpu: CPU\nmodel: {{params: 10000, layers: 1, kv_heads: 1, head_dim: 1}}\n"
                   f"lengths: {{kind: constant, median: 2730, cap: 2730}}\nbatch: 1\nmax_lag: 2\n"
                   f"train_step_s: 0.013\npause_s: 0.0\nconsume: ticket\nlatency_curve: {curve}\n")
    out = run_cli("--config", str(cfg), "--compare", os.path.join(ROOT, "tests", "data",
                                                                  "layout_compare_metrics.jsonl"),
                  "--n-sample", "4", "--slots", "1", "--units-per-sequence", "256")
    assert out.returncode == 0, out.stderr
    lines = {line[:26].strip(): line[26:].split() for line in out.stdout.splitlines()[1:]}
    predicted, measured, err = lines["throughput (run units/s)"]
    # admission-bound: 3 tickets in flight per (0.273 + 0.013) s, 256 env steps each
    assert float(predicted) == pytest.approx(3 * 256 / 0.286, rel=1e-3)
    assert float(measured) == pytest.approx(2606.95, rel=1e-4)
    assert float(err.rstrip("%")) == pytest.approx((3 * 256 / 0.286 / 2606.95 - 1) * 100, abs=0.1)
    assert lines["lag mean"][:2] == ["2", "1.8"]


def test_cli_plan_and_errors(tmp_path):
    out = run_cli("--total-gpus", "4", "--gpu", "H100", "--params", "1e9", "--layers", "16", "--kv-heads", "8",
                  "--head-dim", "64", "--prompt-len", "128", "--length-median", "300", "--length-cap", "2000",
                  "--batch", "64", "--max-lag", "2", "--sim-steps", "30", "--top", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "best:" in out.stdout and os.path.isfile(tmp_path / "layout_plan.png")
    plan = json.load(open(tmp_path / "plan.json"))
    assert plan["best"]["seqs_per_s"] == plan["layouts"][0]["seqs_per_s"] > 0
    bad = run_cli("--total-gpus", "4", "--gpu", "H100", "--params", "1e9", "--layers", "16", "--kv-heads", "8",
                  "--head-dim", "64", "--mode", "pipelined", "--max-lag", "0")
    assert bad.returncode == 2 and "error: max_lag 0 with mode pipelined" in bad.stderr
    assert "Traceback" not in bad.stderr
    bare = run_cli("--gpu", "H100")  # everything else the planner needs is named in one message
    assert bare.returncode == 2 and "error: missing total_gpus, model (needed by the planner): --total-gpus N; " \
        "--model-dir DIR or --params" in bare.stderr, bare.stderr


def test_cli_names_a_missing_or_malformed_file(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    (tmp_path / "bad.jsonl").write_text('{"global_step": 1}\nnot json\n{"global_step": 2}\n')
    plan = ["--total-gpus", "4", "--gpu", "H100", "--params", "1e9", "--layers", "16", "--kv-heads", "8",
            "--head-dim", "64", "--no-simulate"]
    for flags, words in [(["--latency-curve", tmp_path / "none.json"], "latency curve '.*none.json': No such file"),
                         (["--latency-curve", tmp_path / "bad.json"], "latency curve '.*bad.json': not valid JSON"),
                         (["--config", tmp_path / "bad.yaml"], "--config '.*bad.yaml': not valid YAML"),
                         (["--config", tmp_path / "none.yaml"], "--config '.*none.yaml': No such file"),
                         (["--model-dir", tmp_path], "model dir '.*': no config.json there"),
                         (["--compare", tmp_path / "bad.jsonl", "--n-sample", "2", "--slots", "8"],
                          ".*bad.jsonl:2: not a metrics row"),
                         (["--lengths-from", tmp_path / "none.jsonl"], "metrics '.*none.jsonl': No such file")]:
        bad = run_cli(*plan, *map(str, flags))
        assert bad.returncode == 2 and re.match(f"error: {words}", bad.stderr), (flags, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
