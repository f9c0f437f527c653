"""BM5's synthetic MoE decoder (bench/e2e.py): its dense weights, expert
pool and step."""
from __future__ import annotations

import math
import os
import tempfile
import time

import numpy as np

from prefetch.read_back import to_host

MODELS = {
    "olmoe-1b-7b": dict(layers=16, experts=64, top_k=8, hidden=2048, inter=1024),
    "qwen3-30b-a3b": dict(layers=48, experts=128, top_k=8, hidden=2048, inter=768),
    # Shapes for replaying the real traces of ../shared/traces (layers and
    # experts as recorded, top-k as run there); hidden and expert widths
    # from the models' published configs, quoted, not checked here.
    "gemma4-26b-a4b": dict(layers=30, experts=128, top_k=6, hidden=2816, inter=704),
    "gpt-oss-120b": dict(layers=36, experts=128, top_k=2, hidden=2880, inter=2880),
}
POLICIES = ("all-resident", "on-demand", "next-layer-gate", "trace", "oracle", "oracle-cyclic", "torch-by-hand",
            "on-demand-disk")
ENGINE_POLICIES = ("on-demand", "next-layer-gate", "trace", "oracle", "oracle-cyclic", "on-demand-disk")
# on-demand-disk: the experts left in a file, read through the engine's host
# tier of this share of all expert bytes (Note [Host tier]).
DISK_HOST_SHARE = 0.5


