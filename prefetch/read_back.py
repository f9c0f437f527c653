"""Reading a routing back to the host without holding up the copy workers.

Note [Read-back without a pageable copy]
Every synced MoE layer reads its routing back to the host (the experts to
acquire), and the serving thread waits for it while the GPU runs the chain
before it: the layer's experts, the next attention and router. That wait is
when the copy workers should be issuing the guesses for the next layer.
`tensor.cpu()` copies into pageable memory, which the driver cannot do
asynchronously: the calling thread sits inside the copy call until the
stream reaches it, and on the H200 machine the copy workers' own
`cuMemcpyHtoDAsync` calls were held up for as long. A one-off probe on that
machine (routings of 42 of 64 experts, guesses for the next layer, a GPU
chain after the misses) measured it: with the host waiting in `.cpu()` the
engine copied 1.0 guesses a layer whether the chain took 0, 300 or 800 us,
and each layer grew by the chain; waiting in a stream synchronize instead,
1.0 / 2.0 / 4.0, the layer's time flat. BM6 and BM7 at batch 8 had shown the
same: 97 % of the gate's guesses cancelled before their copy while the link
idled through the chain.

`to_host` copies into a page-locked buffer instead. PyTorch makes that
copy as cudaMemcpyAsync then cudaStreamSynchronize on the tensor's
device's current stream, and into page-locked memory the first call only
enqueues: the thread waits in the synchronize, which holds nothing the
copy workers need. One PyTorch call, as `.cpu()` was: the first version
(pinned copy with non_blocking, an event recorded and waited on, under a
stream context) took five PyTorch calls: on the H200 host BM5's sync phase
(the read-back, the wait for the GPU included) measured 129-177 us a layer
for every row, against 25-58 with `.cpu()`. The values come back as a copy
(the buffer is reused by the next read). Buffers are per thread and device,
so threads never share one, and a read never overlaps the last one on its
thread, which waited for its copy.
"""
from __future__ import annotations

import threading

import numpy as np

__all__ = ["to_host"]


_MAX_SHAPES = 64  # views kept per thread; more distinct shapes start over


class _PerThread(threading.local):
    def __init__(self):
        self.buffers = {}  # (device index, dtype) -> page-locked tensor
        self.views = {}  # (device index, dtype, shape) -> (tensor view, numpy view) of that buffer


_local = _PerThread()


def _views(key, pin: bool = True):
    """The (tensor, numpy) views of this thread's buffer for `key`'s
    device, dtype and shape, made now. Made outside inference mode, even
    when called inside it: a buffer or view made there could not be written
    by a later read outside it ("Inplace update to inference tensor outside
    InferenceMode"). `pin`: page-locked (False only in tests without CUDA)."""
    import torch

    index, dtype, shape = key
    n = 1
    for d in shape:
        n *= d
    with torch.inference_mode(False):
        buffer = _local.buffers.get((index, dtype))
        if buffer is None or buffer.shape[0] < n:
            buffer = torch.empty(max(n, 1024), dtype=dtype, pin_memory=pin)
            _local.buffers[(index, dtype)] = buffer
            _local.views = {k: v for k, v in _local.views.items() if k[:2] != (index, dtype)}
        if len(_local.views) >= _MAX_SHAPES:
            _local.views = {}
        views = _local.views[key] = (buffer[:n].view(shape), buffer.numpy()[:n])
    return views


def to_host(tensor) -> np.ndarray:
    """`tensor`'s values as a flat numpy array, after the work queued on its
    device's current stream (Note [Read-back without a pageable copy]). A
    CUDA tensor goes through a page-locked buffer; any other tensor as
    `.cpu().numpy()` (a CPU tensor's array shares its memory)."""
    if tensor.device.type != "cuda":
        return tensor.detach().reshape(-1).cpu().numpy()
    if tensor.requires_grad:
        tensor = tensor.detach()
    key = (tensor.device.index, tensor.dtype, tensor.shape)
    views = _local.views.get(key)
    if views is None:
        views = _views(key)
    views[0].copy_(tensor)
    return views[1].copy()
