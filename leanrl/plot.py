"""Plot one metric of one or several runs' `metrics.jsonl` to a PNG. The seeds of one experiment (same env_id and
exp_name) form one curve: their mean against global_step, with the spread over seeds shaded.

    python -m leanrl.plot runs/ --metric charts/episodic_return --out plot.png
    python -m leanrl.plot runs/CartPole-v1__ppo__1__1700000000 runs/CartPole-v1__ppo__2__1700000100/metrics.jsonl \\
        --metric losses/value_loss --spread minmax --smooth 5 --out value_loss.png
"""

import difflib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro

from leanrl.cli import UsageError, clean_exit, require_extra
from leanrl.metrics import read_metrics


@dataclass
class Run:
    path: str
    env_id: str
    exp_name: str
    seed: int
    steps: np.ndarray
    values: np.ndarray


@dataclass
class Curve:
    """One experiment: its runs on a common step grid, their mean and the band of the spread."""
    env_id: str
    exp_name: str
    seeds: list[int]
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray

    @property
    def label(self) -> str:
        n = len(self.seeds)
        return f"{self.exp_name} ({self.env_id}), {n} seed{'' if n == 1 else 's'}"


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


def run_identity(run_dir: str) -> tuple[str, str, int]:
    """(env_id, exp_name, seed) from the run's config.json; its directory name `<env>__<exp>__<seed>__<time>` fills
    in what that lacks (runs from before config.json; GRPO runs, which have a task, not an env_id)."""
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    parts = os.path.basename(run_dir).split("__")
    if len(parts) >= 4 and parts[-2].lstrip("-").isdigit():
        config = {"env_id": parts[0], "exp_name": "__".join(parts[1:-2]), "seed": parts[-2], **config}
    missing = [key for key in ("env_id", "exp_name", "seed") if key not in config]
    if missing:
        raise UsageError(f"{run_dir!r}: no {', '.join(missing)} in a config.json or in a directory name "
                         "<env>__<exp>__<seed>__<time>")
    return config["env_id"], config["exp_name"], int(config["seed"])


def read_run(metrics_path: str, metric: str) -> Run:
    """The run's `metric` against global_step (empty if it logged none)."""
    points = [(row["global_step"], row[metric]) for row in read_metrics(metrics_path) if metric in row]
    steps, values = np.array(points, dtype=float).reshape(-1, 2).T
    return Run(metrics_path, *run_identity(os.path.dirname(os.path.abspath(metrics_path))), steps, values)


def lacks(runs: list[Run], metric: str) -> str:
    """Why none of `runs` can be drawn: the metrics they did log, and the one that `metric` likely misspells."""
    present = sorted({key for run in runs for row in read_metrics(run.path) for key in row} - {"global_step"})
    guess = [key for key in present if key.endswith("/" + metric)] or difflib.get_close_matches(metric, present, 1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    where, whose = (f"{runs[0].path!r}: no row", "its") if len(runs) == 1 else (f"no row of {len(runs)} runs", "their")
    return f"{where} has {metric!r}{hint}; {whose} metrics: {', '.join(present) or 'none'}"


def smoothed(run: Run, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Trailing moving average over `window` logged points (all of them if the run has fewer), each placed at the
    window's last step."""
    window = min(window, len(run.values))
    values = np.convolve(run.values, np.ones(window) / window, mode="valid")
    return run.steps[window - 1:], values


def curve(runs: list[Run], spread: str, smooth: int) -> Curve:
    series = [smoothed(run, smooth) for run in runs]
    first, last = max(s[0] for s, _ in series), min(s[-1] for s, _ in series)
    if first > last:
        raise UsageError(f"runs {[run.path for run in runs]} share no global_step range to average over")
    grid = np.unique(np.concatenate([s[(s >= first) & (s <= last)] for s, _ in series]))
    on_grid = np.stack([np.interp(grid, s, v) for s, v in series])
    mean, std = on_grid.mean(0), on_grid.std(0)
    low, high = (mean - std, mean + std) if spread == "std" else (on_grid.min(0), on_grid.max(0))
    return Curve(runs[0].env_id, runs[0].exp_name, [run.seed for run in runs], grid, mean, low, high)


def load_curves(paths: list[str], metric: str, spread: str = "std", smooth: int = 1) -> list[Curve]:
    """One curve per (env_id, exp_name) among the runs under `paths`, in the order they are first found."""
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
            run = read_run(f, metric)
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
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        # run names lose the '/' of env ids: a run without config.json still joins its experiment
        groups.setdefault((run.env_id.replace("/", "-"), run.exp_name), []).append(run)
    return [curve(group, spread, smooth) for group in groups.values()]


def plot_runs(paths: list[str], metric: str, out: str, spread: str = "std", smooth: int = 1) -> str:
    """Draw `metric` of the runs under `paths` (mean over seeds, `spread` shaded) to the PNG `out`; returns `out`."""
    curves = load_curves(paths, metric, spread, smooth)
    require_extra("leanrl.plot", "matplotlib", "plots")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))  # a bare Figure renders with Agg and leaves pyplot's backend alone
    ax = fig.subplots()
    for c in curves:
        (line,) = ax.plot(c.steps, c.mean, label=c.label)
        if len(c.seeds) > 1:
            ax.fill_between(c.steps, c.low, c.high, color=line.get_color(), alpha=0.25, linewidth=0)
    ax.set(xlabel="global_step", ylabel=metric, title=curves[0].label if len(curves) == 1 else metric)
    several_seeds = any(len(c.seeds) > 1 for c in curves)
    ax.legend(title=f"mean ± {'std' if spread == 'std' else 'min–max'} over seeds" if several_seeds else None,
              fontsize="small", title_fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100)
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
    """band over seeds: mean ± standard deviation, or min to max"""
    smooth: int = 1
    """moving average over this many logged points, per run before averaging (1: none)"""


if __name__ == "__main__":
    a = tyro.cli(Args, description=__doc__)
    with clean_exit():  # bad input (UsageError): its one-line message, no traceback
        print(plot_runs(a.paths, a.metric, a.out, a.spread, a.smooth))
