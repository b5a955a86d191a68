"""leanrl.logger and leanrl.metrics: metrics recorded on the device and read at a log boundary, CleanRL's keys, the
run summary, wandb offline; metrics.jsonl read back as the run stands."""

import json
import os

import pytest
import torch

import leanrl


def test_logger_reads_device_metrics_at_flush_with_cleanrl_keys(tmp_path):
    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=100, burn_in=1, progress=False)
    # an env reports an ended episode by its length; 0 elsewhere (a lost Atari life is terminated, no episode)
    logger.record_episodes(torch.tensor([10.0, 0.0, 20.0]), torch.tensor([5, 0, 7]))
    logger.record_episodes(torch.tensor([0.0, 30.0, 0.0]), torch.tensor([0, 3, 0]))
    logger.record({"losses/value_loss": torch.tensor(0.5), "charts/learning_rate": 1e-3})
    logger.end_iteration(50)
    logger.end_iteration(100)
    row = logger.flush()
    logger.close()
    assert row["charts/episodic_return"] == pytest.approx(20.0)
    assert row["charts/episodic_length"] == pytest.approx(5.0)
    assert row["losses/value_loss"] == 0.5 and row["charts/SPS"] > 0 and row["perf/warmup_time"] >= 0
    lines = [json.loads(s) for s in open(tmp_path / "metrics.jsonl")]
    assert lines[-1]["global_step"] == 100 and lines[-1]["charts/episodic_return"] == pytest.approx(20.0)

def test_logger_raises_on_a_non_finite_loss(tmp_path):
    logger = leanrl.Logger(str(tmp_path), {}, total_steps=10, progress=False)
    logger.record({"losses/policy_loss": torch.tensor(float("nan"))})
    with pytest.raises(FloatingPointError, match="losses/policy_loss"):
        logger.flush()
    logger.close()

def test_read_metrics_as_the_run_stands(tmp_path):
    """A final evaluation row joins the row of its step, a resume replaces the rows after its checkpoint, a last
    line cut short is left out, and any other bad line is an error naming file and line."""
    from leanrl.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"global_step": 10, "a": 1}, {"global_step": 20, "a": 2}, {"global_step": 20, "eval": 9},
            {"global_step": 30, "a": 3}, {"global_step": 20, "a": 5}, {"global_step": 30, "a": 6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"global_step": 40, "a"')
    assert read_metrics(str(path)) == [{"global_step": 10, "a": 1}, {"global_step": 20, "a": 5},
                                       {"global_step": 30, "a": 6}]
    path.write_text('{"global_step": 10}\n\n{"global_step": 20, "a":\n{"global_step": 30}\n')
    with pytest.raises(leanrl.UsageError, match=r"metrics.jsonl:3: not a metrics row"):
        read_metrics(str(path))
    path.write_text('{"step": 10}\n')
    with pytest.raises(leanrl.UsageError, match=r"metrics.jsonl:1: not a metrics row \(JSON with a global_step\)"):
        read_metrics(str(path))
    with pytest.raises(leanrl.UsageError, match="missing.jsonl'?: No such file"):
        read_metrics(str(tmp_path / "missing.jsonl"))


def test_run_summary_names_what_stopped_the_run(tmp_path, capsys):
    with pytest.raises(RuntimeError), leanrl.Logger(str(tmp_path / "a"), {}, total_steps=10, progress=False):
        raise RuntimeError
    assert "stopped by an error (RuntimeError) at step 0" in capsys.readouterr().out
    with pytest.raises(KeyboardInterrupt), leanrl.Logger(str(tmp_path / "b"), {}, total_steps=10, progress=False):
        raise KeyboardInterrupt
    assert "stopped by an interrupt at step 0" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_offline_writes_files_disabled_leaves_none(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = leanrl.Logger(str(tmp_path), {"seed": 1}, total_steps=10, track=True, wandb_mode=mode, progress=False)
    logger.record({"losses/value_loss": 1.0})
    logger.end_iteration(10)
    logger.flush()
    logger.close()
    assert os.path.isdir(tmp_path / "wandb") == (mode == "offline")
