"""Reading a routing back to the host without holding up the copy workers.

Note [Read-back without a pageable copy]
Every synced MoE layer reads its routing back to the host (the experts to
acquire), and the serving thread waits for it while the GPU runs the chain
before it: the layer's experts, the next attention and router. That wait is
when the copy workers should be issuing the guesses for the next layer.
`tensor.cpu()` copies into pageable memory, which the driver cannot do
asynchronously: the calling thread sits inside the copy call until the
stream reaches it, and on the H200 machine the copy workers' own
`cuMemcpyHtoDAsync` calls were held up for as long. Measured with
`tools/speculation_start_probe.py` (routings of 42 of 64 experts, guesses
for the next layer, a GPU chain after the misses; run 68): with the host
waiting in `.cpu()` the engine copied 1.0 guesses a layer whether the chain
took 0, 300 or 800 us, and each layer grew by the chain; waiting in a stream
synchronize instead, 1.0 / 2.0 / 4.0, the layer's time flat. BM6 and BM7
at batch 8 had shown the same: 97 % of the gate's guesses cancelled before
their copy while the link idled through the chain.

`to_host` copies into a page-locked buffer with `non_blocking=True` (the
call only enqueues), records an event behind it on the tensor's current
stream and waits on the event, then returns a copy of the values (the
buffer is reused by the next read). Buffers and events are per thread and
device, so threads never share one; a read never overlaps the last one on
the same thread, which waited for its copy.
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["to_host"]


class _PerThread(threading.local):
    def __init__(self):
        self.buffers = {}  # (device index, dtype) -> page-locked tensor
        self.events = {}  # device index -> torch.cuda.Event


_local = _PerThread()


def to_host(tensor) -> np.ndarray:
    """`tensor`'s values as a flat numpy array, after the work queued on its
    device's current stream (Note [Read-back without a pageable copy]). A
    CUDA tensor goes through a page-locked buffer and an event; any other
    tensor as `.cpu().numpy()` (a CPU tensor's array shares its memory)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cuda":
        return flat.cpu().numpy()
    import torch

    n = flat.shape[0]
    index = flat.device.index
    key = (index, flat.dtype)
    buffer = _local.buffers.get(key)
    if buffer is None or buffer.shape[0] < n:
        buffer = torch.empty(max(n, 1024), dtype=flat.dtype, pin_memory=True)
        _local.buffers[key] = buffer
    stream = torch.cuda.current_stream(flat.device)
    dst = buffer[:n]
    with torch.cuda.stream(stream):
        dst.copy_(flat, non_blocking=True)
    event = _local.events.get(index)
    if event is None:
        event = _local.events[index] = torch.cuda.Event()
    event.record(stream)
    event.synchronize()
    return dst.numpy().copy()
