"""Plot one metric of one or several runs' `metrics.jsonl` to a PNG. Runs of one experiment form one curve: the same
env_id and exp_name, and the same flags wherever a flag changes what a run computes (the learning rate, `--async`,
the horizon; not `--seed`, `--compile` or `--log-every`). Each run is drawn to its own end, thin; the curve's mean
over its runs, with their spread shaded, where all of them have data.

    python -m leanrl.plot runs/ --metric charts/episodic_return --out plot.png
    python -m leanrl.plot runs/ --group-by env_id exp_name --label "{exp_name}: {seeds} seeds" --out by_name.png
    python -m leanrl.plot runs/CartPole-v1__ppo__1__1700000000 runs/CartPole-v1__ppo__2__1700000100/metrics.jsonl \\
        --metric losses/value_loss --spread minmax --smooth 5 --out value_loss.png
"""

import difflib
import json
import os
import string
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import tyro

from leanrl.cli import UsageError, clean_exit, require_extra
from leanrl.config import computing_flags
from leanrl.metrics import read_metrics

IDENTITY = ("env_id", "exp_name", "seed")


@dataclass
class Series:
    """One run's metric against global_step, and the flags it ran with."""
    path: str
    config: dict
    """config.json's flags, with env_id, exp_name and seed (from the directory name where config.json lacks them)"""
    steps: np.ndarray
    values: np.ndarray

    @property
    def env_id(self) -> str:
        return self.config["env_id"]

    @property
    def exp_name(self) -> str:
        return self.config["exp_name"]

    @property
    def seed(self) -> int:
        return self.config["seed"]


@dataclass
class Curve:
    """One group of runs: each run (smoothed) to its own end, and their mean and spread on the steps where all of
    them have data (`steps` is empty when they share none)."""
    runs: list[Series]
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    label: str = ""

    @property
    def env_id(self) -> str:
        return self.runs[0].env_id

    @property
    def exp_name(self) -> str:
        return self.runs[0].exp_name

    @property
    def seeds(self) -> list[int]:
        """The distinct seeds of its runs."""
        return sorted({run.seed for run in self.runs})

    @property
    def mean_ends_early(self) -> bool:
        """Whether some run goes on past the steps the mean covers."""
        return len(self.runs) > 1 and (not self.steps.size or any(r.steps[-1] > self.steps[-1] for r in self.runs))


def find_metrics(path: str) -> list[str]:
    """The metrics.jsonl files a command-line path names: the file itself, a run's, or every run's under a folder."""
    if os.path.isfile(path):
        return [path]
    found = sorted(os.path.join(folder, "metrics.jsonl") for folder, _, files in os.walk(path)
                   if "metrics.jsonl" in files)
    if not found:
        raise UsageError(f"{path!r}: no metrics.jsonl found there" + ("" if os.path.exists(path) else
                                                                       " (no such file or directory)"))
    return found


def run_config(run_dir: str) -> dict:
    """The run's config.json, its env_id, exp_name and seed filled in from its directory name
    `<env>__<exp>__<seed>__<time>` where it lacks them (runs from before config.json; GRPO runs, which have a task,
    not an env_id)."""
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    parts = os.path.basename(run_dir).split("__")
    if len(parts) >= 4 and parts[-2].lstrip("-").isdigit():
        config = {"env_id": parts[0], "exp_name": "__".join(parts[1:-2]), "seed": parts[-2], **config}
    missing = [key for key in IDENTITY if key not in config]
    if missing:
        raise UsageError(f"{run_dir!r}: no {', '.join(missing)} in a config.json or in a directory name "
                         "<env>__<exp>__<seed>__<time>")
    return {**config, "seed": int(config["seed"])}


def run_identity(run_dir: str) -> tuple[str, str, int]:
    """(env_id, exp_name, seed) of a run directory, as `run_config` reads them."""
    config = run_config(run_dir)
    return tuple(config[key] for key in IDENTITY)


def read_series(metrics_path: str, metric: str) -> Series:
    """The run's `metric` against global_step (empty if it logged none)."""
    points = [(row["global_step"], row[metric]) for row in read_metrics(metrics_path) if metric in row]
    steps, values = np.array(points, dtype=float).reshape(-1, 2).T
    return Series(metrics_path, run_config(os.path.dirname(os.path.abspath(metrics_path))), steps, values)


