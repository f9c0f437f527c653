"""BM5's decode step on the CPU: the host work of each row, phase by phase
(diagnostic; CPU only).

    python3 tools/bm5_host_proxy.py TRACE.json [--model gemma4-26b-a4b]
        [--share 1.0] [--steps 24] [--warmup 4] [--rounds 2]
        [--policies all-resident on-demand oracle torch-by-hand] [--json OUT]

BM5 replaying a real trace at batch 1 is host-bound on the H200 (run 96:
the GPU busy 7.8 ms of a 19-25 ms resident step), and its engine rows
spend more host time per layer than the resident row in every phase, the
compute launch included, whose code is the same in every row (runs 39,
71, 112). This runs bench/e2e.py's decoder and providers as they are, at
the model's layer, expert and top-k counts and the trace's routing, with
tiny matrices (hidden 64, intermediate 32) on the CPU, so a step is mostly
host work:

  - torch on one thread (its second thread would take the core the
    engine's threads need on a 2-core machine);
  - the engine on the fault backend in its asynchronous mode, which takes
    the CUDA backend's paths (an acquirer issues its own misses, copies
    complete through tokens) with the bytes copied at once, instead of the
    host backend's memcpy on a worker that the acquirer waits for (a
    worker round trip per miss: 100-120 us a call on the 2-core VM, a cost
    the CUDA path does not have);
  - with --share 1.0 (default) every engine row preloads every expert
    before the measured steps, so it copies nothing and what differs from
    the resident row is its host work alone (the replay otherwise reads
    experts for the first time all through the trace's first steps). The
    by-hand LRU has no preload: its first reads copy ("copied", experts
    copied in the measured steps).

--policies may also name rows of this tool's own, each on-demand with
parts taken away, so that the differences between them say what each part
costs inside the step:
  on-demand-bare   on-demand's engine call, slot send and gathers with the
                   controller left out (one handle.step a layer on the
                   layer's tensor ids);
  bare-no-engine   on-demand-bare with the engine call replaced by a
                   lookup of the same (offset, device) rows, made once;
  arena-table      the resident row's path on the engine's cache: the
                   routed experts' slots looked up on the device from a
                   table made once and gathered from the arena's slot
                   views, no engine call, no slot send; what an engine row
                   would cost if its bookkeeping were free.

Prints per row and round the step's p50 (ms), its ratio to the round's
resident p50 and the host microseconds per layer of each phase of
Decoder.step (speculate, sync, acquire, compute launch, release, and the
rest of the step as "other") and the engine calls inside them. Rows run in
turn within each round, in the order given, round r starting at the r-th.
Compare within one run: the same resident step took 11.5-19 ms on the
2-core development VM in one session and 7.6-8.3 ms on the H200 machine's
host (run 114, `tools/h200_run.sh OUT hostproxy`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.e2e_decoder import MODELS, Decoder, measure_steps  # noqa: E402
from bench.e2e_providers import make_provider, policy_eviction  # noqa: E402

POLICIES = ("all-resident", "on-demand", "oracle", "torch-by-hand")
# Diagnostic rows of this tool's own: on-demand with parts taken away.
BARE = "on-demand-bare"
NO_ENGINE = "bare-no-engine"
ARENA = "arena-table"


class BareEngineProvider:
    """On-demand without the controller: each layer's acquire is one
    handle.step on the layer's tensor ids (releasing the last layer's), its
    slots sent and gathered as EngineProvider.acquire_stacked does. No
    scoring, trace, clock or counters: the difference to the on-demand row
    is what the controller's Python costs inside the decode step."""

    def __init__(self, inner):
        self.inner = inner  # an on-demand EngineProvider: its handle, views and slot rows
        self.handle = inner.handle
        self.ctl = inner.ctl  # for preload_all
        self._table = inner.ctl.prefetcher._ids
        self._held = None

    def acquire_stacked(self, layer, x, experts, routed):
        inner = self.inner
        ids = self._table[layer][experts]
        where = self.handle.step(ids, release=self._held, stream=inner.dec.stream(layer))
        self._held = ids
        return inner.gather(layer, where)

    def release(self, layer, experts):
        if layer == self.inner.dec.spec["layers"] - 1:
            self.handle.release(self._held, stream=self.inner.dec.stream(layer))
            self._held = None

    def stats(self):
        return {"bytes": self.handle.stats()["bytes_copied"]}

    def close(self):
        self.inner.close()


