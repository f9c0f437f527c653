"""Route-ahead predictors on real routing traces: precision and recall of
their guesses against the misses of the on-demand cache (issue #60 items 4-5).

    python bench/predictors.py [--traces FILE ...] [--policy cyclic|lru]
        [--shares 10 25 50] [--distances 1 2 4] [--fit] [--json PATH]

Each trace (docs/trace_format.md; step 0 the prompt, steps 1..N decode
tokens) is replayed through the engine's real cache (bench/lib/trace_replay.py,
host backend, one one-slot expert per (layer, expert), `capacity_for(trace,
share)` slots, eviction `--policy`; "cyclic" gets the layer count as its
cycle, as offload_moe_experts sets it), fetching on demand only, and the
resident set just before every layer's acquire is kept.

Definitions. For a target (step s, layer l + d), guessed at layer l of the
same step (the guesses a predictor's `predict` returns for layer l + d
there):
  P = the guessed experts of l + d that are NOT resident just before layer
      l + d of step s is acquired;
  M = the misses at (s, l + d): its routed experts not resident then;
  precision = |P & M| / |P|, recall = |P & M| / |M|, each pooled (sums of
  the counts) over every decode step of the half and every layer l with
  l + d inside the step. Precision is null where nothing was guessed.
The resident sets are those of the on-demand replay: prefetching would
change them, so these figures score guesses aimed at the misses of the
on-demand cache, not a run with the predictor in the loop. A guess of a
resident expert costs nothing here: it is neither in P nor in M. `sent`
is the guesses per target before the resident ones are taken out;
`seen before` the share of M that some earlier step (the prompt included)
routed to at that layer, the most recall any predictor that learns only
from routing seen could reach.

Halves: decode steps 1..N split at the middle, 1..N//2 ("first") and
N//2+1..N ("second"). HistoryPredictor's defaults were fitted (--fit) on
the first halves of the traces in FITTED_ON: there the first half is
"fitted" (`fitted` true in the JSON) and the second held out; on other
traces both halves are unseen. The predictors see the trace as two requests:
the prompt and the first half, `end_request`, then the second half (so a
predictor that learns only across requests, TracePredictor, has the first
half to match the second against). Each call runs as in the controller:
`observe` then `predict` for a predictor that reads the routing
(`reads_routing`), `predict` first otherwise, layer by layer, with a small
context object carrying the shape, `step` (from 0 in each request) and
`clock`.

Rows: `history` (prefetch.HistoryPredictor with its defaults, distance the
largest of --distances), `trace` (prefetch.TracePredictor, its defaults:
twice top-k experts a layer, top-k taken as the widest decode routing of
the trace), `previous-token` (the baseline: the experts the previous step
routed to at the target layer).

--fit searches HistoryPredictor's decay, sharpness, prior, neighbours and
threshold on the first halves only: the most recall of the misses at share 25 %,
distance 1, pooled over --traces, with precision >= 0.5 (ties: higher
precision). It drives the real class at the lowest threshold and reads
each guess's score from its `scores`, so a higher threshold keeps the
guesses scoring at least that, as `predict` would.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import fmt, machine_info, write_json  # noqa: E402
from bench.lib.trace_replay import halves  # noqa: E402

# The shared folder beside the repository (../shared/traces), wherever it is checked out.
_SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "traces")
DEFAULT_TRACES = [os.path.join(_SHARED, "gemma4-26b-a4b.json"), os.path.join(_SHARED, "gpt-oss-120b.json")]
# The traces whose first halves HistoryPredictor's defaults were fitted on
# (--fit); on any other trace both halves are unseen.
FITTED_ON = ("gemma4-26b-a4b", "gpt-oss-120b")
HALVES = ("first", "second")
FIT_GRID = {"decay": (0.7, 0.8, 0.9), "sharpness": (3.0, 6.0, 9.0), "prior": (0.05, 0.1, 0.2), "neighbours": (4, 8, 16),
            "threshold": (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)}


class Ctx:
    """What a predictor's calls read of the model (RoutingContext's
    members, minus the routers: these predictors run without hidden states)."""

    honours_hints = False
    holds_every_expert = False

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.step, self.clock = 0, -1

    def router_logits(self, layer, hidden):
        raise RuntimeError("no routers in a trace replay")

    router_topk = router_logits


def make_previous_token():
    """The baseline: for layer l + d, the experts the previous step routed
    to at l + d (temporal persistence alone)."""
    from prefetch.predictors import RoutePredictor

    class PreviousTokenPredictor(RoutePredictor):
        def __init__(self, distance: int):
            self.distance = distance
            self.last, self.now, self.step = {}, {}, None

        def observe(self, ctx, step, layer, experts):
            if step != self.step:
                self.last, self.now, self.step = self.now, {}, step
            self.now[layer] = [int(e) for e in experts]

        def predict(self, ctx, step, layer, hidden):
            prev = self.last if step == self.step else self.now  # a step's first predict comes before its observe
            return {t: prev[t] for t in range(layer + 1, min(layer + self.distance + 1, ctx.num_layers))
                    if prev.get(t)}

        def end_request(self):
            self.step = None  # the next request's first step still reads this one's last

    return PreviousTokenPredictor


def top_k(trace) -> int:
    return max((len(e) for step in trace.steps[1:] for e in step), default=1)


def drive(trace, predictor, distances, on_guess=None) -> dict:
    """Feeds `trace` to `predictor` as two requests (the prompt and the first
    half; the second half). Returns {(step, target layer, d): set of
    guessed experts} for every decode step and d in `distances`.
    `on_guess(step, layer, target, guess)`, if given, sees each guess."""
    import numpy as np

    layers, num_experts = trace.num_layers, trace.num_experts
    ctx = Ctx(layers, num_experts, top_k(trace))
    late = bool(getattr(predictor, "reads_routing", False))
    observes = late or bool(getattr(predictor, "observes", True))
    second = halves(trace)[1].start
    out = {}
    for s, step in enumerate(trace.steps):
        if s == second:
            predictor.end_request()
        ctx.step = s if s < second else s - second
        for layer, experts in enumerate(step):
            ctx.clock += 1
            routed = sorted(experts)
            guesses = {} if late else predictor.predict(ctx, ctx.step, layer, None)
            if observes:
                predictor.observe(ctx, ctx.step, layer, np.asarray(routed, dtype=np.int64))
            if late:
                guesses = predictor.predict(ctx, ctx.step, layer, None)
            for target, guess in guesses.items():
                d = target - layer
                if d in distances and s >= 1:
                    got = {int(e) for e in guess if 0 <= int(e) < num_experts}
                    out[(s, target, d)] = got
                    if on_guess is not None:
                        on_guess(s, layer, target, got)
    predictor.end_request()
    return out


def resident_sets(trace, share: float, policy: str) -> list:
    """[step][layer] -> set of experts of that layer resident just before
    the layer's acquire in the on-demand replay (a layer routed to nothing
    takes the set of the next acquire: nothing changes in between)."""
    from bench.lib.trace_replay import capacity_for, replay

    rep = replay(trace, capacity_for(trace, share), policy, keep_resident=True)
    E = trace.num_experts
    flat = []  # (step, layer, resident ids) of every acquire, in order
    for s, step in enumerate(trace.steps):
        routed = [la for la, experts in enumerate(step) if experts]
        flat += [(s, la, ids) for la, ids in zip(routed, rep.resident_before[s])]
    if flat:  # past the last acquire: what it left
        s, la, ids = flat[-1]
        flat.append((len(trace.steps), 0, set(ids) | {la * E + e for e in trace.steps[s][la]}))
    out, k = [], 0
    for s, step in enumerate(trace.steps):
        row = []
        for la in range(len(step)):
            while k < len(flat) - 1 and (flat[k][0], flat[k][1]) < (s, la):
                k += 1
            row.append({i - la * E for i in flat[k][2] if i // E == la})
        out.append(row)
    return out


def score(trace, guesses: dict, resident: list, steps, d: int) -> dict:
    """Pooled counts and precision/recall for distance `d` over `steps` (see
    the module's docstring): guesses {(step, target, d): set}, resident
    [step][layer] -> set."""
    seen = [set() for _ in range(trace.num_layers)]  # experts each layer routed to before step s
    for earlier in trace.steps[: steps.start]:
        for layer, experts in enumerate(earlier):
            seen[layer].update(experts)
    hits = predicted = misses = sent = targets = reachable = 0
    for s in steps:
        for target in range(d, trace.num_layers):
            res = resident[s][target]
            miss = set(trace.steps[s][target]) - res
            guess = guesses.get((s, target, d), set())
            p = guess - res
            hits += len(p & miss)
            predicted += len(p)
            misses += len(miss)
            reachable += len(miss & seen[target])
            sent += len(guess)
            targets += 1
        for layer, experts in enumerate(trace.steps[s]):
            seen[layer].update(experts)
    return {"precision": hits / predicted if predicted else None, "recall": hits / misses if misses else None,
            "hits": hits, "predicted": predicted, "misses": misses,
            "seen_before": reachable / misses if misses else None,
            "sent_per_target": sent / targets if targets else None}


def predictors(distance: int) -> dict:
    import prefetch

    return {"history": lambda: prefetch.HistoryPredictor(distance=distance),
            "trace": lambda: prefetch.TracePredictor(distance=distance),
            "previous-token": lambda: make_previous_token()(distance)}


def evaluate(traces: dict, shares, distances, policy: str) -> list:
    rows = []
    for name, trace in traces.items():
        residents = {share: resident_sets(trace, share / 100, policy) for share in shares}
        for pname, make in predictors(max(distances)).items():
            guesses = drive(trace, make(), set(distances))
            for share, d, (half, steps) in itertools.product(shares, distances, zip(HALVES, halves(trace))):
                row = {"trace": name, "policy": policy, "share": share, "predictor": pname, "distance": d,
                       "half": half, "fitted": half == "first" and name in FITTED_ON,
                       "steps": [steps.start, steps.stop - 1]}
                row.update(score(trace, guesses, residents[share], steps, d))
                rows.append(row)
    return rows


def fit(traces: dict, policy: str, share: int = 25, d: int = 1) -> list:
    """--fit: (config, precision, recall) pooled over the traces' first
    halves, best first (see the module's docstring)."""
    import prefetch

    lowest = min(FIT_GRID["threshold"])
    data = []
    for trace in traces.values():
        data.append((trace, resident_sets(trace, share / 100, policy), halves(trace)[0]))
    found = []
    names = ("decay", "sharpness", "prior", "neighbours")
    for values in itertools.product(*(FIT_GRID[k] for k in names)):
        settings = dict(zip(names, values))
        counts = {t: [0, 0, 0] for t in FIT_GRID["threshold"]}  # hits, predicted, misses
        for trace, resident, steps in data:
            p = prefetch.HistoryPredictor(distance=d, threshold=lowest, **settings)
            scored = {}

            def on_guess(s, layer, target, guess, p=p, scored=scored):
                sc = p.scores(layer, target)
                scored[(s, target)] = {e: float(sc[e]) for e in guess}

            drive(trace, p, {d}, on_guess)
            for t in FIT_GRID["threshold"]:
                kept = {(s, tl, d): {e for e, v in g.items() if v >= t} for (s, tl), g in scored.items()}
                got = score(trace, kept, resident, steps, d)
                counts[t][0] += got["hits"]
                counts[t][1] += got["predicted"]
                counts[t][2] += got["misses"]
        for t, (h, n, m) in counts.items():
            config = dict(settings, threshold=t)
            found.append((config, h / n if n else None, h / m if m else None))
    return sorted(found, key=lambda f: ((f[1] or 0) >= 0.5, f[2] or 0, f[1] or 0), reverse=True)


def print_table(rows, shares, distances) -> None:
    names = sorted({r["trace"] for r in rows}, key=[r["trace"] for r in rows].index)
    for name in names:
        halves_are = "fitted | held-out" if name in FITTED_ON else "first | second half, neither fitted on"
        print(f"\n{name}  (precision/recall of the misses; {halves_are})")
        print(f"{'predictor':<15}{'d':>2}" + "".join(f"{f'{s} %':>26}" for s in shares))
        for pname in predictors(1):
            for d in distances:
                cells = []
                for share in shares:
                    pair = []
                    for half in HALVES:
                        r = next(x for x in rows if (x["trace"], x["predictor"], x["distance"], x["share"],
                                                     x["half"]) == (name, pname, d, share, half))
                        pair.append(f"{fmt(r['precision'])}/{fmt(r['recall'])}")
                    cells.append(" | ".join(pair))
                print(f"{pname:<15}{d:>2}" + "".join(f"{c:>26}" for c in cells))
        cells = []
        for share in shares:
            pair = [next(x for x in rows if (x["trace"], x["predictor"], x["distance"], x["share"], x["half"])
                         == (name, "history", distances[0], share, half))["seen_before"] for half in HALVES]
            cells.append(" | ".join(fmt(v) for v in pair))
        print(f"{'seen before':<17}" + "".join(f"{c:>26}" for c in cells)
              + f"   (share of the misses at d={distances[0]} routed at their layer by an earlier step)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="+", default=DEFAULT_TRACES, metavar="FILE",
                        help="routing traces (docs/trace_format.md)")
    parser.add_argument("--policy", default="cyclic", help="eviction policy of the replayed cache (lru, cyclic)")
    parser.add_argument("--shares", nargs="+", type=int, default=[10, 25, 50], help="cache sizes, %% of experts")
    parser.add_argument("--distances", nargs="+", type=int, default=[1, 2, 4], help="layers ahead")
    parser.add_argument("--fit", action="store_true", help="search HistoryPredictor's settings on the first halves")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from bench.lib.trace_replay import POLICIES
    from prefetch.trace import RoutingTrace

    if args.policy not in POLICIES:
        parser.error(f"--policy must be one of {POLICIES}, got {args.policy!r}")
    if any(not 0 < s <= 100 for s in args.shares):
        parser.error(f"--shares must be in 1..100, got {args.shares}")
    if any(d < 1 for d in args.distances):
        parser.error(f"--distances must be >= 1, got {args.distances}")
    traces = {}
    for path in args.traces:
        try:
            traces[os.path.splitext(os.path.basename(path))[0]] = RoutingTrace.load(path)
        except (OSError, ValueError) as exc:
            parser.error(f"--traces: {exc}")
        if len(traces[os.path.splitext(os.path.basename(path))[0]].steps) < 3:
            parser.error(f"--traces: {path} has fewer than two decode steps (no halves)")
    report = {"benchmark": "route-ahead predictors on traces", "machine": machine_info(), "args": vars(args)}
    if args.fit:
        found = fit(traces, args.policy)
        print("fit (first halves, share 25 %, distance 1, pooled): best first")
        for config, p, r in found[:15]:
            print(f"  {config}  precision {fmt(p)} recall {fmt(r)}")
        report["fit"] = [{"config": c, "precision": p, "recall": r} for c, p, r in found]
    rows = evaluate(traces, args.shares, sorted(set(args.distances)), args.policy)
    print_table(rows, args.shares, sorted(set(args.distances)))
    report["rows"] = rows
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
