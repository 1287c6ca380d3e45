"""A benchmark script of this repository run at two revisions, interleaved, and one of its table columns compared.

    python scripts/bench_ab.py --base 25ba966 -- scripts/bench_engine.py --quick
    python scripts/bench_ab.py --base HEAD~3 --column tok/s --rounds 3 -- scripts/bench_spec.py --batch 1 8

The base revision is checked out into a temporary git worktree; the script runs there and in this checkout in
alternating rounds (base, head, head, base, ...), so a change of load on a noisy machine hits both alike. Every
table the script prints (a title line, a header holding the column, fixed-width rows: `bench_engine.py`'s and
`bench_spec.py`'s shape) is read; each row's value is the median over rounds, and the table shows head / base.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_tables(text: str, column: str) -> dict[tuple[str, str], float]:
    """{(table title, row label): value of `column`} of every table in `text` whose header holds `column`; a
    table's title is the non-empty line before its header, a row's label what precedes its first value."""
    values: dict[tuple[str, str], float] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        header = lines[i]
        fields = header.split()
        if column not in fields or len(fields) < 3:
            i += 1
            continue
        title = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        end = header.index(column) + len(column)  # values are right-aligned under their header
        first_end = header.index(fields[1]) + len(fields[1])
        i += 1
        while i < len(lines) and lines[i].strip():
            row = lines[i]
            head, _, _ = row[:first_end].rpartition(" ")
            try:
                values[(title, head.strip())] = float(row[:end].split()[-1])
            except (ValueError, IndexError):
                break
            i += 1
    return values


def run(tree: Path, argv: list[str]) -> str:
    result = subprocess.run([sys.executable, *argv], cwd=tree, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    if result.returncode:
        raise SystemExit(f"{argv[0]} failed in {tree} (rc {result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the baseline revision (a git rev of this repository)")
    ap.add_argument("--column", default="tok/s", help="the header of the column to compare")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each revision")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- then the script and its arguments")
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the benchmark script after --")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            order = ["base", "head"]
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    runs[name].append(parse_tables(run(base if name == "base" else ROOT, script), args.column))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False,
                           capture_output=True)
    keys = [k for k in runs["head"][0] if all(k in v for v in runs["base"] + runs["head"])]
    if not keys:
        raise SystemExit(f"no table with a {args.column!r} column in the output of both revisions")
    print(f"{' '.join(script)}: {args.column}, median of {args.rounds} interleaved runs each; base {args.base}")
    width = max(len(label) for _, label in keys)
    title = None
    for t, label in keys:
        if t != title:
            title = t
            print(f"\n{t}\n{'row':{width}s} {'base':>10s} {'head':>10s} {'head/base':>10s}")
        b = statistics.median(v[(t, label)] for v in runs["base"])
        h = statistics.median(v[(t, label)] for v in runs["head"])
        print(f"{label:{width}s} {b:10.1f} {h:10.1f} {h / b:9.2f}x")


if __name__ == "__main__":
    main()
