"""leanrl.plot on synthetic runs: grouping by experiment, the mean and spread on the common step grid against
hand-computed values, smoothing, resumed runs, the PNG, the command line, and the errors."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from leanrl import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "charts/episodic_return"


def write_run(root, name, rows, config=None):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    """Experiment `a` on toy/Env-v0: seed 1 logs return = step, seed 2 (no config.json: named only) 2 * step, on
    different steps, some rows without a return. Experiment `b`: one seed."""
    root = tmp_path / "runs"
    write_run(root, "toy-Env-v0__a__1__1700000000",
              [{"global_step": 0, METRIC: 0.0}, {"global_step": 5, "losses/x": 1.0}, {"global_step": 10, METRIC: 10.0},
               {"global_step": 20, METRIC: 20.0}, {"global_step": 30, METRIC: 30.0}],
              {"env_id": "toy/Env-v0", "exp_name": "a", "seed": 1})
    write_run(root, "toy-Env-v0__a__2__1700000100",
              [{"global_step": 5, METRIC: 10.0}, {"global_step": 15, METRIC: 30.0},
               {"global_step": 25, "losses/x": 2.0}, {"global_step": 35, METRIC: 70.0}])
    write_run(root, "toy-Env-v0__b__7__1700000200",
              [{"global_step": 0, METRIC: 1.0}, {"global_step": 10, "losses/x": 0.5}, {"global_step": 20, METRIC: 3.0}],
              {"env_id": "toy/Env-v0", "exp_name": "b", "seed": 7})
    return root


def test_groups_seeds_and_averages_on_the_common_grid(runs):
    a, b = plot.load_curves([str(runs)], METRIC)
    assert (a.exp_name, a.env_id, a.seeds) == ("a", "toy/Env-v0", [1, 2])
    assert a.label == "a (toy/Env-v0), 2 seeds"
    # the steps where both have a return, within [5, 30] where both have data: no extrapolation
    np.testing.assert_array_equal(a.steps, [5, 10, 15, 20, 30])
    np.testing.assert_allclose(a.mean, 1.5 * a.steps)  # (step + 2 step) / 2
    np.testing.assert_allclose(a.high - a.mean, 0.5 * a.steps)  # std of {step, 2 step}
    np.testing.assert_allclose(a.mean - a.low, 0.5 * a.steps)
    assert (b.exp_name, b.seeds, b.label) == ("b", [7], "b (toy/Env-v0), 1 seed")
    np.testing.assert_array_equal(b.steps, [0, 20])
    np.testing.assert_array_equal(b.mean, [1, 3])
    np.testing.assert_array_equal(b.low, b.mean)  # one seed: no band
    np.testing.assert_array_equal(b.high, b.mean)


def test_minmax_spread_smoothing_and_single_paths(runs):
    (a,) = plot.load_curves([str(runs / "toy-Env-v0__a__1__1700000000"),
                             str(runs / "toy-Env-v0__a__2__1700000100" / "metrics.jsonl")], METRIC, spread="minmax")
    np.testing.assert_allclose(a.low, a.steps)
    np.testing.assert_allclose(a.high, 2 * a.steps)
    (one,) = plot.load_curves([str(runs / "toy-Env-v0__a__1__1700000000")], METRIC, smooth=2)
    np.testing.assert_array_equal(one.steps, [10, 20, 30])  # trailing window: placed at its last step
    np.testing.assert_allclose(one.mean, [5, 15, 25])


def test_the_same_run_named_twice_counts_once(runs):
    a, _ = plot.load_curves([str(runs), str(runs / "toy-Env-v0__a__1__1700000000")], METRIC)
    assert a.seeds == [1, 2]


def test_a_resumed_run_keeps_the_rows_logged_after_the_resume(tmp_path):
    write_run(tmp_path, "toy-Env-v0__a__1__1700000000",
              [{"global_step": s, METRIC: v}
               for s, v in [(0, 0.0), (10, 1.0), (20, 2.0), (10, 5.0), (20, 6.0), (30, 7.0)]])
    (a,) = plot.load_curves([str(tmp_path)], METRIC)
    np.testing.assert_array_equal(a.steps, [0, 10, 20, 30])
    np.testing.assert_array_equal(a.mean, [0, 5, 6, 7])


def test_a_final_evaluation_row_at_the_last_step_keeps_that_steps_return(tmp_path):
    write_run(tmp_path, "toy-Env-v0__a__1__1700000000",
              [{"global_step": 10, METRIC: 1.0}, {"global_step": 20, METRIC: 2.0},
               {"global_step": 20, "charts/eval_return": 9.0}])
    (a,) = plot.load_curves([str(tmp_path)], METRIC)
    np.testing.assert_array_equal(a.steps, [10, 20])


def test_a_folder_with_a_run_that_cannot_be_drawn_draws_the_others_and_says_so(runs, capsys):
    write_run(runs, "toy-Env-v0__a__3__1700000300", [{"global_step": 0, "losses/x": 1.0}])
    write_run(runs, "toy-Env-v0__a__4__1700000400", [{"global_step": 0, "losses/x": 1.0}])
    write_run(runs, "toy-Env-v0__c__1__1700000500", [{"global_step": 0, "losses/z": 1.0}])
    write_run(runs, "my_run", [{"global_step": 0, METRIC: 1.0}])
    a, b = plot.load_curves([str(runs)], METRIC)
    assert a.seeds == [1, 2] and b.seeds == [7]
    # a run that has no identity on a line of its own; the runs without the metric in one line, by experiment
    assert re.fullmatch(r"leanrl.plot: left out '.*my_run': no env_id, exp_name, seed in a config.json .*\n"
                        r"leanrl.plot: left out 3 runs that logged no 'charts/episodic_return': "
                        r"2 of a \(toy-Env-v0\), 1 of c \(toy-Env-v0\)\n",
                        capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"no row of 6 runs has 'losses/xx' \(did you mean 'losses/x'\?\); their "
                                         r"metrics: charts/episodic_return, losses/x, losses/z$"):
        plot.load_curves([str(runs)], "losses/xx")


def test_plot_runs_writes_a_png(runs, tmp_path):
    import matplotlib.image

    out = tmp_path / "sub" / "plot.png"
    assert plot.plot_runs([str(runs)], METRIC, str(out), spread="minmax", smooth=2) == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[1] > 400 and image.shape[0] > 400  # 6 inches at 100 dpi cropped to what is drawn, the legend
    assert image[..., :3].std() > 0.05  # something was drawn on the white


def test_command_line(runs, tmp_path):
    out = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, "-m", "leanrl.plot", str(runs), "--metric", METRIC, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "leanrl.plot", str(runs), "--metric", "losses/y"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "no row of 3 runs has 'losses/y'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_errors_name_the_input(runs, tmp_path):
    with pytest.raises(ValueError, match="no runs given"):
        plot.load_curves([], METRIC)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty'?: no metrics.jsonl found"):
        plot.load_curves([str(tmp_path / "empty")], METRIC)
    with pytest.raises(ValueError, match="no metrics.jsonl found there \\(no such file or directory\\)"):
        plot.load_curves([str(tmp_path / "missing")], METRIC)
    with pytest.raises(ValueError, match=r"a__1__1700000000/metrics.jsonl'?: no row has 'perf/y'; its metrics: "
                                         r"charts/episodic_return, losses/x$"):
        plot.load_curves([str(runs / "toy-Env-v0__a__1__1700000000")], "perf/y")
    for typo in ("episodic_return", "charts/episodic_retrun"):
        with pytest.raises(ValueError, match=f"no row has '{typo}' \\(did you mean 'charts/episodic_return'\\?\\)"):
            plot.load_curves([str(runs / "toy-Env-v0__a__1__1700000000")], typo)
    write_run(tmp_path, "my_run", [{"global_step": 0, METRIC: 1.0}])
    with pytest.raises(ValueError, match="my_run'?: no env_id, exp_name, seed in a config.json"):
        plot.load_curves([str(tmp_path / "my_run")], METRIC)


def test_missing_matplotlib_says_how_to_install(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ImportError, match=r"^leanrl.plot needs matplotlib: pip install 'leanrl\[plots\]'$"):
        plot.plot_runs([str(runs)], METRIC, str(tmp_path / "plot.png"))


def flags(seed, **kw):
    return {"env_id": "toy/Env-v0", "exp_name": "a", "seed": seed, "learning_rate": 1e-3, "async_": False,
            "total_timesteps": 30, "compile": False, "log_every": 1, **kw}


def test_a_curve_counts_distinct_seeds_and_its_flags_make_it(tmp_path):
    """Three runs of seed 1 are not three seeds; a flag that changes what a run computes (the learning rate,
    --async) makes another curve, named by it; one that does not (--compile, --log-every) does not."""
    rows = [{"global_step": s, METRIC: float(s)} for s in (10, 20, 30)]
    for i in range(3):
        write_run(tmp_path, f"toy-Env-v0__a__1__{1700000000 + i}", rows, flags(1, compile=i == 1, log_every=1 + i))
    write_run(tmp_path, "toy-Env-v0__a__2__1700000010", rows, flags(2, learning_rate=3e-4))
    write_run(tmp_path, "toy-Env-v0__a__3__1700000020", rows, flags(3, async_=True))
    same, lr, asynchronous = plot.load_curves([str(tmp_path)], METRIC)
    assert (len(same.runs), same.seeds) == (3, [1])
    assert same.label == "a (toy/Env-v0), async_=False, learning_rate=0.001, 3 runs of 1 seed"
    assert lr.label == "a (toy/Env-v0), async_=False, learning_rate=0.0003, 1 seed"
    assert asynchronous.label == "a (toy/Env-v0), async_=True, learning_rate=0.001, 1 seed"
    # another experiment in the same plot is told apart by its name: neither its flags nor theirs join the labels
    write_run(tmp_path, "toy-Env-v0__b__1__1700000030", rows, flags(1, exp_name="b", learning_rate=0.1))
    *_, other = plot.load_curves([str(tmp_path)], METRIC)
    assert other.label == "b (toy/Env-v0), 1 seed"


def test_each_run_keeps_its_end_and_the_mean_says_where_it_stops(tmp_path):
    """An interrupted run does not cut the others: each run is drawn to its own end, the mean covers the steps
    where all of them have data, and the legend says so."""
    write_run(tmp_path, "toy-Env-v0__a__1__1700000000", [{"global_step": s, METRIC: 1.0} for s in (10, 20)],
              flags(1))
    for seed in (2, 3):
        write_run(tmp_path, f"toy-Env-v0__a__{seed}__1700000000",
                  [{"global_step": s, METRIC: float(seed)} for s in (10, 20, 30, 40)], flags(seed))
    (c,) = plot.load_curves([str(tmp_path)], METRIC)
    assert [r.steps[-1] for r in c.runs] == [20, 40, 40] and c.seeds == [1, 2, 3]
    np.testing.assert_array_equal(c.steps, [10, 20])
    np.testing.assert_allclose(c.mean, [2, 2])
    assert c.mean_ends_early


def test_group_by_and_label_are_the_users(tmp_path):
    rows = [{"global_step": s, METRIC: float(s)} for s in (10, 20)]
    write_run(tmp_path, "toy-Env-v0__a__1__1700000000", rows, flags(1))
    write_run(tmp_path, "toy-Env-v0__a__2__1700000000", rows, flags(2, learning_rate=3e-4))
    (c,) = plot.load_curves([str(tmp_path)], METRIC, group_by=["env_id", "exp_name"],
                            label="{exp_name}: {seeds} seeds, {runs} runs")
    assert (c.label, c.seeds) == ("a: 2 seeds, 2 runs", [1, 2])
    lr, _ = plot.load_curves([str(tmp_path)], METRIC, label="lr={learning_rate}")
    assert lr.label == "lr=0.001"
    with pytest.raises(ValueError, match=r"^--group-by learning_rat: no run has that flag \(did you mean "
                                         r"'learning_rate'\?\); their flags: async_, compile, env_id, "):
        plot.load_curves([str(tmp_path)], METRIC, group_by=["learning_rat"])
    with pytest.raises(ValueError, match=r"^--label '\{lr\}': no flag 'lr' in .*; use \{seeds\}, \{runs\} or its "
                                         r"flags: async_, compile, "):
        plot.load_curves([str(tmp_path)], METRIC, label="{lr}")
