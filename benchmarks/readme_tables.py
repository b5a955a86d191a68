"""Regenerate README.md's benchmark section from the saved results, never by hand:

    python benchmarks/readme_tables.py [--readme README.md] [--results benchmarks/results]

Everything between `<!-- bench:start -->` and `<!-- bench:end -->` is replaced by the summary of each
machine folder under --results (CPU machines first; --quick smoke runs left out); the rest of the file
is left as it is.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import summary_markdown  # noqa: E402

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def section(results_dir: str, readme_dir: str) -> str:
    machines = []
    for slug in sorted(os.listdir(results_dir)):
        folder, results = os.path.join(results_dir, slug), None
        if os.path.isfile(os.path.join(folder, "results.json")):
            with open(os.path.join(folder, "results.json")) as f:
                results = json.load(f)
            if results["settings"]["quick"]:
                results = None
        body = (summary_markdown(results, os.path.relpath(folder, readme_dir)) if results else "") \
            + speed_section(folder) + async_section(folder, readme_dir)
        if body:
            machines.append((results is not None and results["machine"]["gpu"] is not None, slug, body))
    if not machines:
        return "No benchmark results yet: run `python benchmarks/run.py`."
    return "\n".join(f"### {'GPU' if gpu else 'CPU'}: {slug}\n\n{body}" for gpu, slug, body in sorted(machines))


def speed_section(folder: str) -> str:
    """benchmarks/cpu_speed.py's table (whole runs against the CleanRL-style loop), when that machine has it."""
    path = os.path.join(folder, "cpu_speed.md")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return "\n#" + f.read()  # its "##" heading one level down, under the machine's


def async_section(folder: str, readme_dir: str) -> str:
    """benchmarks/async_vs_sync.py's table and plot, when that machine has them."""
    path = os.path.join(folder, "async_vs_sync.md")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        table = f.read()
    png = os.path.relpath(os.path.join(folder, "async_vs_sync.png"), readme_dir)
    return f"\n#### Async vs sync (`benchmarks/async_vs_sync.py`)\n\n{table}\n![async_vs_sync]({png})\n"


def main():
    root = os.path.dirname(HERE)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default=os.path.join(root, "README.md"))
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    with open(a.readme) as f:
        text = f.read()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        sys.exit(f"{a.readme}: needs exactly one {START} followed by one {END}")
    head, rest = text.split(START)
    tail = rest.split(END)[1]
    body = section(a.results, os.path.dirname(os.path.abspath(a.readme)))
    with open(a.readme, "w") as f:
        f.write(f"{head}{START}\n{body}\n{END}{tail}")
    print(f"{a.readme}: benchmark section regenerated")


if __name__ == "__main__":
    main()
