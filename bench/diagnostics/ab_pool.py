"""BM6 `--ab` pairs of several runs pooled: the gate against on-demand (or
any two rows) over more pairs than one device call holds.

    python3 bench/diagnostics/ab_pool.py BM6.json [BM6.json ...] [--part ab] [--lockstep] [--json OUT]

Each file is a BM6 result (`bench/generate.py --ab ... --json`); each of
its blocks with an `ab` gives that part's pairs ([A, B] ms a decode
token): `--part ab` (default) the A/B as run, `control` its --ab-control,
`swapped` the --ab-swap run taken as [A, B], `pooled` the A/B and its swap
together; `--lockstep` the lockstep pairs of that part instead of the
alternating ones. Prints, per file and pooled, the pairs, x_ab (the median
A/B ratio), its distribution-free interval (bench/lib/generate_ab.py's
median_ci) and the pairs A won, computed the same way as BM6 does for one
run. Pairs pool only where model, batch, share and rows agree; a pair is
a ratio of two generates a second apart, so pairs of different leases
pool where the code on the measured path is the same (the caller's to
check: the tool cannot see it). --paired-tokens may differ between runs
(each pair's two sides had the same); it is printed per file. A file
that is not a BM6 result, or has no such pairs, raises ValueError naming
it."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

if __package__ in (None, ""):  # run as a script: this tree's bench package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.lib.common import write_json  # noqa: E402
from bench.lib.generate_ab import _pair_figures  # noqa: E402

PARTS = ("ab", "control", "swapped", "pooled")
# bench/generate.py's flag that writes each part other than the A/B itself.
PART_FLAGS = {"control": "--ab-control", "swapped": "--ab-swap", "pooled": "--ab-swap"}


def _pairs_of(part: dict, lockstep: bool, where: str) -> list:
    if lockstep:
        part = part.get("lockstep")
        if not isinstance(part, dict):
            raise ValueError(f"{where}: no lockstep pairs")
    pairs = part.get("pairs_ms")
    if not isinstance(pairs, list) or not pairs:
        raise ValueError(f"{where}: no pairs")
    for p in pairs:
        ok = isinstance(p, list) and len(p) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in p)
        if not ok:
            raise ValueError(f"{where}: a pair is not two positive, finite ms figures: {p!r}")
    return [list(map(float, p)) for p in pairs]


def load(path: str, part: str = "ab", lockstep: bool = False) -> list[dict]:
    """Per block of `path` with an A/B: {key: (model, batch, share, rows),
    pairs, paired_tokens, file}. `part`: one of PARTS ("swapped" pairs are
    turned round to [A, B])."""
    if part not in PARTS:
        raise ValueError(f"--part must be one of {PARTS}, not {part!r}")
    try:
        with open(path) as f:
            report = json.load(f)
        blocks = report["blocks"]
        tokens = report.get("config", {}).get("paired_tokens")
        if not isinstance(blocks, list):
            raise TypeError("blocks is not a list")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ValueError(f"{path}: not a BM6 result ({type(e).__name__}: {e})") from e
    out = []
    for i, block in enumerate(blocks):
        ab = block.get("ab") if isinstance(block, dict) else None
        if not isinstance(ab, dict):
            continue
        where = f"{path}: block {i} ({ab.get('model')}), {part}"
        src = ab if part == "ab" else ab.get(part)
        if not isinstance(src, dict):
            raise ValueError(f"{where}: not in this file (run without {PART_FLAGS[part]}?)")
        pairs = _pairs_of(src, lockstep, where)
        if part == "swapped":  # run as [B, A]
            pairs = [[b, a] for a, b in pairs]
        rows = src.get("rows") if part == "control" else ab.get("rows")  # the control's are [B, B]
        if not (isinstance(rows, list) and len(rows) == 2 and all(isinstance(r, str) for r in rows)):
            raise ValueError(f"{where}: no rows [A, B]")
        model, batch, share = ab.get("model"), ab.get("batch"), ab.get("share")
        cell = (isinstance(model, str) and isinstance(batch, int) and not isinstance(batch, bool)
                and isinstance(share, (int, float)) and not isinstance(share, bool))
        if not cell:
            raise ValueError(f"{where}: no model, batch and share ({model!r}, {batch!r}, {share!r})")
        out.append({"key": (model, batch, share, tuple(rows)),
                    "pairs": pairs, "paired_tokens": tokens, "file": path})
    if not out:
        raise ValueError(f"{path}: no block with an --ab")
    return out


def pool(paths: list[str], part: str = "ab", lockstep: bool = False) -> list[dict]:
    """Per (model, batch, share, rows), in first-seen order: each file's
    figures and the pooled figures."""
    groups: dict = {}
    for path in paths:
        for item in load(path, part, lockstep):
            groups.setdefault(item["key"], []).append(item)
    report = []
    for key, items in groups.items():
        model, batch, share, rows = key
        runs = [{"file": it["file"], "paired_tokens": it["paired_tokens"], "pairs": len(it["pairs"]),
                 **_pair_figures(it["pairs"])} for it in items]
        every = [p for it in items for p in it["pairs"]]
        report.append({"model": model, "batch": batch, "share": share, "rows": list(rows), "runs": runs,
                       "pooled": {"pairs": len(every), **_pair_figures(every)}})
    return report


def _ci(ci) -> str:
    return f"{ci[0]:.3f}-{ci[1]:.3f} at {100 * ci[2]:.1f} %" if ci else "null (too few pairs)"


def _p(p) -> str:
    return "n/a (every pair a tie)" if p is None else f"{p:.3g}"


def _line(label: str, fig: dict, a: str) -> str:
    return (f"  {label}: {fig['pairs']} pairs, x_ab {fig['x_ab']:.3f} ({_ci(fig['x_ab_ci'])}), "
            f"{a} faster in {fig['a_faster']}, sign test p {_p(fig['sign_p'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="BM6 JSON results with --ab blocks")
    parser.add_argument("--part", choices=PARTS, default="ab", help="which pairs of each A/B (default ab)")
    parser.add_argument("--lockstep", action="store_true", help="the lockstep pairs instead of the alternating")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    try:
        report = pool(args.files, args.part, args.lockstep)
    except ValueError as e:
        parser.error(str(e))
    for g in report:
        a, b = g["rows"]
        print(f"{g['model']} b{g['batch']} share {g['share']}: {a} / {b}, {args.part}"
              f"{' in lockstep' if args.lockstep else ''}")
        for r in g["runs"]:
            print(_line(f"{r['file']} (paired tokens {r['paired_tokens']})", r, a))
        print(_line("pooled", g["pooled"], a))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
