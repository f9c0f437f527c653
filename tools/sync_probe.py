"""Where an offloaded generate makes the host wait for the GPU (diagnostic).

    python tools/sync_probe.py [--model qwen3-30b-a3b] [--share 0.25] [--rows on-demand gate oracle]
        [--prompt-tokens 512] [--new-tokens 8] [--json OUT.json]
    python tools/sync_probe.py --smoke-cpu [--json OUT.json]

A synchronizing CUDA call on the serving thread (a pageable copy, a
`.item()`, a `torch.nonzero`, a `cudaStreamSynchronize`) holds the host
until everything queued on the stream has run, including the waits on the
engine's expert copies. This runs bench/generate.py's model (random bf16
weights on the GPU) offloaded at --share of its expert bytes, once for the
prefill of a --prompt-tokens prompt (time to first token) and once for
a 16-token prompt and --new-tokens decode steps after it, each under torch's sync debug mode "warn", and
counts the synchronizing calls torch reports by their Python call site
(the innermost frames in prefetch/, transformers/ and bench/). Each phase
also runs once more without the debug mode, untimed by it, for its wall
time. The routing read-back (Note [Read-back without a pageable copy] in
prefetch/read_back.py) waits on an event and is not among what torch
reports. Nothing here is a target figure.

--smoke-cpu runs a tiny model on the CPU: torch's debug mode watches CUDA
only, so every count is null there ("no CUDA"); it checks the tool runs.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.generate_model import MODELS, SMOKE_MODELS, ModelState, build_model, generate, make_sync  # noqa: E402
from bench.generate_modes import EngineMode  # noqa: E402

ROWS = ("on-demand", "gate", "oracle")
KEEP = (os.sep + "prefetch" + os.sep, os.sep + "transformers" + os.sep, os.sep + "bench" + os.sep)


def call_site(frames, depth: int = 3) -> str:
    """The innermost `depth` frames of `frames` (a traceback.extract_stack
    list, outermost first) that lie in prefetch/, transformers/ or bench/,
    innermost first, as "file:line function" joined by " <- "."""
    kept = [f for f in reversed(frames) if any(k in f.filename for k in KEEP)]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in kept[:depth]) or "(elsewhere)"


class SyncCounter:
    """While active: torch's sync debug mode "warn", and each warning it
    raises counted by its call site."""

    def __init__(self, torch, cuda: bool):
        self.torch = torch
        self.cuda = cuda
        self.sites = collections.Counter()

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                self.sites[call_site(traceback.extract_stack()[:-1])] += 1
            # Other warnings are dropped here: the probe reports syncs only.

        warnings.showwarning = show
        if self.cuda:
            self._mode = self.torch.cuda.get_sync_debug_mode()
            self.torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.set_sync_debug_mode(self._mode)
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)
        return False

    def result(self):
        if not self.cuda:
            return None
        return {"total": sum(self.sites.values()), "sites": dict(self.sites.most_common())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=list(MODELS))
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--smoke-cpu", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not 0 < args.share <= 1:
        parser.error("--share must be in (0, 1]")
    import torch

    from prefetch.integration import RoutingTrace

    cuda = not args.smoke_cpu
    if cuda and not torch.cuda.is_available():
        print("needs CUDA (or --smoke-cpu): not measured", file=sys.stderr)
        return 1
    name = "smoke-qwen3-moe" if args.smoke_cpu else args.model
    family, shape = (SMOKE_MODELS if args.smoke_cpu else MODELS)[name]
    device = "cuda" if cuda else "cpu"
    vocab = 32000 if cuda else 256
    prompt_tokens = args.prompt_tokens if cuda else min(args.prompt_tokens, 16)
    model = build_model(torch, family, shape, vocab, device, torch.bfloat16 if cuda else torch.float32)
    state = ModelState(model)
    sync = make_sync(torch, cuda, "stream")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, vocab, (1, prompt_tokens), generator=g).to(device)
    short = torch.randint(1, vocab, (1, 16), generator=g).to(device)
    # The resident model's routing of both generates, for the oracle, and
    # its shapes warmed (Note [Warm every sequence length] in
    # bench/generate_model.py).
    from bench.generate_model import RoutingRecorder

    traces = []
    for ids, tokens in ((prompt, 1), (short, args.new_tokens + 1)):
        rec = RoutingRecorder(model)
        try:
            generate(torch, model, ids, tokens, sync)
        finally:
            rec.close()
        traces.append(RoutingTrace(state.num_layers, state.num_experts, rec.steps()[:tokens]))
    prefill_trace, decode_trace = traces
    budget = int(args.share * state.total_bytes)
    rows = {}
    for row in args.rows:
        out = {}
        for phase, ids, tokens, trace in (("prefill", prompt, 1, prefill_trace),
                                          ("decode", short, args.new_tokens + 1, decode_trace)):
            ctl = EngineMode(model, budget, row, trace, cuda).ctl  # as BM6's engine rows offload
            try:
                generate(torch, model, short, 2, sync)  # the offloaded path's first calls, outside the count
                ctl.new_sequence()
                counter = SyncCounter(torch, cuda)
                with counter:
                    generate(torch, model, ids, tokens, sync)
                ctl.new_sequence()
                _, t0, t1 = generate(torch, model, ids, tokens, sync)
                out[phase] = {"syncs": counter.result(), "wall_ms": (t1 - t0) * 1e3, "tokens": tokens}
            finally:
                ctl.close()
                state.restore()
                # The closed offload's views of its arena go with the
                # model's reference cycles: collected now, so the next
                # row's cache fits (run 99's oracle row ran out of memory
                # beside five uncollected arenas).
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        rows[row] = out
        print(json.dumps({row: out}, indent=1), flush=True)
    result = {"tool": "sync_probe", "model": name, "share": args.share, "prompt_tokens": prompt_tokens,
              "new_tokens": args.new_tokens, "cuda": cuda,
              "note": None if cuda else "no CUDA: torch's sync debug mode watches CUDA only, counts are null",
              "rows": rows, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
