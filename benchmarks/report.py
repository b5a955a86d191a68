"""Tables (markdown, also what run.py prints) and bar charts from a results dict (see run.py)."""

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or on the GPU machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from entries import MODES  # noqa: E402
from measure import cpu_line  # noqa: E402

NOT_APPLICABLE = "—"  # a figure that does not exist in this mode (compile time in eager): not a zero


def fmt(x: float) -> str:
    """Three significant figures, without scientific notation for the values seen here."""
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x >= 0.01 else f"{x:.2g}"


def mode_cell(r: dict | None) -> str | None:
    """The cell of a mode that has no figures, else None."""
    if r is None:
        return "not run"
    if r["status"] == "n/a":
        return f"n/a ({r['label']})"
    if r["status"] == "error":
        return "error"
    return None


def shape(shapes: list) -> str:
    return "x".join(map(str, shapes[0])) if shapes else ""


def algo_table(name: str, algo: dict) -> str:
    """One markdown table: a row per figure, a column per mode; ratios are against eager in the same run.
    A row is left out when no mode has its figure (capture time and GPU busy on a CPU machine)."""
    modes = [m for m in MODES if m in algo["modes"]]
    ok = [r for r in algo["modes"].values() if r["status"] == "ok"]
    eager = algo["modes"].get("eager") if algo["modes"].get("eager", {}).get("status") == "ok" else None
    rows = []

    def row(label, value, text=fmt, ratio=None):
        """`value(r)`: the figure of an ok mode, None where it does not apply; `ratio(eager's, this)`."""
        cells, any_value = [], False
        for m in modes:
            r = algo["modes"][m]
            cell = mode_cell(r)
            if cell is None:
                v = value(r)
                any_value |= v is not None
                cell = NOT_APPLICABLE if v is None else text(v)
                if v is not None and ratio and eager and m != "eager":
                    cell += f" ({ratio(value(eager), v):.2f}x)"
            cells.append(cell)
        if any_value:
            rows.append(f"| {label} | " + " | ".join(cells) + " |")

    def per_fn(key):
        return lambda r: {fn: c[key] for fn, c in r["calls"].items() if key in c} or None

    def listed(d, text=fmt):
        return ", ".join(f"{fn} {text(v)}" for fn, v in d.items())

    for fn in ok[0]["calls"] if ok else ():
        row(f"`{fn}` ms/call, median ± IQR [{shape(ok[0]['calls'][fn]['input_shapes'])}]",
            lambda r, fn=fn: r["calls"][fn], lambda c: f"{fmt(c['median_ms'])} ± {fmt(c['iqr_ms'])}",
            lambda e, c: e["median_ms"] / c["median_ms"])
    row("end-to-end env-steps/s", lambda r: r["sps"], ratio=lambda e, v: v / e)
    row("compile s (first call; inductor cache)",
        lambda r: {fn: c for fn, c in r["calls"].items() if "compile_s" in c or c.get("kept_eager")} or None,
        lambda d: ", ".join(f"{fn} kept eager here" if c.get("kept_eager") else
                            f"{fn} {fmt(c['compile_s'])} ({c['inductor_cache']})" for fn, c in d.items()))
    row("capture s (capture call)", per_fn("capture_s"), listed)
    row("GPU busy (kernel time / wall)", per_fn("gpu_busy"), lambda d: listed(d, lambda v: f"{v:.0%}"))
    memory = "GPU allocated" if algo["device"].startswith("cuda") else "RSS"
    row(f"peak {memory} growth MB (build + first calls + burn-in)", lambda r: r.get("memory_growth_mb"))
    row("burn-in s (first training iterations)", lambda r: r["burn_in_s"])

    header = f"| {name} ({algo['env_id']}, {algo['num_envs']} envs) | " + " | ".join(modes) + " |"
    return "\n".join([header, "|" + "---|" * (len(modes) + 1), *rows, "", *notes(algo["modes"])])


def notes(modes: dict) -> list:
    """One line per reason a mode has no (or partial) figures, naming the modes it applies to."""
    by_reason = {}
    for m, r in modes.items():
        if "reason" in r:
            by_reason.setdefault(" ".join(r["reason"].split()), []).append(m)  # a traceback's lines: one line
    return [f"- {', '.join(ms)}: {reason}" for reason, ms in by_reason.items()]


