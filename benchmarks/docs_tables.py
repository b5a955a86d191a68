"""Regenerate docs/performance.md's list of results per machine from the saved results, never by hand:

    python benchmarks/docs_tables.py [--page docs/performance.md] [--results benchmarks/results]

Everything between `<!-- bench:start -->` and `<!-- bench:end -->` is replaced by one line per machine folder
under --results (CPU machines first; --quick smoke runs left out): a link to its summary.md (the tables
benchmarks/run.py writes beside results.json) with the machine's one-line description, and links to the tables
of the other benchmarks that machine ran. The tables themselves stay in their folders; the rest of the page is
left as it is.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from report import machine_line

START, END = "<!-- bench:start -->", "<!-- bench:end -->"

# Tables of other benchmarks, linked where a machine has them: (file, link text).
OTHER_TABLES = (("cpu_speed.md", "whole runs, launch to exit (`benchmarks/cpu_speed.py`)"),
                ("async_vs_sync.md", "async vs sync PPO (`benchmarks/async_vs_sync.py`)"),
                ("step_costs.md", "Python calls and time around an env step (`benchmarks/step_costs.py`)"),
                ("learning_parity.md", "learning parity (`benchmarks/learning_parity.py`)"))


def machine_entry(folder: str, slug: str, page_dir: str) -> tuple[bool, str] | None:
    """(has a GPU, its list item), or None when the folder holds nothing to link."""
    def link(name: str) -> str:
        return os.path.relpath(os.path.join(folder, name), page_dir).replace(os.sep, "/")

    results = None
    if os.path.isfile(os.path.join(folder, "results.json")):
        with open(os.path.join(folder, "results.json")) as f:
            results = json.load(f)
        if results["settings"]["quick"] or not os.path.isfile(os.path.join(folder, "summary.md")):
            results = None
    parts = []
    if results:
        parts.append(f"[summary of `benchmarks/run.py`]({link('summary.md')}): "
                     f"{machine_line(results['machine'])}; measured {results['created']}")
    others = [f"[{text}]({link(name)})" for name, text in OTHER_TABLES if os.path.isfile(os.path.join(folder, name))]
    if others:
        parts.append(("also " if parts else "") + ", ".join(others))
    if not parts:
        return None
    gpu = results is not None and results["machine"]["gpu"] is not None
    return gpu, f"- **{slug}**: " + "; ".join(parts) + "."


def section(results_dir: str, page_dir: str) -> str:
    entries = []
    for slug in sorted(os.listdir(results_dir)):
        entry = machine_entry(os.path.join(results_dir, slug), slug, page_dir)
        if entry:
            entries.append((entry[0], slug, entry[1]))
    if not entries:
        return "No benchmark results yet: run `python benchmarks/run.py`."
    return "\n".join(line for _, _, line in sorted(entries))


def main():
    root = os.path.dirname(HERE)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page", default=os.path.join(root, "docs", "performance.md"))
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    with open(a.page) as f:
        text = f.read()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        sys.exit(f"{a.page}: needs exactly one {START} followed by one {END}")
    head, rest = text.split(START)
    tail = rest.split(END)[1]
    body = section(a.results, os.path.dirname(os.path.abspath(a.page)))
    with open(a.page, "w") as f:
        f.write(f"{head}{START}\n{body}\n{END}{tail}")
    print(f"{a.page}: the list of results per machine regenerated")


if __name__ == "__main__":
    main()