class NoEngineProvider(BareEngineProvider):
    """BareEngineProvider with its engine call replaced by a lookup of the
    same rows: every expert is acquired once (after the preload) to learn
    its (offset, device) row, then released; each layer then takes its
    experts' rows from that table (one numpy index, as the tensor ids are)
    and sends and gathers them as the bare row does. The cache never
    changes (every expert resident, nothing acquired), so the rows stay
    right."""

    def __init__(self, inner):
        super().__init__(inner)
        self._rows = None

    def learn_rows(self):
        dec = self.inner.dec
        self._rows = []
        for layer in range(dec.spec["layers"]):
            ids = self._table[layer]
            stream = dec.stream(layer)
            self._rows.append(self.handle.step(ids, stream=stream))
            self.handle.release(ids, stream=stream)

    def acquire_stacked(self, layer, x, experts, routed):
        self._table[layer][experts]  # the tensor-id lookup the bare row makes
        return self.inner.gather(layer, self._rows[layer][experts])

    def release(self, layer, experts):
        pass


class ArenaTableProvider(NoEngineProvider):
    """The resident provider's path on the engine's arena: each layer's
    expert -> slot table on the device (made once from the learned rows),
    indexed with the routing's device tensor and gathered from the arena's
    slot views, as the resident row gathers from its pool."""

    def learn_rows(self):
        super().learn_rows()
        torch, dec = self.inner.torch, self.inner.dec
        self._slots = [torch.from_numpy(rows[:, 0] // dec.slot_bytes).to(dec.devs[dec.layer_dev[layer]])
                       for layer, rows in enumerate(self._rows)]

    def acquire_stacked(self, layer, x, experts, routed):
        inner = self.inner
        slots = self._slots[layer].index_select(0, routed)
        gate_up, down = inner._views(inner.dec.layer_dev[layer])
        return gate_up.index_select(0, slots), down.index_select(0, slots)


def fault_handles(prefetch):
    """Makes every PrefetchHandle the providers build use the fault backend
    in its asynchronous mode (the CUDA paths, bytes copied at once).
    Returns a function that undoes it."""
    real = prefetch.PrefetchHandle

    def handle(**kwargs):
        return real(**{**kwargs, "backend": "fault", "faults": {"report_async": 1}})

    prefetch.PrefetchHandle = handle

    def undo():
        prefetch.PrefetchHandle = real

    return undo


def preload_all(provider, slots: int, expected: int, limit_s: float = 60.0) -> None:
    """Queues every expert and waits until all `expected` are resident."""
    provider.ctl.preload(slots)
    deadline = time.monotonic() + limit_s
    while provider.handle.stats()["resident_count"] < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"preload: {provider.handle.stats()['resident_count']} of {expected} experts "
                               f"resident after {limit_s:.0f} s")
        time.sleep(0.005)