class Decoder:
    """The synthetic MoE decoder's dense weights (GPU) and expert pool.

    With `devices` > 1 the layers are split into contiguous runs, one per
    device (layer l on device l * devices // layers): each layer's dense
    weights and experts live on its device, the hidden state moves to the
    next device at a boundary, and each device has its own expert cache.
    The weights do not depend on `devices`, so routing is the same."""

    def __init__(self, torch, spec: dict, pool: int, seed: int = 0, device: str = "cuda", devices: int = 1,
                 grouped: bool = True):
        self.torch = torch
        self.grouped = grouped
        self.spec = spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._step_streams = None  # per device, while a step runs (stream)
        L, E, H, inter = spec["layers"], spec["experts"], spec["hidden"], spec["inter"]
        if not 1 <= devices <= L:
            raise ValueError(f"devices must be in 1..{L}")
        self.ndev = devices
        self.layer_dev = [layer * devices // L for layer in range(L)]
        self.devs = [torch.device("cuda", d) if self.cuda else self.device for d in range(devices)]
        g = torch.Generator(device=self.device).manual_seed(seed)
        bf16 = torch.bfloat16
        dev = self.device
        router = (torch.randn(L, E, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
        attn = (torch.randn(L, H, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
        self.router = [router[layer].to(self.devs[self.layer_dev[layer]]) for layer in range(L)]
        self.attn = [attn[layer].to(self.devs[self.layer_dev[layer]]) for layer in range(L)]
        # Residual updates stay small against the stream, as in trained
        # models: consecutive layers see similar hidden states.
        self.attn_scale = 0.1
        self.pool_host = []  # (pinned packed buffer, layout)
        import prefetch

        made = []
        for _ in range(pool):
            gate_up = (torch.randn(2 * inter, H, device=dev, generator=g) / math.sqrt(H)).to(bf16)
            down = (torch.randn(H, inter, device=dev, generator=g) / math.sqrt(inter) * 0.1).to(bf16)
            made.append((gate_up, down))
            self.pool_host.append(prefetch.pack_expert({"gate_up": gate_up.cpu(), "down": down.cpu()},
                                                       pin_memory=self.cuda))
        # The pool on each device, stacked once: [pool, 2I, H] and [pool, H, I]
        # (the resident reference gathers a layer's experts from them), and
        # per expert (gate_up, down) views of the same memory (loop mode).
        self.pool_stacked = []
        self.pool_gpu = []
        for d in range(devices):
            gate_up = torch.stack([gu for gu, _ in made]).to(self.devs[d])
            down = torch.stack([dn for _, dn in made]).to(self.devs[d])
            self.pool_stacked.append((gate_up, down))
            self.pool_gpu.append([(gate_up[i], down[i]) for i in range(pool)])
        del made
        # Per layer, on its device: expert -> pool entry (pool_index as a
        # table, so a layer's routed experts map to pool rows in one gather).
        self.pool_table = [torch.tensor([self.pool_index(layer, e) for e in range(E)], dtype=torch.int64,
                                        device=self.devs[self.layer_dev[layer]]) for layer in range(L)]
        self.expert_bytes = self.pool_host[0][1][-1].offset + self.pool_host[0][1][-1].nbytes
        self.slot_bytes = -(-self.expert_bytes // prefetch.SLOT_ALIGNMENT) * prefetch.SLOT_ALIGNMENT
        # Host seconds per phase of step() (the provider's before_sync work,
        # routing sync, acquire including the gather or stack of the
        # weights, compute launch, release) when set to a dict; None costs
        # nothing.
        self.timers = None
        self._expert_ids = {}  # device -> arange(experts) (routed_keys)

    def pool_file(self, folder: str):
        """The expert pool written to one file in `folder` (made once; the
        on-demand-disk policy reads it): (path, byte offset of each pool
        entry). Entries start on 4096-byte boundaries, the file ends on one."""
        if getattr(self, "_pool_file", None) is None:
            stride = -(-self.expert_bytes // 4096) * 4096
            fd, path = tempfile.mkstemp(prefix="bm5-experts-", suffix=".bin", dir=folder)
            with os.fdopen(fd, "wb") as f:
                for buffer, _ in self.pool_host:
                    data = buffer.numpy().tobytes()
                    f.write(data + bytes(stride - len(data)))
                f.flush()
                os.fsync(f.fileno())
            self._pool_file = (path, [i * stride for i in range(len(self.pool_host))])
        return self._pool_file

    def remove_pool_file(self) -> None:
        if getattr(self, "_pool_file", None) is not None:
            os.unlink(self._pool_file[0])
            self._pool_file = None

    def layers_of(self, d: int) -> list:
        return [layer for layer, ld in enumerate(self.layer_dev) if ld == d]

    def device_budgets(self, budget: int) -> list:
        """A cache of `budget` bytes in all, split over the devices by their
        share of the layers, in whole slots."""
        slots = budget // self.slot_bytes
        L = self.spec["layers"]
        return [slots * len(self.layers_of(d)) // L * self.slot_bytes for d in range(self.ndev)]

    def pool_index(self, layer: int, expert: int) -> int:
        return (layer * self.spec["experts"] + expert * 7 + layer) % len(self.pool_host)

    def inputs(self, steps: int, batch: int, seed: int):
        g = self.torch.Generator(device=self.device).manual_seed(1000 + seed)
        x = self.torch.randn(steps, batch, self.spec["hidden"], device=self.device, generator=g)
        return x.to(self.torch.bfloat16)

    def sync(self):
        if self.cuda:
            for d in range(self.ndev):
                self.torch.cuda.synchronize(d)

    def stream(self, layer: int = 0):
        """The compute stream of `layer`'s device: torch's current stream
        there, as `step` found it when it started (read once a step, not
        once a layer: a current_stream call is a few us of a host-bound
        step; nothing changes the stream inside one), or now outside a
        step."""
        if not self.cuda:
            return None
        streams = self._step_streams
        if streams is None:
            return self.torch.cuda.current_stream(self.devs[self.layer_dev[layer]])
        return streams[self.layer_dev[layer]]

    def rms(self, x):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def routed_keys(self, top_i):
        """Note [No hidden sync in the routing]
        A layer's routed experts, sorted and distinct, as a device tensor
        read_routed turns into (host list, device index), with no wait for
        the GPU before that read-back. torch.unique (BM5's choice until
        this note) waits inside itself: it reads its output's length with a
        copy into pageable memory, so (1) the speculation after it
        (`before_sync`) found nothing queued on the GPU to hide behind, and
        (2) the serving thread sat inside a pageable copy call, the wait
        that held up the engine's copy workers' driver calls in run 68
        (Note [Read-back without a pageable copy] in prefetch/read_back.py);
        a provider that copies from the serving thread (by hand) or not at
        all (resident) was not held up. At batch 1 a row's top-k are
        distinct, so the keys are the row sorted (k values); with more rows
        they are the E expert ids with each one no row routed to replaced
        by E, sorted: the routed ids first, in order, then the padding."""
        torch = self.torch
        E = self.spec["experts"]
        if top_i.shape[0] == 1:
            return torch.sort(top_i.reshape(-1)).values
        hit = torch.zeros(E, dtype=torch.bool, device=top_i.device)
        hit.index_fill_(0, top_i.reshape(-1), True)
        ids = self._expert_ids.get(top_i.device)
        if ids is None:
            ids = self._expert_ids[top_i.device] = torch.arange(E, device=top_i.device)
        return torch.sort(torch.where(hit, ids, E)).values

    def read_routed(self, keys):
        """routed_keys' keys read back (the layer's one wait for the GPU, in
        page-locked memory): (the routed experts as a host list, the same
        as a device tensor: a view of `keys`, no copy)."""
        host = to_host(keys)
        E = self.spec["experts"]
        n = int(np.searchsorted(host, E)) if host.shape[0] and host[-1] >= E else host.shape[0]
        return host[:n].tolist(), keys[:n]

    def step(self, x0, provider, forced=None):
        """One decode step of every layer; returns the final hidden state.
        `forced`: per layer, expert lists to use instead of the router's."""
        torch = self.torch
        h = x0
        k = self.spec["top_k"]
        if self.cuda:
            self._step_streams = [torch.cuda.current_stream(d) for d in self.devs]
        try:
            return self._layers(h, provider, forced, k)
        finally:
            self._step_streams = None

    # In _layers: the routing weights are a dense [batch, experts] matrix:
    # each routed expert runs on the whole batch, weighted by its (possibly
    # zero) weight, so the only host sync per layer is reading the expert
    # list the CPU needs to acquire. That routing read-back is made as a
    # serving stack should make it (Note [Read-back without a pageable copy]
    # in prefetch/read_back.py): a blocking .tolist() would hold up the
    # engine's copy workers while the host waits. The same for every
    # provider.
    def _layers(self, h, provider, forced, k):
        torch = self.torch
        if forced is not None:
            # Every layer's allowed experts in one host-to-device copy a step.
            sizes = [len(f) for f in forced]
            flat = torch.tensor([e for f in forced for e in f], dtype=torch.int64, device=self.device)
            allowed_all = flat.split(sizes)
        for layer in range(self.spec["layers"]):
            if h.device != self.devs[self.layer_dev[layer]]:
                h = h.to(self.devs[self.layer_dev[layer]])
            x = self.rms(h)
            h = h + (x @ self.attn[layer].T) * self.attn_scale
            x = self.rms(h)
            probs = torch.softmax((x @ self.router[layer].T).float(), dim=-1)
            top_w, top_i = torch.topk(probs, k, dim=-1)
            if forced is not None:
                allowed = allowed_all[layer].to(x.device)
                masked = torch.full_like(probs, -1.0)
                masked[:, allowed] = probs[:, allowed]
                top_w, top_i = torch.topk(masked, min(k, len(forced[layer])), dim=-1)
            top_w = (top_w / top_w.sum(-1, keepdim=True)).to(x.dtype)
            dense = torch.zeros(x.shape[0], self.spec["experts"], dtype=x.dtype, device=x.device)
            dense.scatter_(1, top_i, top_w)  # dense routing weights (see above _layers)
            keys = self.routed_keys(top_i)  # queued; read back below (Note [No hidden sync in the routing])
            timers = self.timers
            before_sync = getattr(provider, "before_sync", None)
            if before_sync is not None:  # host work the GPU's queued layers can hide
                if timers is not None:
                    ts = time.perf_counter()
                before_sync(layer)
                if timers is not None:
                    timers["speculate"] = timers.get("speculate", 0.0) + time.perf_counter() - ts
            if timers is not None:
                t0 = time.perf_counter()
            # The routing read-back (see above _layers).
            experts, routed = self.read_routed(keys)
            if timers is not None:
                t1 = time.perf_counter()
            stacked = getattr(provider, "acquire_stacked", None) if self.grouped else None
            if stacked is not None:
                # The routed experts' weights as two tensors in `experts`'
                # order, gathered by the provider from its slot tensor with
                # one kernel per weight (a device-to-device copy; no
                # per-expert tensor op on the host).
                gate_up, down = stacked(layer, x, experts, routed)  # [n, 2I, H], [n, H, I]
            else:
                weights = provider.acquire(layer, x, experts)
                if self.grouped:  # a provider without acquire_stacked: stack its per-expert views
                    gate_up = torch.stack([w[0] for w in weights])
                    down = torch.stack([w[1] for w in weights])
            if timers is not None:
                t2 = time.perf_counter()
            if self.grouped:
                # All routed experts in two batched matmuls: far fewer kernel
                # launches than a loop, so the step is GPU time rather than
                # Python time.
                xs = x.unsqueeze(0).expand(len(experts), -1, -1)
                gate, up = torch.bmm(xs, gate_up.transpose(1, 2)).chunk(2, dim=-1)
                y = torch.bmm(torch.nn.functional.silu(gate) * up, down.transpose(1, 2))  # [n, B, H]
                out = (y * dense.index_select(1, routed).T.unsqueeze(-1)).sum(0)
            else:
                out = torch.zeros_like(x)
                for e, (gate_up, down) in zip(experts, weights):
                    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
                    y = (torch.nn.functional.silu(gate) * up) @ down.T
                    out += y * dense[:, e : e + 1]
            if timers is not None:
                t3 = time.perf_counter()
            provider.release(layer, experts)
            h = h + out
            if timers is not None:
                t4 = time.perf_counter()
                for name, dt in (("sync", t1 - t0), ("acquire", t2 - t1), ("compute", t3 - t2),
                                 ("release", t4 - t3)):
                    timers[name] = timers.get(name, 0.0) + dt
        return h


def profile_steps(dec, provider, inputs, warmup, steps, route, path):
    """--profile: `steps` more decode steps (the measured inputs again, from
    `warmup` on, after their warm-up steps unprofiled) under torch.profiler,
    after the measured ones, so the profiler's cost stays out of every
    figure; run_policy passes a fresh provider, so they start from the
    state the measured steps started from. Writes `path`.json (Chrome
    trace) and `path`.txt (ops by device time). Returns, per step: wall ms,
    the GPU's split (bench.lib.common.gpu_time_split; null without CUDA), idle
    ms (wall - GPU busy) and the decoder's host phases in ms; and over the
    profiled steps the provider's hits, misses and bytes copied."""
    from torch.profiler import ProfilerActivity, profile

    from bench.lib.common import gpu_time_split

    torch = dec.torch
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dec.cuda else [])
    timers = {}
    wall = 0.0
    measured = len(inputs) - warmup
    # The replay starts a new sequence at step 0 (its warm-up steps run
    # unprofiled), so a predictor that follows the step count (the oracle
    # reads the trace at the controller's step) sees the steps it predicts.
    ctl = getattr(provider, "ctl", None)
    if ctl is not None:
        ctl.new_sequence()
    for i in range(warmup):
        dec.step(inputs[i], provider, route(i) if route is not None else None)
    before = provider.stats()
    with profile(activities=activities) as prof:
        dec.timers = timers
        try:
            for j in range(steps):
                i = warmup + j % measured
                dec.sync()
                t0 = time.perf_counter()
                dec.step(inputs[i], provider, route(i) if route is not None else None)
                dec.sync()
                wall += time.perf_counter() - t0
        finally:
            dec.timers = None
    prof.export_chrome_trace(path + ".json")
    with open(path + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_device_time_total" if dec.cuda else "self_cpu_time_total",
                                          row_limit=40))
    after = provider.stats()
    out = {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
           "host_phase_ms_per_step": {k: v * 1e3 / steps for k, v in timers.items()}}
    for key in ("hits", "misses", "bytes"):  # the profiled steps' own (null for the resident reference)
        out[key] = after[key] - before[key] if key in after and key in before else None
    split = gpu_time_split(torch, prof) if dec.cuda else None
    for key in ("busy", "compute", "h2d", "copy_only"):
        out[f"gpu_{key}_ms_per_step"] = split[f"{key}_us"] / 1e3 / steps if split else None
    out["gpu_idle_ms_per_step"] = out["wall_ms_per_step"] - out["gpu_busy_ms_per_step"] if split else None
    return out


def measure_steps(dec, provider, inputs, warmup, route=None, timers=None, at_warmup_end=None):
    """The decode loop of a measured run: steps through `inputs` (one tensor
    per step; `route(i)` a forced routing or None), synchronising around
    each step, and times the steps after the first `warmup`. At the first
    measured step calls `at_warmup_end()` (if given) and starts filling
    `timers` (the decoder's per-phase host timers). Returns (latencies in s,
    provider.stats() at the first measured step, and at the end)."""
    lat = []
    before = {}
    try:
        for i, x in enumerate(inputs):
            dec.sync()
            if i == warmup:
                before = provider.stats()
                if at_warmup_end is not None:
                    at_warmup_end()
                dec.timers = timers
            t0 = time.perf_counter()
            dec.step(x, provider, route(i) if route is not None else None)
            dec.sync()
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
    finally:
        dec.timers = None
    return lat, before, provider.stats()
