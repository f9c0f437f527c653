"""Eviction policies on real routing: the hit rate of each of the engine's
policies against Belady's optimum at the same capacity, per trace and cache
share, on each half of the trace's decode steps.

    python bench/policies.py [--traces FILE ...] [--shares 0.1 0.25 0.5]
        [--policies lru cyclic decay] [--json PATH]

Each trace is served by the engine's real cache (host backend,
bench/lib/trace_replay.py): one acquire per MoE layer, one cache over all
layers holding round(share x layers x experts) experts, step 0 (the prompt)
warming it uncounted. Decode steps 1..N are split at the middle: "fitted" is
the first half, on which "decay"'s time constant was chosen (kDecayTokens in
src_cpp/decay_policy.h), "held out" the second. Belady's figure is for the
same steps (its choices see the whole trace). Default traces: the two of
../shared/traces and every traces/*.json of this repository.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.trace_replay import POLICIES, capacity_for, halves, replay  # noqa: E402
from prefetch.trace import RoutingTrace, belady_misses  # noqa: E402


def default_traces() -> list[Path]:
    shared = ROOT.parent / "shared" / "traces"
    return sorted(shared.glob("*.json")) + sorted((ROOT / "traces").glob("*.json"))


def accesses(trace: RoutingTrace, start: int, end: int) -> int:
    return sum(len(experts) for step in trace.steps[start:end] for experts in step)


def measure(path: Path, shares, policies) -> list[dict]:
    trace = RoutingTrace.load(str(path))
    rows = []
    for share in shares:
        capacity = capacity_for(trace, share)
        row = {"trace": path.name, "layers": trace.num_layers, "experts": trace.num_experts,
               "steps": len(trace.steps), "share": share, "capacity": capacity}
        for name, steps in zip(("fitted", "held_out"), halves(trace)):
            n = accesses(trace, steps.start, steps.stop)
            row[f"belady_{name}"] = 1 - belady_misses(trace, capacity, steps.start, steps.stop) / n if n else None
        for policy in policies:
            result = replay(trace, capacity, policy)
            for name, steps in zip(("fitted", "held_out"), halves(trace)):
                row[f"{policy}_{name}"] = result.hit_rate(steps.start, steps.stop)
        rows.append(row)
    return rows


def fmt(x) -> str:
    return "null" if x is None else f"{x:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", type=Path, default=None, help="routing trace files (default: all)")
    parser.add_argument("--shares", nargs="+", type=float, default=[0.10, 0.25, 0.50])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    traces = args.traces or default_traces()
    if not traces:
        parser.error("no trace files found (give --traces)")
    rows = []
    head = "trace                                 share  belady fit/held  " + "  ".join(
        f"{p:>7} fit/held" for p in args.policies)
    print(head)
    for path in traces:
        for row in measure(path, args.shares, args.policies):
            rows.append(row)
            cells = [f"{row['trace'][:37]:37}", f"{row['share']:5.2f}",
                     f"{fmt(row['belady_fitted'])}/{fmt(row['belady_held_out'])}"]
            cells += [f"{fmt(row[p + '_fitted'])}/{fmt(row[p + '_held_out'])}" for p in args.policies]
            print("  ".join(cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
