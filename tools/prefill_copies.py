"""The engine's counters over one prefill that follows another request
(diagnostic; CPU): BM6's time-to-first-token cell in copies, not time.

    python tools/prefill_copies.py [--prompt 512] [--batch 8] [--share 0.25]
        [--decode-tokens 16] [--no-request-start-hints] [--json OUT]

The tiny 16-layer OLMoE of tools/layer_overhead.py (64 experts, top-8,
`batched_mm`, fp32) on the host backend. Per row (on-demand, then the
oracle on a next-use handle): a fresh offload at --share of every expert's
bytes decodes --decode-tokens tokens of one prompt (the oracle replaying
that prompt's routing, recorded first), then `new_sequence`, then one
prefill of a --prompt x --batch prompt of other tokens (the oracle replaying
that prompt's routing). The figures are the engine's counters over that
prefill: copies, misses, evictions. A prefill routes to nearly every
expert, so what it copies is what the earlier request left resident and the
eviction policy kept. --no-request-start-hints turns off the oracle's hints
at a request's start (Note [Hints at a request's start]), for the A/B. The
counts depend on the copy workers' timing only through when a prefetch
lands; the ms are of a 2-core VM and mean nothing on a GPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_KEYS = ("copies", "bytes_copied", "misses", "hits", "evictions", "wasted", "declined", "cancelled")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--share", type=float, default=0.25, help="device budget / all expert bytes")
    parser.add_argument("--decode-tokens", type=int, default=16, help="the request before the prefill")
    parser.add_argument("--no-request-start-hints", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.prompt < 1 or args.batch < 1 or args.decode_tokens < 1 or not 0 < args.share <= 4:
        parser.error("need --prompt, --batch, --decode-tokens >= 1 and 0 < --share <= 4")

    import torch
    import transformers
    from layer_overhead import build

    from prefetch.hf import find_hf_moe_blocks
    from prefetch.integration import OraclePredictor, offload_moe_experts

    torch.set_num_threads(1)  # as layer_overhead; also keeps OpenMP threads out of the TSan suite
    ref = build(torch, transformers, "cpu")
    _, experts, _ = find_hf_moe_blocks(ref)[0]
    per = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.gate_up_proj.element_size()
    total = per * ref.config.num_hidden_layers * ref.config.num_experts
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, ref.config.vocab_size, (args.batch, 32), generator=gen)
    prompt = torch.randint(0, ref.config.vocab_size, (args.batch, args.prompt), generator=gen)

    def generate(model, ids, n):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)

    def record(ids, n):
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=2 * total, backend="host", progress=False,
                                  record_trace=True)
        generate(model, ids, n)
        ctl.close()
        return ctl.trace

    traces = {"first": record(first, args.decode_tokens), "prompt": record(prompt, 1)}
    rows = []
    for name in ("on-demand", "oracle"):
        model = copy.deepcopy(ref)
        oracle = name == "oracle"
        ctl = offload_moe_experts(model, device_budget_bytes=int(args.share * total), backend="host",
                                  progress=False, predictor=OraclePredictor(traces["first"]) if oracle else None,
                                  handle_options={"eviction_policy": "next-use"} if oracle else None)
        try:
            generate(model, first, args.decode_tokens)
            ctl.new_sequence()
            if oracle:
                ctl.predictor = OraclePredictor(traces["prompt"])
                ctl.predictor._primed = args.no_request_start_hints
            before = ctl.handle.stats()
            t0 = time.perf_counter()
            out = generate(model, prompt, 1)
            ms = (time.perf_counter() - t0) * 1e3
            after = ctl.handle.stats()
        finally:
            ctl.close()
        want = generate(ref, prompt, 1)
        row = {"row": name, "ms": ms, "tokens_equal": bool(torch.equal(out, want)),
               **{k: after[k] - before[k] for k in _KEYS}}
        rows.append(row)
        print(f"{name:9s} copies {row['copies']:5d}  misses {row['misses']:4d}  evictions {row['evictions']:5d}  "
              f"wasted {row['wasted']:3d}  declined {row['declined']:3d}  tokens equal {row['tokens_equal']}  "
              f"({ms:.0f} ms on this host)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "expert_bytes": per, "rows": rows}, f, indent=1)
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
