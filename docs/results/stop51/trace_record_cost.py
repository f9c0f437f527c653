"""Stop 51: RoutingTrace.add_routed against a per-layer `add`, each timed
around the call inside `generate` (a 48-layer tiny OLMoE, 64 experts, top-8,
`batched_mm`, the host backend, a trace recorded, a cache of half the
experts), the two alternating in one process, three rounds of 48 tokens.
Run from the repository root:

    python3 docs/results/stop51/trace_record_cost.py
"""
import gc
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from prefetch.integration import offload_moe_experts  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    cfg = transformers.OlmoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=48, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=32, num_experts=64,
                                   num_experts_per_tok=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm").eval()
    expert = 3 * 64 * 32 * 4  # gate, up and down of one expert, fp32
    ctl = offload_moe_experts(model, device_budget_bytes=int(0.5 * 48 * 64 * expert), backend="host",
                              progress=False, record_trace=True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))

    def generate(n):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    generate(16)  # warm-up
    trace = ctl.trace
    table_pass = trace.add_routed

    def per_layer(keys, routed):
        for step, layer in keys:
            trace.add(step, layer, np.flatnonzero(routed[layer]))

    times = {"per-layer add": [], "add_routed": []}
    for _ in range(3):
        for name, fn in (("per-layer add", per_layer), ("add_routed", table_pass)):
            def timed(*a, _fn=fn, _name=name):
                t = time.perf_counter_ns()
                _fn(*a)
                times[_name].append(time.perf_counter_ns() - t)

            trace.add_routed = timed
            gc.collect()
            ctl.new_sequence()
            generate(48)
    ctl.close()
    for name, ns in times.items():
        ns.sort()
        print(f"{name}: median {ns[len(ns) // 2] / 1e3:.1f} us, p90 {ns[int(len(ns) * 0.9)] / 1e3:.1f} us, "
              f"{len(ns)} steps")


if __name__ == "__main__":
    main()
