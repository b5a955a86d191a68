"""Sync-free metrics: tensors stay on the device and reach the host once per log boundary."""

import json
import math
import os
import statistics
import time
from collections import deque

import torch
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from leanrl.graph_threads import sync_cuda
from leanrl.graphs import WARMUP
from leanrl.cli import signals_deferred
from leanrl.config import config_of

SUMMARY_WINDOW = 10  # logged values of the return metric the summary averages: one value alone is noisy


class Logger:
    """Collects episode statistics and losses as device tensors; `flush` reads them in one transfer
    and writes them to a tqdm bar, `metrics.jsonl` and TensorBoard event files in the run directory (CleanRL's
    `tensorboard --logdir runs` works), and wandb when tracked. The run's flags go to `config.json` beside them.

    SPS is counted only after `burn_in` iterations (`leanrl.WARMUP` by default), so compile and capture time never
    dilute it; that time is reported on its own as `perf/warmup_time`.

    On close (a `with` block's end, normal or interrupted) it prints the run's summary to stdout: run directory,
    steps, wall time, SPS, the last value of `return_metric`, its mean over the last `SUMMARY_WINDOW` logs and its
    best, the last evaluation (`charts/eval_*`) when the run evaluated, and `checkpoint` when given.
    """

    def __init__(self, run_dir, config: dict, total_steps: int, *, track=False, wandb_mode="offline",
                 wandb_project="leanrl", wandb_entity=None, run_name=None, burn_in: int = WARMUP, start_step: int = 0,
                 progress=True, checkpoint: str | None = None, return_metric: str = "charts/episodic_return",
                 summary: bool = True, unit: str = "step", device="cpu"):
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir, self.total_steps, self.checkpoint = run_dir, total_steps, checkpoint
        self.return_metric, self.best_return, self.summary, self.unit = return_metric, None, summary, unit
        self.recent_returns = deque(maxlen=SUMMARY_WINDOW)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=1, default=str)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.tensorboard = SummaryWriter(run_dir)
        self.tensorboard.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in config.items()))
        self.burn_in = burn_in
        self.iterations = 0
        self.t_start = time.perf_counter()
        self.t_steady = self.step_steady = None
        self.warmup_time = None
        self.pending: dict[str, torch.Tensor] = {}
        # (return sum, length sum, count) of the episodes ended since the last flush, on the run's device: added to
        # in place, also from inside a captured graph
        self.episode_sums = torch.zeros(3, device=device)
        self.last = {}
        self.pbar = tqdm(total=total_steps, initial=start_step, unit=unit, dynamic_ncols=True,
                         disable=not progress, mininterval=1.0)
        self.step = start_step
        self.wandb = None
        if track:
            import wandb
            self.wandb = wandb.init(project=wandb_project, entity=wandb_entity, name=run_name, config=config,
                                    dir=run_dir, mode=wandb_mode, resume="allow")

    @classmethod
    def from_args(cls, args, run_dir: str, total_steps: int, start_step: int = 0, **kwargs) -> "Logger":
        """A Logger configured by a run's `RunArgs` fields (tracking, progress bar), its config the args (see
        `leanrl.config.config_of`)."""
        return cls(run_dir, config_of(args), total_steps, track=args.track, wandb_mode=args.wandb_mode,
                   wandb_project=args.wandb_project_name, wandb_entity=args.wandb_entity,
                   run_name=os.path.basename(os.path.normpath(run_dir)), start_step=start_step,
                   progress=args.progress, **kwargs)

    def record_episodes(self, episode_return: torch.Tensor, episode_length: torch.Tensor):
        """Accumulate the episodes that ended, on the device: safe inside the hot loop, and inside a compiled or
        captured function. An env reports an episode where it ends, with its length (> 0) and return, and 0
        elsewhere: that, not `terminated | truncated`, says where an episode ended (with Atari's episodic life a
        lost life is `terminated` while the game goes on)."""
        d = (episode_length > 0).float()
        self.episode_sums.add_(torch.stack([(episode_return * d).sum(), (episode_length * d).sum(), d.sum()]))

    def record(self, metrics: dict):
        """Keep the latest value of each metric (tensors are detached, not read)."""
        for k, v in metrics.items():
            self.pending[k] = v.detach() if isinstance(v, torch.Tensor) else torch.as_tensor(float(v))

    def end_iteration(self, global_step: int):
        """Mark an iteration boundary; starts the SPS clock after burn-in."""
        self.iterations += 1
        self.step = global_step
        if self.iterations == self.burn_in:
            sync_cuda()
            self.t_steady, self.step_steady = time.perf_counter(), global_step
            self.warmup_time = self.t_steady - self.t_start

    @property
    def sps(self):
        if self.t_steady is None or self.step == self.step_steady:
            return None
        return (self.step - self.step_steady) / (time.perf_counter() - self.t_steady)

    def flush(self):
        """The log boundary: one device-to-host transfer for everything recorded since the last flush. A Ctrl-C or
        SIGTERM waits until the row is written (see `signals_deferred`)."""
        with signals_deferred():
            return self._flush()

    def _flush(self):
        names = list(self.pending)
        device = self.episode_sums.device
        tensors = [self.pending[k].float().reshape(()).to(device) for k in names] + list(self.episode_sums)
        values = torch.stack(tensors).cpu().tolist()  # the one read
        row = dict(zip(names, values))
        ret, length, count = values[-3:]
        if count > 0:
            row["charts/episodic_return"] = ret / count
            row["charts/episodic_length"] = length / count
        self.episode_sums.zero_()
        self.pending.clear()
        bad = [k for k, v in row.items() if k.startswith("losses/") and not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"non-finite {', '.join(bad)} at step {self.step}: "
                                     f"{ {k: row[k] for k in bad} }. Lower the learning rate or check the inputs.")
        sps = self.sps
        if sps is not None:
            row["charts/SPS"] = sps
        if self.warmup_time is not None:
            row["perf/warmup_time"] = self.warmup_time
        self.last.update(row)
        if self.return_metric in row:
            self.best_return = max(row[self.return_metric], self.best_return or -math.inf)
            self.recent_returns.append(row[self.return_metric])
        self.jsonl.write(json.dumps({"global_step": self.step, **row}) + "\n")
        self.jsonl.flush()
        # One event for the row, not an add_scalar per metric (an order of magnitude less host time for a row of
        # dozens of metrics); TensorBoard reads the same scalars either way.
        self.tensorboard.file_writer.add_summary(
            Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in row.items()]), self.step)
        if self.wandb is not None:
            self.wandb.log(row, step=self.step)
        self.pbar.n = self.step
        postfix = {}
        if "charts/SPS" in self.last:
            postfix["SPS" if self.unit == "step" else f"{self.unit}s/s"] = f"{self.last['charts/SPS']:.0f}"
        if "charts/episodic_return" in self.last:
            postfix["return"] = f"{self.last['charts/episodic_return']:.1f}"
        self.pbar.set_postfix(postfix, refresh=True)
        return row

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(stopped_by=None if exc_type is None else
                   "an interrupt" if issubclass(exc_type, KeyboardInterrupt) else f"an error ({exc_type.__name__})")

    def close(self, stopped_by: str | None = None):
        with signals_deferred():
            self._close(stopped_by)

    def _close(self, stopped_by: str | None = None):
        self.pbar.close()
        self.jsonl.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.summary:
            print(self.summary_text(stopped_by), flush=True)

    def summary_text(self, stopped_by: str | None = None) -> str:
        """The end-of-run summary; `stopped_by` says what ended a run before its last step."""
        wall = time.perf_counter() - self.t_start
        unit = self.unit
        ended = f"stopped by {stopped_by} at {unit} {self.step:,}" if stopped_by else f"{self.step:,} {unit}s"
        sps = self.last.get("charts/SPS")
        rate = "SPS" if unit == "step" else f"{unit}s/s"
        speed = f", {sps:,.0f} {rate} after {self.warmup_time:.1f} s warm-up" if sps and self.warmup_time else ""
        lines = [f"run:        {self.run_dir}",
                 f"{unit + 's:':<12}{ended} of {self.total_steps:,} in {wall:.1f} s{speed}"]
        if self.best_return is None:
            lines.append(f"return:     none logged ({self.return_metric})")
        else:
            n = len(self.recent_returns)
            recent = f" ({statistics.fmean(self.recent_returns):.2f} over the last {n} logs)" if n > 1 else ""
            lines.append(f"return:     last {self.recent_returns[-1]:.2f}{recent}, best {self.best_return:.2f} "
                         f"({self.return_metric})")
        lines += [f"eval:       last {self.last[k]:.2f} ({k})" for k in sorted(self.last)
                  if k.startswith("charts/eval_")]
        if self.checkpoint:
            lines.append(f"checkpoint: {self.checkpoint}")
        return "\n".join(lines)



#END
