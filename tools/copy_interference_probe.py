"""Does host-to-device copy traffic slow the serving thread's own work?
(diagnostic; CUDA, or --smoke-cpu)

    python tools/copy_interference_probe.py [--model gpt-oss-120b] [--steps 12]
        [--rounds 4] [--pool 16] [--json OUT.json]

In BM5's IO-bound cells (gpt-oss-120b at a quarter of the experts cached)
every policy's step took longer than the resident model's plus its own
timed work: the decoder's untimed work (attention, router, top-k; the same
code in every row) took about 40 % longer per layer in the engine rows and
in the by-hand row alike (run 83), and the by-hand row has no thread of
ours. This probe runs BM5's resident decoder (every expert on the GPU, no
copy of its own) under each setting, in turn within every round, so each
sees the same drift of the host:

  quiet    nothing else runs
  dma      before each step, copies from one page-locked buffer to the
           GPU are queued on a side stream, as many bytes as the link moves
           in --cover times the last quiet step; no other thread
  thread   a second thread copies without pause (64 MiB copy_, then
           waits on its stream, which spins in the driver as the engine's
           copy workers' event waits do under the default context flags)
  thread-block  the same, waiting on an event made with blocking sync
           (the thread sleeps in the driver instead of spinning)

(A Python thread that spins holding the GIL is no setting here: it made
each step take seconds, run 84.)

Prints per setting the step p50 (ms) and the decoder's host phases (us per
layer), and per round each setting's p50 over quiet's. Nothing here is a
target figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = ("quiet", "dma", "thread", "thread-block")
MIB = 1 << 20


class Background:
    """The "thread" and "thread-block" settings' second thread, started
    and stopped around a setting's steps."""

    def __init__(self, torch, kind: str, src, dst, cuda: bool):
        self.torch, self.kind, self.src, self.dst, self.cuda = torch, kind, src, dst, cuda
        self.stop = threading.Event()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        torch = self.torch
        stream = torch.cuda.Stream() if self.cuda else None
        done = torch.cuda.Event(blocking=True) if self.cuda and self.kind == "thread-block" else None
        while not self.stop.is_set():
            if self.cuda:
                with torch.cuda.stream(stream):
                    self.dst.copy_(self.src, non_blocking=True)
                if done is not None:
                    done.record(stream)
                    done.synchronize()
                else:
                    stream.synchronize()
            else:
                self.dst.copy_(self.src)
            self.bytes += self.src.numel()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-oss-120b")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per setting and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pool", type=int, default=16, help="distinct experts the decoder holds")
    parser.add_argument("--cover", type=float, default=1.0,
                        help="dma: bytes queued per step, as link time over the last quiet step")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke-cpu", action="store_true", help="a tiny decoder on the CPU: checks the "
                        "probe runs, measures nothing of the GPU machine")
    args = parser.parse_args(argv)

    import torch

    from bench.e2e_decoder import MODELS, Decoder
    from bench.e2e_providers import ResidentProvider

    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: not measured", file=sys.stderr)
        return 2
    cuda = not smoke
    if smoke:
        spec = dict(layers=3, experts=8, top_k=2, hidden=64, inter=32, name="smoke")
    else:
        spec = dict(MODELS[args.model], name=args.model)
    dec = Decoder(torch, spec, args.pool, device="cuda" if cuda else "cpu")
    provider = ResidentProvider(dec)
    inputs = dec.inputs(args.steps + 2, 1, seed=1)
    chunk = (64 if cuda else 1) * MIB
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(7)
    dst = torch.empty(chunk, dtype=torch.uint8, device=dec.device)
    side = torch.cuda.Stream() if cuda else None
    rate = None
    if cuda:  # the link's rate for the dma setting, from this buffer
        for _ in range(2):
            t0 = time.perf_counter()
            for _ in range(8):
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
            side.synchronize()
            rate = 8 * chunk / (time.perf_counter() - t0)

    def steps(setting: str, last_quiet_s: float | None):
        timers = {}
        lat = []
        queued = 0
        for i, x in enumerate(inputs):
            dec.sync()
            if setting == "dma" and cuda and i >= 2 and last_quiet_s:
                n = max(1, int(rate * last_quiet_s * args.cover / chunk))
                with torch.cuda.stream(side):
                    for _ in range(n):
                        dst.copy_(src, non_blocking=True)
                queued += n * chunk
            dec.timers = timers if i >= 2 else None
            t0 = time.perf_counter()
            dec.step(x, provider)
            dec.sync()
            dec.timers = None
            if i >= 2:
                lat.append(time.perf_counter() - t0)
            if side is not None:
                side.synchronize()  # the next step starts with the link free
        per_layer = 1e6 / (len(lat) * spec["layers"])
        return statistics.median(lat), {k: v * per_layer for k, v in sorted(timers.items())}, queued

    results = {s: [] for s in SETTINGS}
    ratios = {s: [] for s in SETTINGS if s != "quiet"}
    t_start = time.perf_counter()
    last_quiet = None
    for r in range(args.rounds):
        for s in SETTINGS:
            if s.startswith("thread"):
                with Background(torch, s, src, dst, cuda) as bg:
                    p50, phases, _ = steps(s, last_quiet)
                moved = bg.bytes
            else:
                p50, phases, moved = steps(s, last_quiet)
            if s == "quiet":
                last_quiet = p50
            out = {"p50_ms": p50 * 1e3, "host_us_per_layer": phases, "bytes_copied": moved}
            results[s].append(out)
            if s != "quiet":
                ratios[s].append(p50 / last_quiet)
            print(f"round {r} {s:7s} p50 {p50 * 1e3:7.2f} ms  "
                  + " ".join(f"{k} {v:.0f}" for k, v in phases.items()) + f"  copied {moved / 1e9:.2f} GB",
                  flush=True)
    summary = {}
    for s in SETTINGS:
        p50s = [o["p50_ms"] for o in results[s]]
        phases = {k: statistics.median(o["host_us_per_layer"].get(k, 0.0) for o in results[s])
                  for k in results[s][0]["host_us_per_layer"]}
        summary[s] = {"p50s_ms": p50s, "host_us_per_layer_median": phases,
                      "ratio_to_quiet_median": statistics.median(ratios[s]) if s in ratios else 1.0,
                      "ratios_to_quiet": ratios.get(s, [])}
        print(f"{s:7s} p50 {min(p50s):7.2f}-{max(p50s):7.2f} ms  x quiet {summary[s]['ratio_to_quiet_median']:.3f}  "
              + " ".join(f"{k} {v:.0f}" for k, v in phases.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "link_gbps": rate / 1e9 if rate else None, "summary": summary,
                       "results": results, "wall_s": time.perf_counter() - t_start}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