def lacks(runs: list[Series], metric: str) -> str:
    """Why none of `runs` can be drawn: the metrics they did log, and the one that `metric` likely misspells."""
    present = sorted({key for run in runs for row in read_metrics(run.path) for key in row} - {"global_step"})
    guess = [key for key in present if key.endswith("/" + metric)] or difflib.get_close_matches(metric, present, 1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    where, whose = (f"{runs[0].path!r}: no row", "its") if len(runs) == 1 else (f"no row of {len(runs)} runs", "their")
    return f"{where} has {metric!r}{hint}; {whose} metrics: {', '.join(present) or 'none'}"


def smoothed(run: Series, window: int) -> Series:
    """Trailing moving average over `window` logged points (all of them if the run has fewer), each placed at the
    window's last step."""
    window = min(window, len(run.values))
    values = np.convolve(run.values, np.ones(window) / window, mode="valid")
    return Series(run.path, run.config, run.steps[window - 1:], values)


def curve(runs: list[Series], spread: str) -> Curve:
    """The runs' mean and spread on every step any of them logged within the range all of them cover (each run
    interpolated there: no extrapolation)."""
    first, last = max(r.steps[0] for r in runs), min(r.steps[-1] for r in runs)
    grid = np.unique(np.concatenate([r.steps[(r.steps >= first) & (r.steps <= last)] for r in runs]))
    on_grid = np.stack([np.interp(grid, r.steps, r.values) for r in runs])
    mean, std = on_grid.mean(0), on_grid.std(0)
    low, high = (mean - std, mean + std) if spread == "std" else (on_grid.min(0), on_grid.max(0))
    return Curve(runs, grid, mean, low, high)


def group_keys(runs: list[Series], group_by: list[str] | None) -> list[str]:
    """The flags that tell curves apart: `group_by` (checked against the runs' flags), or else env_id, exp_name and
    every flag that changes what a run computes."""
    known = {key for run in runs for key in run.config}
    if group_by is None:
        return ["env_id", "exp_name", *sorted(computing_flags(known) - set(IDENTITY))]
    for key in group_by:
        if key not in known:
            guess = difflib.get_close_matches(key, known, 1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise UsageError(f"--group-by {key}: no run has that flag{hint}; their flags: {', '.join(sorted(known))}")
    return list(group_by)


def seeds_text(c: Curve) -> str:
    n, runs = len(c.seeds), len(c.runs)
    seeds = f"{n} seed{'' if n == 1 else 's'}"
    return seeds if runs == n else f"{runs} runs of {seeds}"


def default_labels(curves: list[Curve], keys: list[str]) -> None:
    """`exp_name (env_id)`, the flags whose values tell this curve from the others of its experiment and env drawn
    with it (another experiment's are told apart by its name), and its seeds."""
    for c in curves:
        peers = [d for d in curves if (d.exp_name, d.env_id) == (c.exp_name, c.env_id)]
        differ = [k for k in keys if k not in ("env_id", "exp_name")
                  and len({repr(d.runs[0].config.get(k)) for d in peers}) > 1]
        flags = "".join(f", {k}={c.runs[0].config.get(k)}" for k in differ)
        c.label = f"{c.exp_name} ({c.env_id}){flags}, {seeds_text(c)}"


def format_labels(curves: list[Curve], label: str) -> None:
    """`--label`: a format string of a curve's flags, `{seeds}` (distinct seeds) and `{runs}`."""
    names = {name for _, name, _, _ in string.Formatter().parse(label) if name}
    for c in curves:
        values = {**c.runs[0].config, "seeds": len(c.seeds), "runs": len(c.runs)}
        unknown = sorted(names - set(values))
        if unknown:
            raise UsageError(f"--label {label!r}: no flag {', '.join(map(repr, unknown))} in {c.runs[0].path}; "
                             f"use {{seeds}}, {{runs}} or its flags: {', '.join(sorted(c.runs[0].config))}")
        c.label = label.format(**values)


def load_curves(paths: list[str], metric: str, spread: str = "std", smooth: int = 1,
                group_by: list[str] | None = None, label: str | None = None) -> list[Curve]:
    """One curve per group of the runs under `paths` (see the module's docstring; `group_by` names the flags that
    group them instead), in the order their groups are first found, labelled by `label` or by what tells them
    apart."""
    if not paths:
        raise UsageError("no runs given: pass run directories, folders of runs or metrics.jsonl files")
    if spread not in ("std", "minmax"):
        raise UsageError(f"spread={spread!r}: use 'std' or 'minmax'")
    if smooth < 1:
        raise UsageError(f"smooth={smooth}: a window of at least 1 logged point")
    files = list(dict.fromkeys(os.path.realpath(f) for path in paths for f in find_metrics(path)))
    runs, lacking, unnamed = [], [], []  # unnamed: why a run has no identity
    for f in files:
        try:
            run = read_series(f, metric)
        except UsageError as e:
            unnamed.append(str(e))
            continue
        (runs if run.values.size else lacking).append(run)
    for reason in unnamed:
        print(f"leanrl.plot: left out {reason}", file=sys.stderr)
    if not runs:
        raise UsageError(lacks(lacking, metric) if lacking else unnamed[0])
    if lacking:  # one line for them all: a sweep's runs without an evaluation would each list every metric
        experiments = Counter(f"{run.exp_name} ({run.env_id})" for run in lacking)
        print(f"leanrl.plot: left out {len(lacking)} run{'s' * (len(lacking) > 1)} that logged no {metric!r}: "
              + ", ".join(f"{n} of {experiment}" for experiment, n in experiments.items()), file=sys.stderr)
    keys = group_keys(runs, group_by)
    groups: dict[tuple, list[Series]] = {}
    for run in runs:
        # run names lose the '/' of env ids: a run without config.json still joins its experiment
        key = tuple(run.env_id.replace("/", "-") if k == "env_id" else repr(run.config.get(k)) for k in keys)
        groups.setdefault(key, []).append(smoothed(run, smooth))
    curves = [curve(group, spread) for group in groups.values()]
    if label is None:
        default_labels(curves, keys)
    else:
        format_labels(curves, label)
    return curves


def plot_runs(paths: list[str], metric: str, out: str, spread: str = "std", smooth: int = 1,
              group_by: list[str] | None = None, label: str | None = None) -> str:
    """Draw `metric` of the runs under `paths` (see `load_curves`) to the PNG `out`; returns `out`."""
    curves = load_curves(paths, metric, spread, smooth, group_by, label)
    require_extra("leanrl.plot", "matplotlib", "plots")
    from matplotlib.figure import Figure

    # the legend goes below the axes, a line per curve
    fig = Figure(figsize=(6, 4 + 0.22 * len(curves)))  # a bare Figure renders with Agg, pyplot's backend untouched
    ax = fig.subplots()
    for c in curves:
        if len(c.runs) == 1:
            ax.plot(c.runs[0].steps, c.runs[0].values, label=c.label)
            continue
        ends = f"; mean to step {c.steps[-1]:,.0f}" if c.mean_ends_early and c.steps.size else \
            "; no step common to all" if not c.steps.size else ""
        (line,) = ax.plot(c.steps, c.mean, label=c.label + ends)
        for run in c.runs:  # each to its own end
            ax.plot(run.steps, run.values, color=line.get_color(), alpha=0.35, linewidth=0.8)
        ax.fill_between(c.steps, c.low, c.high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set(xlabel="global_step", ylabel=metric, title=curves[0].label if len(curves) == 1 else metric)
    several = any(len(c.runs) > 1 for c in curves)
    title = f"mean ± {'std' if spread == 'std' else 'min–max'} where all runs have data; thin: each run"
    ax.legend(title=title if several else None, fontsize="small", title_fontsize="small", loc="upper center",
              bbox_to_anchor=(0.5, -0.14), frameon=False)
    ax.grid(alpha=0.3)
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")  # the image grows to hold the legend below the axes
    return out


@dataclass
class Args:
    paths: tyro.conf.Positional[list[str]]
    """run directories, folders of runs (e.g. runs/: every run under it) or metrics.jsonl files"""
    metric: str = "charts/episodic_return"
    """the metrics.jsonl key to plot against global_step"""
    out: str = "plot.png"
    """the PNG to write"""
    spread: Literal["std", "minmax"] = "std"
    """band over the runs of a curve: mean ± standard deviation, or min to max"""
    smooth: int = 1
    """moving average over this many logged points, per run before averaging (1: none)"""
    group_by: list[str] | None = field(default=None)
    """the flags (config.json's keys) whose values make a curve (default: env_id, exp_name and every flag that
    changes what a run computes)"""
    label: str | None = None
    """a curve's legend, formatted from its flags, `{seeds}` and `{runs}`, e.g. "{exp_name} lr={learning_rate}"
    (default: exp_name, env_id, the flags that tell the curves apart, the seeds)"""


if __name__ == "__main__":
    a = tyro.cli(Args, description=__doc__)
    with clean_exit():  # bad input (UsageError): its one-line message, no traceback
        print(plot_runs(a.paths, a.metric, a.out, a.spread, a.smooth, a.group_by, a.label))
