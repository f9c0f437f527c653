"""The pairs of a same-run A/B of two trees (`tools/h200_run.sh OUT
abtraces`), or of two rows of one BM5 run, round by round:

    python3 bench/diagnostics/ab_pairs.py FOLDER [FOLDER ...] [--policy oracle]
        [--alias new=5f62246 old=0bf545f] [--json OUT]
    python3 bench/diagnostics/ab_pairs.py FOLDER [FOLDER ...] --rows ROW_A ROW_B [--json OUT]

With --rows the two sides are two policies of the same BM5 runs (e.g.
oracle and oracle:max_speculative_bytes_in_flight=8388608, stop 44): each
e2e_<trace>.json of the folders, made with --repeats N, gives N rounds in
which both rows ran beside the same resident run.

abtraces writes one BM5 JSON per trace, tree and round, named
ab_<trace>_<tree>_<round>.json (the tree "new" or "old", or a commit in
older runs; --alias names the trees of folders that called them new and
old, so runs of both namings pool). The host's speed drifts between rounds and even between the
two trees' turns of one round (runs 140-143: resident steps of 21.6-48.7 ms
in one lease), so two trees' p50s are compared only through each one's
ratio to the floor of its own moment: its round's p50 over max(the
resident run beside it, the IO floor) (Note [A round's own floor] in
bench/e2e.py). Prints, per trace and policy, each round's p50 and ratio for
both trees, which tree had the lower ratio, and over all rounds of all
folders the medians and the count of rounds each tree won: the figures
stop 43's A/B was settled with, computed the same way every time."""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

if __package__ in (None, ""):  # run as a script: this tree's bench package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.lib.common import round_floor_ratio  # noqa: E402

_NAME = re.compile(r"^ab_(?P<trace>[^_]+)_(?P<tree>[^_]+)_(?P<round>\d+)\.json$")


def round_ratio(row: dict) -> float | None:
    """The (one) round of an abtraces BM5 row: its p50 over max(its
    resident run, the IO floor); the row's own x_floor_runs where BM5 wrote
    them, else made from p50_runs_ms, resident_runs_ms and io_floor_ms
    (older runs)."""
    given = row.get("x_floor_runs")
    if given:
        return given[0]
    p50s, residents, io = row.get("p50_runs_ms") or [], row.get("resident_runs_ms") or [], row.get("io_floor_ms")
    if not p50s or not residents or io is None:
        return None
    return round_floor_ratio(p50s[0], residents[0], io)


_E2E = re.compile(r"^e2e_(?P<trace>.+)\.json$")


def _results(folder: str, pattern, what: str):
    """(name match, path, rows) of each BM5 result in `folder` whose name
    matches `pattern`, in name order; none, or a file that is not a BM5
    result, raises ValueError naming it."""
    names = sorted(n for n in os.listdir(folder) if pattern.match(n))
    if not names:
        raise ValueError(f"{folder}: no {what} files")
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a BM5 result ({e})") from e
        yield pattern.match(name), path, rows


def _measured_row(rows: list, policy: str, path: str) -> dict:
    row = next((r for r in rows if isinstance(r, dict) and r.get("policy") == policy), None)
    if row is None or not row.get("p50_runs_ms"):
        raise ValueError(f"{path}: no measured row of policy {policy!r}")
    return row


def load(folders: list[str], policy: str, alias: dict | None = None) -> dict:
    """{trace: {round key: {tree: (p50 ms, resident ms, ratio)}}} from the
    ab_*.json files of `folders` (a round key is (folder, round)). A file
    that is not valid JSON, or has no row of `policy`, raises ValueError
    naming it."""
    out: dict = {}
    for folder in folders:
        for m, path, rows in _results(folder, _NAME, "ab_<trace>_<tree>_<round>.json"):
            row = _measured_row(rows, policy, path)
            resident = (row.get("resident_runs_ms") or [None])[0]
            tree = (alias or {}).get(m["tree"], m["tree"])
            cell = out.setdefault(m["trace"], {}).setdefault((folder, int(m["round"])), {})
            if tree in cell:
                raise ValueError(f"{path}: a second file of tree {tree!r} for this round")
            cell[tree] = (row["p50_runs_ms"][0], resident, round_ratio(row))
    return out


