"""Note [One forward at a time] (prefetch/integration.py): several threads
calling one offloaded model. Each case runs in a child interpreter with a
timeout, so a deadlock fails the test instead of hanging the suite."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = """
import copy, sys, threading, time
import torch, transformers
from prefetch.integration import find_hf_moe_blocks, offload_moe_experts, NextLayerGatePredictor
torch.set_num_threads(1)
cfg = transformers.OlmoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128, intermediate_size=40,
                               num_experts=8, num_experts_per_tok=2)
torch.manual_seed(0)
ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
model = copy.deepcopy(ref)
_, ex, _ = find_hf_moe_blocks(ref)[0]
per = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * 4

def gen(m, ids):
    return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)

prompts = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(s))
           for s, n in enumerate((5, 9, 7, 4))]
want = [gen(ref, p) for p in prompts]
"""


def run(code: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SETUP) + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def test_threads_generating_on_one_offloaded_model_take_turns_and_get_their_own_tokens():
    # Two threads at once used to overwrite each other's pins: one stayed
    # pinned for good, acquires waited out the 60 s timeout, and every later
    # request failed. A cache of 3 of the 8 experts a layer makes each
    # forward copy and evict.
    out = run("""
        ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", progress=False,
                                  predictor=NextLayerGatePredictor())
        equal = {}
        def worker(i):
            for _ in range(3):
                equal.setdefault(i, []).append(bool(torch.equal(gen(model, prompts[i]), want[i])))
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):  # report() and the trace from here, during the forwards
            ctl.report()
            time.sleep(0.005)
        for t in threads:
            t.join()
        print("equal", all(all(v) for v in equal.values()) and len(equal) == 4)
        print("pinned", ctl.handle.stats()["pinned_count"])
        print("after", bool(torch.equal(gen(model, prompts[0]), want[0])))
        ctl.close()
    """)
    assert "equal True" in out and "pinned 0" in out and "after True" in out, out


def test_offloading_a_restored_model_again_does_not_nest_the_lock():
    # BM6 restores a model's experts and offloads it again, row after row:
    # each offload's wrapper replaces the last one instead of wrapping it.
    import threading
    import types

    import torch

    from prefetch.integration import _serialize_forwards

    model = torch.nn.Linear(2, 2)
    plain = model.forward
    first = types.SimpleNamespace(forward_lock=threading.RLock())
    second = types.SimpleNamespace(forward_lock=threading.RLock())
    _serialize_forwards(model, first)
    _serialize_forwards(model, second)
    assert model.forward.__wrapped__ == plain and model.forward._prefetch_lock is second.forward_lock
    x = torch.ones(1, 2)
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
