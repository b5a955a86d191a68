"""A run's `metrics.jsonl` read back (`leanrl.Logger` writes it): for plots, the layout planner's --compare and
tests. Torch-free."""

import json

from leanrl.cli import UsageError


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl as the run stands. A row logged at the step of the row before it (a
    final evaluation) joins that row; a resumed run logs again from its checkpoint's step, and those rows replace
    the ones after it; a last line cut short (a run still writing, or killed mid-write) is left out. Any other line
    that is not a metrics row is an error naming the file and the line."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise UsageError(f"metrics {path!r}: {e.strerror}") from e
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["global_step"]
        except (ValueError, TypeError, KeyError) as e:
            if number == len(lines):  # no newline after it: cut short
                break
            raise UsageError(f"{path}:{number}: not a metrics row (JSON with a global_step): {line[:80]!r}") from e
        if rows and step == rows[-1]["global_step"]:
            rows[-1] = {**rows[-1], **row}
            continue
        while rows and rows[-1]["global_step"] >= step:
            rows.pop()
        rows.append(row)
    return rows