def load_rows(folders: list[str], names: tuple[str, str]) -> dict:
    """As load, with two rows of the same BM5 runs as the two sides: from
    each e2e_<trace>.json of `folders`, per round i of its --repeats, each
    row's i-th p50, the resident run of that round and its ratio to that
    round's floor. A file without both rows, or whose rows do not have one
    figure a round, raises ValueError naming it."""
    out: dict = {}
    for folder in folders:
        for m, path, rows in _results(folder, _E2E, "e2e_<trace>.json"):
            sides = {}
            for side in names:
                row = _measured_row(rows, side, path)
                p50s, residents = row["p50_runs_ms"], row.get("resident_runs_ms") or []
                ratios = row.get("x_floor_runs")
                if ratios is None and row.get("io_floor_ms") is not None and len(residents) == len(p50s):
                    ratios = [round_floor_ratio(p, r, row["io_floor_ms"]) for p, r in zip(p50s, residents)]
                if len(residents) != len(p50s) or ratios is None or len(ratios) != len(p50s):
                    raise ValueError(f"{path}: row {side!r} has not one p50, resident run and ratio a round")
                sides[side] = list(zip(p50s, residents, ratios))
            for i in range(min(len(v) for v in sides.values())):
                out.setdefault(m["trace"], {})[(folder, i + 1)] = {side: sides[side][i] for side in names}
    return out


def summarize(pairs: dict) -> dict:
    """Per trace: the two trees (in first-seen order), every round both ran
    in with each one's figures and the round's winner (the lower ratio;
    None on a tie or a missing ratio), each tree's median ratio and rounds
    won. A trace with other than two trees raises ValueError."""
    report = {}
    for trace, rounds in pairs.items():
        trees: list[str] = []
        for cell in rounds.values():
            trees.extend(t for t in cell if t not in trees)
        if len(trees) != 2:
            raise ValueError(f"{trace}: an A/B needs two trees, found {trees}")
        a, b = trees
        listed, wins = [], {a: 0, b: 0}
        for key in sorted(rounds):
            cell = rounds[key]
            if a not in cell or b not in cell:
                continue
            ra, rb = cell[a][2], cell[b][2]
            winner = None if ra is None or rb is None or ra == rb else (a if ra < rb else b)
            if winner is not None:
                wins[winner] += 1
            listed.append({"folder": key[0], "round": key[1], a: cell[a], b: cell[b], "lower": winner})
        medians = {}
        for t in (a, b):
            ratios = [r[t][2] for r in listed if r[t][2] is not None]
            medians[t] = statistics.median(ratios) if ratios else None
        report[trace] = {"trees": [a, b], "rounds": listed, "median_ratio": medians, "rounds_won": wins}
    return report


def format_report(report: dict, policy: str) -> str:
    def num(x, digits=2):
        return "null" if x is None else f"{x:.{digits}f}"

    lines = []
    for trace, r in report.items():
        a, b = r["trees"]
        lines.append(f"{trace}, {policy}: p50 ms (resident beside it) and p50 / max(resident, IO floor)")
        lines.append(f"{'folder':<24}{'round':>6}  {a:>22}  {b:>22}  lower")
        for row in r["rounds"]:
            cells = [f"{num(row[t][0], 1)} ({num(row[t][1], 1)}) {num(row[t][2])}" for t in (a, b)]
            lines.append(f"{os.path.basename(os.path.normpath(row['folder'])):<24}{row['round']:>6}  "
                         f"{cells[0]:>22}  {cells[1]:>22}  {row['lower'] or '-'}")
        lines.append(f"median ratio: {a} {num(r['median_ratio'][a])}, {b} {num(r['median_ratio'][b])}; "
                     f"rounds won: {a} {r['rounds_won'][a]}, {b} {r['rounds_won'][b]} of {len(r['rounds'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--policy", default="oracle")
    parser.add_argument("--alias", nargs="+", default=[], metavar="NAME=TREE",
                        help="a file's tree name and the name to pool it under")
    parser.add_argument("--rows", nargs=2, metavar=("ROW_A", "ROW_B"),
                        help="compare two policies of the same BM5 runs (e2e_<trace>.json) instead of two trees")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.rows and (args.alias or args.rows[0] == args.rows[1]):
        parser.error("--rows takes two different policies and no --alias")
    alias = {}
    for item in args.alias:
        name, sep, tree = item.partition("=")
        if not sep or not name or not tree:
            parser.error(f"--alias takes NAME=TREE, got {item!r}")
        alias[name] = tree
    what = " against ".join(args.rows) if args.rows else args.policy
    try:
        pairs = load_rows(args.folders, tuple(args.rows)) if args.rows else load(args.folders, args.policy, alias)
        report = summarize(pairs)
    except (OSError, ValueError) as e:
        print(f"ab_pairs: {e}", file=sys.stderr)
        return 2
    print(format_report(report, what))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "rows": args.rows, "traces": report}, f, indent=1, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
