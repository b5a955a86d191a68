"""The benchmark harness, run as a user runs it (`benchmarks/run.py --quick`): valid JSON, markdown and PNG;
every figure positive and finite; modes the machine cannot run marked as such; the docs page's generator."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from leanrl import precompiled

pytestmark = pytest.mark.slow  # the benchmarks, run as a user runs them: minutes each

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("eager", "compile", "cudagraphs", "compile+cudagraphs")


def bench(*flags, script="run.py", env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *flags], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """CartPole in every mode, then Atari and the scaling curve eager into the same folder (an earlier run's
    entries are kept). One torch thread: on a shared 2-core machine two threads mostly wait for each other."""
    out = tmp_path_factory.mktemp("bench")
    first = bench("--quick", "--algos", "ppo_cartpole", "--threads", "1", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    second = bench("--quick", "--algos", "ppo_atari,cartpole_scaling", "--modes", "eager", "--threads", "1",
                   "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "kept from an earlier run" in second.stdout and "ppo_cartpole" in second.stdout
    assert "| ppo_atari" in second.stdout and "Targets:" in second.stdout  # the table printed at the end
    return out


def numbers(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def test_results_json_has_the_machine_and_every_mode(out):
    results = json.loads((out / "results.json").read_text())
    m = results["machine"]
    # the wheel's version: 2.11.0 for torch.__version__ 2.11.0+cu130
    assert m["cores"] >= 1 and m["cpu"] and torch.__version__.startswith(m["torch"])
    assert all(m[k] for k in ("tensordict", "torchrl", "python", "slug"))
    cartpole, atari = results["algos"]["ppo_cartpole"]["modes"], results["algos"]["ppo_atari"]["modes"]
    assert list(cartpole) == list(MODES) and list(atari) == ["eager"]
    for r in (cartpole["eager"], cartpole["compile"], atari["eager"]):
        assert r["status"] == "ok", r
        assert set(r["calls"]) == {"act", "update"} and r["sps"] > 0
        assert all(c["p25_ms"] <= c["median_ms"] <= c["p75_ms"] for c in r["calls"].values())
    assert "compile_s" in cartpole["compile"]["calls"]["update"]
    assert "compile_s" not in cartpole["eager"]["calls"]["update"]  # absent, not zero
    assert atari["eager"]["calls"]["update"]["input_shapes"][0][1:] == [4, 84, 84]
    assert {t["status"] for t in results["targets"]} <= {"pass", "fail", "n/a", "info"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run on this machine")
def test_cuda_graph_modes_are_marked_unavailable_without_cuda(out):
    modes = json.loads((out / "results.json").read_text())["algos"]["ppo_cartpole"]["modes"]
    for mode in ("cudagraphs", "compile+cudagraphs"):
        assert modes[mode]["status"] == "n/a" and "no CUDA" in modes[mode]["reason"]
        assert "sps" not in modes[mode] and "calls" not in modes[mode]
    table = (out / "ppo_cartpole.md").read_text()
    assert table.count("n/a (no CUDA)") >= 2 * 3  # two columns, every row


def test_every_number_is_positive_and_finite(out):
    bad = [(p, v) for p, v in numbers(json.loads((out / "results.json").read_text()))
           if not (math.isfinite(v) and v > 0)]
    assert not bad


def test_markdown_and_png_per_algorithm(out):
    for name in ("ppo_cartpole", "ppo_atari", "cartpole_scaling"):
        table = (out / f"{name}.md").read_text()
        assert table.startswith(f"| {name} ") and "env-steps/s" in table
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "`update` ms/call" in (out / "ppo_atari.md").read_text()
    points = json.loads((out / "results.json").read_text())["scaling"]["cartpole_scaling"]["modes"]["eager"]["points"]
    assert [p["num_envs"] for p in points] == [4, 32] and all(p["sps"] > 0 for p in points)
    summary = (out / "summary.md").read_text()
    assert "ppo_cartpole" in summary and "ppo_atari" in summary and "Targets:" in summary


def links(page) -> list[str]:
    """The targets of a markdown page's links, as written."""
    return re.findall(r"\]\(([^)\s]+)\)", page.read_text())


