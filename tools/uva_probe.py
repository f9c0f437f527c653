"""Probe: can one strided CUDA tensor address both the engine's device arena
and page-locked host memory (UVA), so an experts implementation reads a
cached expert from the arena and a missing one straight from host memory,
with no host sync? Checks the bytes, and times the zero-copy gather against
a copy-engine copy of the same bytes.

    python3 tools/uva_probe.py [--json PATH]
"""
import argparse
import json
import time

import torch


class _Raw:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def universe(arena, host, stride):
    """A [rows, stride] uint8 CUDA tensor starting at the lower of the two
    buffers; returns (tensor, first arena row, first host row)."""
    a, h = arena.data_ptr(), host.data_ptr()
    base = min(a, h)
    assert (a - base) % stride == 0 and (h - base) % stride == 0, "buffers off the common grid"
    end = max(a + arena.numel(), h + host.numel())
    flat = torch.as_tensor(_Raw(base, end - base), device="cuda")
    rows = (end - base) // stride
    return flat[: rows * stride].view(rows, stride), (a - base) // stride, (h - base) // stride


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    out = {}
    S = 2048 * 1024 * 2 * 3  # one OLMoE expert in bf16 (gate_up 2048x2048 + down 2048x1024)
    n_host, n_arena = 64, 16
    host_raw = torch.empty((n_host + 1) * S, dtype=torch.uint8)
    arena = torch.empty(n_arena * S + S, dtype=torch.uint8, device="cuda")
    # align host start so (host - arena) % S == 0
    shift = (arena.data_ptr() - host_raw.data_ptr()) % S
    host = host_raw[shift : shift + n_host * S]
    arena = arena[: n_arena * S]
    err = torch.cuda.cudart().cudaHostRegister(host_raw.data_ptr(), host_raw.numel(), 0)
    out["register"] = int(getattr(err, "value", err))
    hv = host.view(n_host, S)
    for r in range(n_host):
        hv[r].fill_(r % 200)
    av = arena.view(n_arena, S)
    for r in range(n_arena):
        av[r].fill_(200 + r % 50)
    torch.cuda.synchronize()
    U, arow, hrow = universe(arena, host, S)
    out["rows"] = U.shape[0]
    out["arena_first_row"] = arow
    out["host_first_row"] = hrow
    idx = torch.tensor([arow + 3, hrow + 5, hrow + 63, arow + 15], device="cuda")
    g = U[idx]
    torch.cuda.synchronize()
    firsts = g[:, 0].tolist()
    lasts = g[:, -1].tolist()
    out["gather_ok"] = firsts == [203, 5, 63, 215] and lasts == firsts
    out["gather_values"] = firsts
    print(out, flush=True)
    # bf16 3-D view as an experts implementation would index it
    Ub = U.view(torch.bfloat16)
    gu = Ub.as_strided((U.shape[0], 2048, 2048), (S // 2, 2048, 1))
    t = gu[torch.tensor([hrow + 1, hrow + 2], device="cuda")]
    torch.cuda.synchronize()
    out["bf16_view_ok"] = bool(t.view(torch.uint8)[0, 0, 0].item() == 1)
    # timing: zero-copy gather of 8 host rows vs copy engine of 8 rows
    def timeit(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        return ts[len(ts) // 2]
    for k in (1, 8, 32):
        hidx = torch.arange(hrow, hrow + k, device="cuda")
        didx = torch.arange(arow, arow + min(k, n_arena), device="cuda")
        ms = timeit(lambda hidx=hidx: U[hidx])
        out[f"zero_copy_gather_{k}_GBps"] = k * S / ms / 1e6
        ms = timeit(lambda hidx=hidx: torch.index_select(U, 0, hidx))
        out[f"zero_copy_index_select_{k}_GBps"] = k * S / ms / 1e6
        dst = torch.empty(k * S, dtype=torch.uint8, device="cuda")
        ms = timeit(lambda dst=dst, k=k: dst.copy_(host[: k * S], non_blocking=True))
        out[f"copy_engine_{k}_GBps"] = k * S / ms / 1e6
        ms = timeit(lambda didx=didx: U[didx])
        out[f"device_gather_{min(k, n_arena)}_GBps"] = min(k, n_arena) * S / ms / 1e6
    # bf16 bmm reading host rows directly (batched_mm's pattern) vs from device
    x = torch.randn(8, 1, 2048, dtype=torch.bfloat16, device="cuda")
    hidx = torch.arange(hrow, hrow + 8, device="cuda")
    didx = torch.arange(arow, arow + 8, device="cuda")
    out["batched_gather_bmm_host_ms"] = timeit(lambda: torch.bmm(x, gu[hidx].transpose(1, 2)))
    out["batched_gather_bmm_device_ms"] = timeit(lambda: torch.bmm(x, gu[didx].transpose(1, 2)))
    # index H2D of 64 int64 + gather on device (the per-layer remap cost), host-side us
    rowmap_host = torch.arange(64, dtype=torch.int64).pin_memory()
    rowmap = torch.empty(64, dtype=torch.int64, device="cuda")
    topk = torch.randint(0, 64, (1, 8), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        rowmap.copy_(rowmap_host, non_blocking=True)
        rowmap[topk]
    torch.cuda.synchronize()
    out["remap_host_us"] = (time.perf_counter() - t0) * 1e3
    for k, v in out.items():
        print(f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
