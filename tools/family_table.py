"""Writes docs/families.md, the table of transformers model families and
whether prefetch offloads each, from what tests/test_families.py finds.

    python tools/family_table.py PYTHON [PYTHON ...]

runs tests/test_families.py once with each interpreter (each with its own
transformers: the oldest and the newest supported release), collects the
per-family results the test records (PREFETCH_FAMILY_RESULTS), and writes
the table, one column per release, and README.md's list of the families by
status. Nothing in either is written by hand: tests/test_families.py checks
that both say what it found on its release.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
BEGIN = "<!-- families: written by tools/family_table.py from tests/test_families.py's results -->"
END = "<!-- /families -->"


def _key(version: str) -> tuple:
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:3])


def collect(pythons: list[str]) -> dict:
    """{transformers version: {family: [status, detail]}} from one test run
    per interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "families.json"
        for python in pythons:
            print(f"family_table: tests/test_families.py with {python}", flush=True)
            env = dict(os.environ, PREFETCH_FAMILY_RESULTS=str(out))
            done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_families.py",
                                   "-k", "test_family"], cwd=ROOT, env=env)
            if done.returncode not in (0, 1):
                raise SystemExit(f"family_table: pytest with {python} ended with {done.returncode}")
        if not out.exists():
            raise SystemExit("family_table: the test recorded no family")
        return json.loads(out.read_text())


def render(results: dict) -> str:
    versions = sorted(results, key=_key)
    families = sorted({f for per in results.values() for f in per})
    newest = versions[-1]
    lines = [
        "# Model families",
        "",
        "Every transformers model family whose experts go through transformers' experts-implementation "
        "interface (`use_experts_implementation`), and what `offload_moe_experts` does with a tiny random "
        "model of it (`tests/test_families.py`: with a cache of a third of the experts' bytes, greedy tokens equal "
        "to the untouched model's; with a cache of a whole layer's experts, so that no layer runs in pieces, "
        "logits bit-equal too). Written by `tools/family_table.py` from "
        "the test's results on each release; the test checks its release's column.",
        "",
        "- **passes**: offloaded, tokens and logits as above.",
        "- **NotImplementedError**: `offload_moe_experts` refuses the model at once, saying what is missing.",
        "- **failed**: the test failed on that release (a bug: see the issue tracker).",
        "- **-**: the family is not in that release.",
        "",
        "| family | " + " | ".join(versions) + f" | one expert (transformers {newest}) |",
        "|---|" + "---|" * len(versions) + "---|",
    ]
    counts = {v: {} for v in versions}
    for family in families:
        cells, detail = [], ""
        for v in versions:
            status, info = results[v].get(family, ["-", ""])
            counts[v][status] = counts[v].get(status, 0) + 1
            cells.append(status)
            if status != "passes" and info and status != "-":
                cells[-1] = f"{status}: {info}"
            if v == newest or not detail:
                detail = info if status == "passes" else detail
        lines.append(f"| `{family}` | " + " | ".join(c.replace("|", "/") for c in cells) + f" | {detail} |")
    lines += ["", "Totals: " + "; ".join(
        f"transformers {v}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts[v].items()) if s != "-")
        for v in versions), ""]
    return "\n".join(lines)


def readme_lines(results: dict) -> list[str]:
    """One line per release: the families by status."""
    lines = []
    for v in sorted(results, key=_key, reverse=True):
        by_status: dict = {}
        for family, (status, _) in sorted(results[v].items()):
            by_status.setdefault(status, []).append(family)
        parts = [f"{len(names)} {status}: " + ", ".join(f"`{n}`" for n in names)
                 for status, names in sorted(by_status.items())]
        lines.append(f"- transformers {v}: " + "; ".join(parts))
    return lines


def write_readme(results: dict) -> None:
    text = README.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"family_table: README.md has no {BEGIN!r} ... {END!r} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + BEGIN + "\n" + "\n".join(readme_lines(results)) + "\n" + END + tail, encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pythons", nargs="*", default=[sys.executable],
                        help="interpreters to run the test with, one per transformers release (default: this one)")
    parser.add_argument("--results", help="a results JSON to render instead of running the test")
    args = parser.parse_args(argv)
    results = json.loads(pathlib.Path(args.results).read_text()) if args.results else collect(args.pythons)
    TABLE.write_text(render(results), encoding="utf-8")
    write_readme(results)
    print(f"family_table: wrote {TABLE.relative_to(ROOT)} and README.md's list "
          f"({', '.join(sorted(results, key=_key))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