def test_docs_section_lists_each_machine_between_the_markers_only(out, tmp_path):
    results = json.loads((out / "results.json").read_text())
    for slug, quick in (("cpu-test", False), ("cpu-smoke", True)):  # the generator leaves smoke runs out
        (tmp_path / "results" / slug).mkdir(parents=True)
        (tmp_path / "results" / slug / "results.json").write_text(json.dumps({**results, "settings": {
            **results["settings"], "quick": quick}}))
        (tmp_path / "results" / slug / "summary.md").write_text((out / "summary.md").read_text())
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text("# title\n\n<!-- bench:start -->\nold table\n<!-- bench:end -->\n\nafter\n")
    proc = bench("--page", str(page), "--results", str(tmp_path / "results"), script="docs_tables.py")
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert text.startswith("# title\n\n<!-- bench:start -->\n- **cpu-test**: ")
    assert text.endswith("<!-- bench:end -->\n\nafter\n")
    assert "old table" not in text and "cpu-smoke" not in text
    # one line, its machine described and its summary linked; the tables stay in the summary, not on the page
    (line,) = [line for line in text.splitlines() if line.startswith("- ")]
    assert f"{results['machine']['cores']} cores" in line and f"commit {results['machine']['commit']}" in line
    assert links(page) == ["../results/cpu-test/summary.md"] and "| ppo_cartpole" not in text
    assert all((page.parent / target).is_file() for target in links(page))

    page.write_text("no markers\n")
    proc = bench("--page", str(page), "--results", str(tmp_path / "results"), script="docs_tables.py")
    assert proc.returncode != 0 and "bench:start" in proc.stderr and page.read_text() == "no markers\n"


def test_the_docs_page_lists_what_the_generator_makes_of_the_saved_results():
    """docs/performance.md's list is benchmarks/docs_tables.py's output for benchmarks/results (rerun it after a
    benchmark), one line per machine folder, and every link in it reaches a file."""
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'benchmarks'); import docs_tables; "
                           "print(docs_tables.section('benchmarks/results', 'docs'))"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    page = os.path.join(ROOT, "docs", "performance.md")
    listed = open(page).read().split("<!-- bench:start -->\n")[1].split("\n<!-- bench:end -->")[0]
    assert listed == proc.stdout.rstrip("\n"), "docs/performance.md is stale: run python benchmarks/docs_tables.py"
    results = os.path.join(ROOT, "benchmarks", "results")
    folders = [d for d in os.listdir(results) if os.path.isfile(os.path.join(results, d, "summary.md"))]
    assert folders and all(f"- **{d}**: [" in listed for d in folders)
    targets = re.findall(r"\]\(([^)\s]+)\)", listed)
    assert targets and all(os.path.isfile(os.path.join(ROOT, "docs", t)) for t in targets)


