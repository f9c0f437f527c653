"""What an offloaded MoE layer adds to the resident model's, inside
transformers `generate` (diagnostic; CPU or GPU).

    python tools/layer_overhead.py [--share 1.0] [--tokens 64] [--rounds 3]
        [--predictor none|gate|oracle] [--record-trace] [--layers 16]
        [--policy lru|next-use] [--batch 1] [--json OUT]

The CPU proxy this project's host-work changes were profiled with: a tiny
16-layer OLMoE (hidden 64, 64 experts, top-8, `batched_mm`; --layers 48
gives Qwen3-30B-A3B's count of MoE layers), random fp32
weights, on the host backend (CUDA with --cuda). Every MoE layer's experts
call goes through transformers' experts-implementation interface, so the
tool times, per layer call, the whole call (ours included, for the
offloaded model) and the transformers implementation inside it: their
difference is what the offloaded path adds around the same kernels.
Alternating rounds give the resident and the offloaded model's ms per
token; then one more offloaded generate times the controller's per-step and
per-layer methods (us per call). The budget is --share of every expert's
bytes; with --predictor oracle the routing the untouched model would make
is recorded first and replayed; --predictor gate is the next-layer gate;
--record-trace records the offloaded model's routing (as BM6's engine rows
do). The figures of a noisy 2-core machine are
ratios to compare within one run, not targets.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TIMED = ("read_routings", "choose_path", "pin_layer", "_pin_all", "note_routing", "queue_read_back",
          "release_held", "begin_layer", "exchange")


def build(torch, transformers, device, layers: int = 16):
    cfg = transformers.OlmoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=32, num_experts=64,
                                   num_experts_per_tok=8, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm").eval().to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=1.0, help="device budget / all expert bytes")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--predictor", choices=["none", "gate", "oracle"], default="none")
    parser.add_argument("--record-trace", action="store_true", help="the offloaded model records its routing")
    parser.add_argument("--layers", type=int, default=16, help="MoE layers of the tiny model")
    parser.add_argument("--policy", choices=["lru", "next-use"], default="lru")
    parser.add_argument("--cuda", action="store_true", help="the CUDA backend on GPU 0")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.share <= 4 or args.tokens < 2 or args.rounds < 1 or args.batch < 1 or not 1 <= args.layers <= 256:
        parser.error("need 0 < --share <= 4, --tokens >= 2, --rounds >= 1, --batch >= 1, 1 <= --layers <= 256")

    import torch
    import transformers
    import transformers.integrations.moe as moe

    from prefetch.hf import find_hf_moe_blocks
    from prefetch.integration import NextLayerGatePredictor, OraclePredictor, offload_moe_experts

    if args.cuda and not torch.cuda.is_available():
        print("--cuda: no CUDA device: not measured", file=sys.stderr)
        return 2
    device = "cuda" if args.cuda else "cpu"
    torch.set_num_threads(1)
    ref = build(torch, transformers, device, args.layers)
    _, experts, _ = find_hf_moe_blocks(ref)[0]
    per = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.gate_up_proj.element_size()
    total = per * ref.config.num_hidden_layers * ref.config.num_experts
    ids = torch.randint(0, ref.config.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    backend = "cuda" if args.cuda else "host"

    def gen(m, n):
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)

    def sync():
        if args.cuda:
            torch.cuda.synchronize()

    predictor = None
    if args.predictor == "oracle":
        recorder = copy.deepcopy(ref)
        rec = offload_moe_experts(recorder, device_budget_bytes=2 * total, backend=backend, progress=False,
                                  record_trace=True)
        gen(recorder, args.tokens)
        rec.close()
        predictor = OraclePredictor(rec.trace)
    elif args.predictor == "gate":
        predictor = NextLayerGatePredictor()
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=int(args.share * total), backend=backend, progress=False,
                              predictor=predictor, handle_options={"eviction_policy": args.policy},
                              record_trace=args.record_trace)
    # Time the prefetch wrapper of batched_mm (the whole call) and the
    # transformers implementation it calls (inside it).
    acc = {"outer": 0, "inner": 0, "n": 0}
    wrapped = moe.ALL_EXPERTS_FUNCTIONS["batched_mm"]
    original = moe.batched_mm_experts_forward

    def inner(*a, **k):
        t = time.perf_counter_ns()
        out = original(*a, **k)
        acc["inner"] += time.perf_counter_ns() - t
        return out

    def outer(self, *a, **k):
        t = time.perf_counter_ns()
        out = wrapped(self, *a, **k)
        acc["outer"] += time.perf_counter_ns() - t
        acc["n"] += 1
        return out

    cells = [c for c in wrapped.__closure__ or () if c.cell_contents is original]
    if not cells:
        print("this transformers' batched_mm is not the one the wrapper calls: not measured", file=sys.stderr)
        return 2
    moe.ALL_EXPERTS_FUNCTIONS["batched_mm"] = outer
    cells[0].cell_contents = inner
    rows = []
    try:
        for m in (ref, model):
            gen(m, args.tokens + 16)  # warm-up
        for r in range(args.rounds):
            for name, m in (("resident", ref), ("offloaded", model)):
                acc.update(outer=0, inner=0, n=0)
                if m is model:
                    ctl.new_sequence()
                sync()
                t0 = time.perf_counter()
                gen(m, args.tokens)
                sync()
                ms = (time.perf_counter() - t0) / args.tokens * 1e3
                n = acc["n"]
                rows.append({"round": r, "model": name, "ms_per_token": ms,
                             "call_us": acc["outer"] / n / 1e3, "impl_us": acc["inner"] / n / 1e3})
                print(f"round {r} {name:9s} {ms:6.2f} ms/token  per layer call: whole {rows[-1]['call_us']:6.1f} us,"
                      f" transformers' implementation {rows[-1]['impl_us']:6.1f} us")
        calls = {}
        originals = {}
        for meth in _TIMED:
            f = getattr(ctl, meth, None)
            if f is None:
                continue
            originals[meth] = f

            def timed(*a, _f=f, _m=meth, **k):
                t = time.perf_counter_ns()
                try:
                    return _f(*a, **k)
                finally:
                    c = calls.setdefault(_m, [0, 0])
                    c[0] += time.perf_counter_ns() - t
                    c[1] += 1
            setattr(ctl, meth, timed)
        ctl.new_sequence()
        gen(model, args.tokens)
        for meth in originals:
            delattr(ctl, meth)
        report = ctl.report()
    finally:
        moe.ALL_EXPERTS_FUNCTIONS["batched_mm"] = wrapped
        cells[0].cell_contents = original
        ctl.close()
    per_call = {m: {"us": t / n / 1e3, "calls": n} for m, (t, n) in calls.items()}
    for m, v in per_call.items():
        print(f"  {m:16s} {v['us']:7.1f} us x {v['calls']}")
    summary = {}
    for name in ("resident", "offloaded"):
        mine = [r for r in rows if r["model"] == name]
        summary[name] = {k: statistics.median(r[k] for r in mine) for k in ("ms_per_token", "call_us", "impl_us")}
    summary["offloaded_over_resident"] = summary["offloaded"]["ms_per_token"] / summary["resident"]["ms_per_token"]
    keys = ("hit_rate", "host_us_per_layer", "engine_us_per_layer", "sync_us_per_layer", "steady_steps",
            "speculation_paused_layers")
    print(f"offloaded / resident {summary['offloaded_over_resident']:.3f} (medians);",
          {k: report.get(k) for k in keys})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rounds": rows, "summary": summary, "methods_us": per_call,
                       "report": {k: report.get(k) for k in keys}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
