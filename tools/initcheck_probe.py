"""Whose reads does compute-sanitizer's initcheck report in a bf16
grouped_mm decode? (diagnostic; GPU only)

    compute-sanitizer --tool initcheck python3 tools/initcheck_probe.py resident
    compute-sanitizer --tool initcheck python3 tools/initcheck_probe.py offloaded

`resident`: the untouched tiny Qwen3-MoE of tests/test_integration.py in
bf16 with transformers' grouped_mm, greedy decode, no prefetch at all.
`offloaded`: the same model offloaded with every expert cached and the
preload waited for, as tests/test_integration.py::test_wait_preloaded_on_gpu
does. If the resident run is reported too, the reads are torch's kernel's
own, not of memory the engine left unwritten."""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_integration import build, expert_bytes, family_configs, greedy  # noqa: E402

from prefetch.integration import offload_moe_experts  # noqa: E402


def main(mode: str) -> None:
    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, device="cuda", dtype=torch.bfloat16, experts_implementation="grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
    if mode == "resident":
        seq, _ = greedy(ref, ids)
    else:
        model = copy.deepcopy(ref)
        per, num_experts = expert_bytes(model)
        ctl = offload_moe_experts(model, device_budget_bytes=num_experts * cfg.num_hidden_layers * (per + 512),
                                  backend="cuda")
        try:
            assert ctl.wait_preloaded(timeout=60)
            seq, _ = greedy(model, ids)
        finally:
            ctl.close()
    torch.cuda.synchronize()
    print(mode, "tokens", seq.tolist())


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("resident", "offloaded"):
        sys.exit("usage: initcheck_probe.py resident|offloaded")
    main(sys.argv[1])