def run_row(torch, dec, policy, inputs, warmup, budget, trace, route, preload: bool) -> dict:
    diagnostic = {BARE: BareEngineProvider, NO_ENGINE: NoEngineProvider, ARENA: ArenaTableProvider}
    if policy in diagnostic:
        provider = diagnostic[policy](make_provider(dec, "on-demand", budget, trace, "cyclic"))
    else:
        provider = make_provider(dec, policy, budget, trace, policy_eviction(policy, "cyclic"))
    try:
        if preload and hasattr(provider, "ctl"):
            spec = dec.spec
            preload_all(provider, budget // dec.slot_bytes, spec["layers"] * spec["experts"])
        if hasattr(provider, "learn_rows"):
            provider.learn_rows()
        timers = {}
        lat, before, after = measure_steps(dec, provider, inputs, warmup, route, timers=timers)
    finally:
        if hasattr(provider, "close"):
            provider.close()
    per_layer = 1e6 / (len(lat) * dec.spec["layers"])
    phases = {name: seconds * per_layer for name, seconds in sorted(timers.items())}
    # The rest of the step (norms, attention, router, top-k, the routing's
    # sort): the same code in every row. Means, as the phases are.
    # The acquire's parts (Note [The acquire's parts]) are inside acquire.
    phases["other"] = sum(lat) * per_layer - sum(v for k, v in phases.items() if not k.startswith("acquire."))
    if "engine_ns" in after:
        phases["engine"] = (after["engine_ns"] - before.get("engine_ns", 0)) * per_layer / 1e9  # as run_policy
    copies = None
    if "bytes" in after:
        copies = (after["bytes"] - before.get("bytes", 0)) // dec.expert_bytes
    return {"policy": policy, "p50_ms": statistics.median(lat) * 1e3, "host_us_per_layer": phases,
            "experts_copied": copies}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="layer/expert/top-k counts (default: the model whose counts the trace has)")
    parser.add_argument("--share", type=float, default=1.0, help="cache budget / all expert bytes")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.share <= 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("need 0 < --share <= 1, --steps >= 1, --warmup >= 0, --rounds >= 1")
    if args.share < 1 and {NO_ENGINE, ARENA} & set(args.policies):
        parser.error(f"{NO_ENGINE} and {ARENA} need every expert cached (--share 1.0): "
                     "their cache must not change")
    if "all-resident" not in args.policies:
        parser.error("--policies needs all-resident (the reference of every ratio)")

    import torch

    import prefetch
    from prefetch.integration import RoutingTrace

    torch.set_num_threads(1)
    trace = RoutingTrace.load(args.trace)
    name = args.model or next((m for m, s in MODELS.items()
                               if (s["layers"], s["experts"]) == (trace.num_layers, trace.num_experts)), None)
    if name is None:
        parser.error(f"no model in bench/e2e_decoder.py has the trace's {trace.num_layers} layers x "
                     f"{trace.num_experts} experts: name one with --model")
    model = MODELS[name]
    if (model["layers"], model["experts"]) != (trace.num_layers, trace.num_experts):
        parser.error(f"--model {name} has {model['layers']} x {model['experts']}, the trace "
                     f"{trace.num_layers} x {trace.num_experts}")
    steps = trace.steps[1:] or trace.steps  # as BM5's --trace-from 1
    spec = dict(model, hidden=64, inter=32, name=f"{name} (tiny matrices)")
    dec = Decoder(torch, spec, 8, device="cpu")
    inputs = dec.inputs(args.warmup + args.steps, 1, seed=1)

    def route(i):
        return steps[i % len(steps)]

    total = spec["layers"] * spec["experts"] * dec.slot_bytes
    budget = max(dec.slot_bytes * spec["top_k"], int(args.share * total) // dec.slot_bytes * dec.slot_bytes)
    # The oracle replays the routing the decoder takes (the resident row's).
    recorder = make_provider(dec, "all-resident", budget, None)
    measure_steps(dec, recorder, inputs, args.warmup, route)
    undo = fault_handles(prefetch)
    rows = []
    try:
        for r in range(args.rounds):
            # Round r starts at row r: the first row of a round ran slower
            # than the same row later in it on the development VM (stop 37
            # in docs/results.md), so each row takes each place in turn.
            k = r % len(args.policies)
            order = args.policies[k:] + args.policies[:k]
            got = {p: run_row(torch, dec, p, inputs, args.warmup, budget, recorder.trace, route,
                              preload=args.share >= 1) for p in order}
            base = got["all-resident"]["p50_ms"]
            for policy in args.policies:
                row = dict(got[policy], round=r, x_resident=got[policy]["p50_ms"] / base)
                rows.append(row)
                phases = "  ".join(f"{k} {v:6.1f}" for k, v in row["host_us_per_layer"].items())
                copied = "-" if row["experts_copied"] is None else row["experts_copied"]
                print(f"round {r} {policy:<14} {row['p50_ms']:7.2f} ms  x{row['x_resident']:.2f}  "
                      f"copied {copied}  us/layer: {phases}", flush=True)
    finally:
        undo()
        dec.remove_pool_file()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "bm5_host_proxy", "trace": os.path.basename(args.trace), "model": name,
                       "share": args.share, "steps": args.steps, "warmup": args.warmup, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