@pytest.mark.skipif(not precompiled.available(), reason="this torch cannot save compiled traces")
def test_a_warm_start_that_loads_its_trace_is_reported_as_such_not_as_eager(tmp_path):
    """DQN's update on a CPU under --compile is one graph whose trace a second run loads (leanrl.precompiled): no
    new graph, no inductor counter moves; the table said "kept eager here"."""
    rows = []
    for run in ("cold", "warm"):
        proc = bench("--quick", "--algos", "dqn_cartpole", "--modes", "compile", "--threads", "1", "--out",
                     str(tmp_path / run), env=dict(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")))
        assert proc.returncode == 0, proc.stderr[-3000:]
        update = json.loads((tmp_path / run / "results.json").read_text())["algos"]["dqn_cartpole"]["modes"][
            "compile"]["calls"]["update"]
        assert "kept_eager" not in update and update["compile_s"] > 0
        rows.append(update["inductor_cache"])
    assert rows == ["cold", "trace loaded"]
    table = (tmp_path / "warm" / "dqn_cartpole.md").read_text()
    assert "(trace loaded)" in table and "update kept eager" not in table


def test_entries_of_another_host_with_the_same_cpu_name_are_not_mixed_into_one_table(out, tmp_path, monkeypatch):
    """Two VMs that both report "AMD EPYC" share a results folder; the second kept the first's entries beside its
    own under one machine line. The CPU's details (family, model, L3, clock) now tell them apart."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    results = json.loads((out / "results.json").read_text())
    here = results["machine"]
    if not here["cpu_details"]:
        pytest.skip("no /proc/cpuinfo here: this host's CPU details are unknown")
    assert f"({here['cpu_details']})" in (out / "summary.md").read_text()
    for host, details in (("same", here["cpu_details"]), ("other", "family 6 model 85 stepping 7, L3 33792K"),
                          ("unrecorded", None)):
        (tmp_path / host).mkdir()
        saved = {**results, "machine": {**here, "cpu_details": details}}
        (tmp_path / host / "results.json").write_text(json.dumps(saved))
        kept = run.previous(str(tmp_path / host), here, quick=True)["algos"]
        assert list(kept) == (list(results["algos"]) if host == "same" else []), host


def test_unknown_entry_fails_before_measuring():
    proc = bench("--quick", "--algos", "ppo_cartpole,ppo_nope")
    assert proc.returncode != 0 and "unknown entry 'ppo_nope'" in proc.stderr


def test_async_vs_sync_writes_its_table_plot_and_docs_link(out, tmp_path):
    proc = bench("--total-timesteps", "1536", "--seeds", "1", "2", "--transports", "threads", "--num-collectors", "2",
                 "--max-lag", "1", "--median-ms", "0.2", "--out-dir", str(tmp_path / "results"),
                 "--machine", "cpu-test", script="async_vs_sync.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "results" / "cpu-test"
    saved = json.loads((folder / "async_vs_sync.json").read_text())
    variants = ["sync", "async-threads", "control: async-processes, max_lag 0"]
    assert list(saved["runs"]) == variants and all(len(saved["runs"][v]) == 2 for v in variants)
    assert saved["summary"]["async-threads"]["lag_max"] <= 1 and saved["summary"][variants[2]]["lag_max"] == 0
    assert all(math.isfinite(x) and x > 0 for v in variants for k, x in saved["summary"][v].items()
               if k in ("env_steps_per_s", "return_mean"))
    assert f"| | {' | '.join(variants)} |" in (folder / "async_vs_sync.md").read_text()
    assert (folder / "async_vs_sync.png").stat().st_size > 0

    results = json.loads((out / "results.json").read_text())
    results["settings"]["quick"] = False
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "summary.md").write_text((out / "summary.md").read_text())
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text("<!-- bench:start -->\n<!-- bench:end -->\n")
    proc = bench("--page", str(page), "--results", str(tmp_path / "results"), script="docs_tables.py")
    assert proc.returncode == 0, proc.stderr
    assert links(page) == ["../results/cpu-test/summary.md", "../results/cpu-test/async_vs_sync.md"]
    assert "| | sync |" not in page.read_text()  # linked, not pasted


def test_cpu_speed_times_whole_runs_against_the_reference_and_reaches_the_docs(tmp_path):
    """benchmarks/cpu_speed.py at a smoke size: the CleanRL-style reference and leanrl eager, each a process of its
    own, in two turns; a row per run with its speed-up over the reference and every turn's wall time; the table linked
    from the machine's line in docs/performance.md."""
    folder = tmp_path / "results" / "cpu-test"
    proc = bench("--envs", "2", "--total-timesteps", "1024", "--runs", "reference,eager", "--repeats", "2",
                 "--out", str(folder), script="cpu_speed.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((folder / "cpu_speed.json").read_text())["envs"]["2"]
    assert list(runs) == ["reference", "eager"]
    for r in runs.values():
        assert r["status"] == "ok" and 0 < r["startup_s"] < r["wall_s"] and r["sps"] > 0
        assert len(r["every_wall_s"]) == 2 and min(r["every_wall_s"]) <= r["wall_s"] <= max(r["every_wall_s"])
    assert "| 2 | reference |" in proc.stdout and "| 1.00x |" in proc.stdout and "| 2 | eager |" in proc.stdout
    bad = bench("--runs", "eager,fastest", script="cpu_speed.py")
    assert bad.returncode == 2 and "unknown fastest" in bad.stderr
    page = tmp_path / "docs" / "performance.md"
    page.parent.mkdir()
    page.write_text("<!-- bench:start -->\n<!-- bench:end -->\n")
    proc = bench("--page", str(page), "--results", str(tmp_path / "results"), script="docs_tables.py")
    assert proc.returncode == 0, proc.stderr
    assert page.read_text().startswith("<!-- bench:start -->\n- **cpu-test**: ")  # a machine with cpu_speed.py only
    assert links(page) == ["../results/cpu-test/cpu_speed.md"] and "PPO CartPole, 1,024 steps" not in page.read_text()


def test_grpo_layout_validation_runs_sync_and_async_against_the_planner():
    """`layout_validation_grpo.py --quick`: a sync and an async GRPO run, each next to the planner's prediction
    from its calibration; the async collector restarts few sequences (its admission waits for a recent version,
    where it used to restart about half of each batch: 70 of 128). How few depends on the machine's load: 0 in the
    committed runs, 0-17 per setting in e83c28e's, 8 on a CI machine running the suite."""
    run = bench("--quick", script="layout_validation_grpo.py")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.strip().splitlines()[-1].removeprefix("written to ")
    info = json.loads(open(os.path.join(out, "layout_validation_grpo.json")).read())
    sync, pipelined = info["results"]
    assert sync["mode"] == "sync" and sync["measured_lag"] == 0 == sync["restarted_per_batch"]
    assert pipelined["mode"] == "pipelined" and 0 < pipelined["measured_lag"] <= pipelined["max_lag"]
    assert pipelined["restarted_per_batch"] < 32  # of 128 sequences per batch
    for r in (sync, pipelined):
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("measured_sps", "model_sps", "sim_sps", "train_s",
                                                              "run_mean_length", "in_run_sps"))


def test_ppo_layout_validation_measures_the_handoff_and_runs_against_the_planner():
    """`layout_validation.py --quick`: the handoff from its own alternating run, then one async PPO setting next to
    the closed form (with and without the handoff) and the simulator."""
    run = bench("--quick", script="layout_validation.py")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.strip().splitlines()[-1].removeprefix("written to ")
    info = json.loads(open(os.path.join(out, "layout_validation.json")).read())
    assert 0 <= info["handoff_s"] < 0.2
    (r,) = info["results"]
    assert r["bound"] == "admission" and 0 < r["measured_lag"] <= r["max_lag"] == 1
    # the handoff only lengthens the admission loop: never a higher prediction than without it
    assert r["model_sps"] <= r["model_h0_sps"]
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("measured_sps", "model_sps", "sim_sps", "train_s"))


def test_learning_parity_tables_the_runs_and_finds_them_again(tmp_path):
    """Two seeds of PPO CartPole (100k steps each): each run's final return is the mean of its logged returns over
    the last tenth of its steps, read here straight from metrics.jsonl; the table names the commit; a second call
    finds the finished runs instead of running them again."""
    flags = ("--tasks", "ppo_cartpole", "--seeds", "1", "2", "--runs", str(tmp_path / "runs"), "--out",
             str(tmp_path / "out"))
    first = bench(*flags, script="learning_parity.py")
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "learning_parity.json").read_text())
    task = result["tasks"]["ppo_cartpole"]
    assert task["seeds"] == [1, 2] and task["commit"] == result["machine"]["commit"]
    for run in task["runs"]:
        with open(os.path.join(run["run_dir"], "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        last = [r["charts/episodic_return"] for r in rows if "charts/episodic_return" in r
                and r["global_step"] > 90_000]
        assert last and run["final_return"] == pytest.approx(sum(last) / len(last))
    table = (tmp_path / "out" / "learning_parity.md").read_text()
    assert "| commit |" in table and f"| {result['machine']['commit']}, " in table
    assert (tmp_path / "out" / "learning_parity_ppo_cartpole.png").stat().st_size > 10_000
    again = bench(*flags, script="learning_parity.py")
    assert again.returncode == 0 and "ppo_cartpole seed 1:" not in again.stderr, again.stderr[-2000:]


def test_step_costs_splits_an_env_step_without_counting_time_twice(tmp_path):
    """DQN and PPO CartPole, eager and compiled: a row per (entry, mode) with its call count, and the env and
    accelerated time within the step's wall time, the rest never negative (a timed call inside another counts
    once)."""
    run = bench("--algos", "dqn_cartpole,ppo_cartpole", "--modes", "eager,compile", "--steps", "512", "--out",
                str(tmp_path), script="step_costs.py")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "step_costs.json").read_text())
    rows = [(name, mode, r) for name, modes in result["entries"].items() for mode, r in modes.items()]
    assert {(name, mode) for name, mode, _ in rows} == {(n, m) for n in ("dqn_cartpole", "ppo_cartpole")
                                                        for m in ("eager", "compile")}
    for name, mode, r in rows:
        assert r["status"] == "ok" and r["calls"] > 10, (name, mode, r)
        assert r["env_ms"] >= 0 and r["accelerated_ms"] > 0 and r["other_ms"] >= 0, (name, mode, r)
    table = (tmp_path / "step_costs.md").read_text()
    assert f"tensordict {result['machine']['tensordict']}" in table and "| dqn_cartpole | compile | 1 | 1 |" in table