def scaling_table(name: str, scaling: dict) -> str:
    modes = [m for m in MODES if m in scaling["modes"]]
    ok = {m: {p["num_envs"]: p for p in r["points"]} for m, r in scaling["modes"].items() if r["status"] == "ok"}
    sizes = sorted({n for points in ok.values() for n in points})
    lines = [f"| {name} ({scaling['env_id']}): env-steps/s (a step's `act` ms/call) | " + " | ".join(modes) + " |",
             "|" + "---|" * (len(modes) + 1)]
    for n in sizes:
        cells = [mode_cell(scaling["modes"][m]) or (f"{fmt(ok[m][n]['sps'])} ({fmt(ok[m][n]['policy_ms'])})"
                                                    if n in ok[m] else NOT_APPLICABLE) for m in modes]
        lines.append(f"| {n} envs | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *notes(scaling["modes"])])


def targets_markdown(targets: list) -> str:
    lines = []
    for t in targets:
        value = f": **{t['value_text']}**" if "value_text" in t else ""
        why = f" ({t['reason']})" if "reason" in t else ""
        lines.append(f"- [{t['status']}] {t['name']}{value}{why}")
    return "\n".join(lines)


def machine_line(m: dict) -> str:
    device = f"{m['gpu']} (CUDA {m['cuda']})" if m["gpu"] else "no GPU"
    return (f"{cpu_line(m)}, {m['cores']} cores, {device}; torch {m['torch']}, tensordict {m['tensordict']}, "
            f"torchrl {m['torchrl']}, python {m['python']}; commit {m['commit']}")


def summary_markdown(results: dict, image_dir: str = ".") -> str:
    """Everything a reader needs: the machine, a table per entry with its chart, scaling, targets."""
    s = results["settings"]
    parts = [f"**{results['machine']['slug']}**: {machine_line(results['machine'])}. Measured {results['created']}"
             f"{' with --quick sizes' if s['quick'] else ''}; torch threads: {s['threads']}, load average "
             f"{s['load_average']}, inductor cache {s['inductor_cache']}. Ratios are against eager in the "
             "same process, whose timed samples alternate between modes."]
    for name, algo in results["algos"].items():
        parts += [algo_table(name, algo), f"![{name}]({image_dir}/{name}.png)"]
    for name, scaling in results["scaling"].items():
        parts += [scaling_table(name, scaling), f"![{name}]({image_dir}/{name}.png)"]
    parts += ["Targets:", targets_markdown(results["targets"])]
    return "\n\n".join(parts) + "\n"


def algo_chart(name: str, algo: dict, machine: str, path: str):
    """Left: speedup over eager per call of each function; right: end-to-end env-steps/s. A mode without
    figures is labeled where its bars would be, never drawn as zero."""
    modes = [m for m in MODES if m in algo["modes"]]
    eager = algo["modes"].get("eager")
    fns = next((list(r["calls"]) for r in algo["modes"].values() if r["status"] == "ok"), [])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(modes)
    labels = []  # (axis, x, text) of modes without figures, placed once the axes have their scale
    for i, m in enumerate(modes):
        r = algo["modes"][m]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(fns))]
        if r["status"] == "ok" and eager and eager["status"] == "ok":
            left.bar(xs, [eager["calls"][fn]["median_ms"] / r["calls"][fn]["median_ms"] for fn in fns], width,
                     color=f"C{i}")
        else:
            labels += [(left, x, mode_cell(r) or "n/a (no eager)") for x in xs]
        if r["status"] == "ok":
            right.bar(i, r["sps"], color=f"C{i}")
            right.text(i, r["sps"], fmt(r["sps"]), ha="center", va="bottom", fontsize=8)
        else:
            labels.append((right, i, mode_cell(r)))
    for ax, x, text in labels:
        ax.text(x, ax.get_ylim()[1] * 0.03, text, rotation=90, ha="center", va="bottom", fontsize=7, color="gray")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(range(len(fns)), fns)
    left.set_xlim(-0.5, len(fns) - 0.5)
    left.set_ylabel("speedup over eager (time per call)")
    right.set_xticks(range(len(modes)), modes, fontsize=8)
    right.set_xlim(-0.5, len(modes) - 0.5)
    right.set_ylabel("env-steps/s, end to end")
    fig.suptitle(f"{name} ({algo['env_id']}) on {machine}")
    fig.legend([Patch(color=f"C{i}") for i in range(len(modes))], modes, loc="upper center", ncol=len(modes),
               bbox_to_anchor=(0.5, 0.93), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling_chart(name: str, scaling: dict, machine: str, path: str):
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = False
    for i, m in enumerate(m for m in MODES if m in scaling["modes"]):
        r = scaling["modes"][m]
        if r["status"] == "ok":
            ok = True
            ax.plot([p["num_envs"] for p in r["points"]], [p["sps"] for p in r["points"]], "o-", color=f"C{i}",
                    label=m)
        else:
            ax.plot([], [], color=f"C{i}", label=f"{m}: {mode_cell(r)}")
    ax.set_xscale("log", base=2)
    if ok:
        ax.set_yscale("log")
    ax.set_xlabel("parallel envs")
    ax.set_ylabel("env-steps/s, end to end")
    ax.set_title(f"{name} ({scaling['env_id']}) on {machine}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(results: dict, out: str):
    """results.json's companions: a markdown table and a chart per entry, and the summary."""
    machine = results["machine"]["slug"]
    for name, algo in results["algos"].items():
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(algo_table(name, algo) + "\n")
        algo_chart(name, algo, machine, os.path.join(out, f"{name}.png"))
    for name, scaling in results["scaling"].items():
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(scaling_table(name, scaling) + "\n")
        scaling_chart(name, scaling, machine, os.path.join(out, f"{name}.png"))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_markdown(results))

