"""A transformers model's experts read straight from its safetensors
checkpoint into the packed host copy (HostExperts), through DiskReader.

Note [Experts from the checkpoint]
HF checkpoints keep each expert as its own tensors, per layer prefix (the
module path of the decoder layer, e.g. "model.layers.3"):
  "mlp.experts.{e}.gate_proj.weight", "...up_proj.weight", "...down_proj.weight"
      (Qwen3-MoE, OLMoE and the like), or
  "block_sparse_moe.experts.{e}.w1.weight", "...w3.weight", "...w2.weight"
      (Mixtral: w1 gate, w3 up, w2 down).
transformers 5 fuses them on load into gate_up_proj [experts, 2I, H] =
cat(gate [I, H], up [I, H]) and down_proj [experts, H, I] (checked against
every family the tests build). In the engine's packed layout an expert is
gate_up then down, each at a 256-byte aligned offset, so gate, up and down
are three byte ranges of the expert's row: each is read from its shard
into an aligned staging buffer (O_DIRECT reads whole blocks) and copied
into place. Every tensor is checked against the model before anything is
read: present, the model's dtype, [I, H] for gate and up and [H, I] for
down, its file unchanged since indexing (size, mtime). The model's own
expert parameters are never read: they may be on the meta device, so a
model too large for host memory twice over is packed without holding its
experts twice.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from prefetch.checkpoint import TensorLocation, index_checkpoint
from prefetch.errors import CheckpointError

__all__ = ["block_names", "expert_locations", "fill_from_checkpoint", "model_device", "register_from_disk"]

# (gate, up, down) name templates under a decoder layer's prefix.
TEMPLATES = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
)

# torch dtype -> safetensors dtype code
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int8: "I8", torch.uint8: "U8"}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _layer_prefix(block_name: str) -> str:
    """The decoder layer's module path: the MoE block's parent."""
    return block_name.rsplit(".", 1)[0] if "." in block_name else ""


def expert_locations(index: dict, block_names, chosen, gate_up_shape, down_shape, dtype) -> list:
    """Per (layer, expert) of `chosen` (per layer, expert ids), the
    TensorLocations of its gate, up and down tensors in `index`
    (index_checkpoint's), checked against the model's shapes and dtype."""
    code = _CODES.get(dtype)
    if code is None:
        raise CheckpointError(f"experts of dtype {dtype} cannot be read from a checkpoint here")
    inter, hidden = gate_up_shape[0] // 2, gate_up_shape[1]
    want = ((inter, hidden), (inter, hidden), tuple(down_shape))
    out = []
    for layer, (name, ex) in enumerate(zip(block_names, chosen)):
        prefix = _layer_prefix(name)
        first = int(ex[0]) if len(ex) else 0
        templates = next((t for t in TEMPLATES if _join(prefix, t[0].format(e=first)) in index), None)
        if templates is None:
            raise CheckpointError(f"layer {layer}: no expert tensor of {name!r} in the checkpoint (looked for "
                                  f"{', '.join(repr(_join(prefix, t[0].format(e=first))) for t in TEMPLATES)})")
        for e in ex:
            locs = []
            for template, shape in zip(templates, want):
                tensor = _join(prefix, template.format(e=int(e)))
                loc = index.get(tensor)
                if loc is None:
                    raise CheckpointError(f"layer {layer}, expert {int(e)}: {tensor!r} is not in the checkpoint")
                if loc.dtype != code or tuple(loc.shape) != shape:
                    raise CheckpointError(f"{tensor!r} in {loc.path} is {loc.dtype} {list(loc.shape)}; the model "
                                          f"needs {code} {list(shape)}")
                locs.append(loc)
            out.append((layer, int(e), locs))
    return out


def fill_from_checkpoint(buffer: torch.Tensor, rows: np.ndarray, stride: int, down_offset: int, checkpoint,
                         block_names, chosen, gate_up_shape, down_shape, dtype, *, threads: int = 4,
                         progress: bool = False) -> None:
    """Reads every chosen expert's gate, up and down from `checkpoint` (a
    folder or index_checkpoint's dict) into `buffer` (uint8, CPU): expert
    (layer, e) at rows[layer, e] * stride, gate|up at 0, down at
    `down_offset` (Note [Experts from the checkpoint])."""
    from prefetch._disk import DiskReader, aligned_empty
    from prefetch.host_experts import report_progress

    index = checkpoint if isinstance(checkpoint, dict) else index_checkpoint(checkpoint)
    experts = expert_locations(index, block_names, chosen, gate_up_shape, down_shape, dtype)
    jobs = []  # (location, byte offset in buffer)
    for layer, e, (gate, up, down) in experts:
        base = int(rows[layer, e]) * stride
        jobs += [(loc, at) for loc, at in ((gate, base), (up, base + gate.nbytes), (down, base + down_offset))
                 if loc.nbytes]
    dst = buffer.numpy()
    with DiskReader(threads=threads) as reader:
        files = {}
        for loc, _ in jobs:
            if loc.path not in files:
                files[loc.path] = _open_unchanged(reader, loc)
        spans = [reader.capacity(files[loc.path], loc.offset, loc.nbytes) for loc, _ in jobs]
        depth = max(1, 2 * threads)
        free = [aligned_empty(max(spans, default=1)) for _ in range(min(depth, len(jobs)))]
        pending = deque()  # (ticket, staging buffer, location, destination)
        done, total, next_report = 0, sum(loc.nbytes for loc, _ in jobs), 1 << 30
        for loc, at in jobs:
            if not free:
                done += _land(reader, pending.popleft(), dst, free)
                next_report = report_progress(progress, "read", "from the checkpoint", done, total, next_report)
            staging = free.pop()
            pending.append((reader.read_into(files[loc.path], loc.offset, loc.nbytes, staging), staging, loc, at))
        while pending:
            done += _land(reader, pending.popleft(), dst, free)
            next_report = report_progress(progress, "read", "from the checkpoint", done, total, next_report)


def register_from_disk(prefetcher, handle, checkpoint, block_names, chosen, gate_up_shape, down_shape, dtype,
                       layout, devices) -> None:
    """Note [Experts on disk]
    With a host tier on the handle (host_budget_bytes), the experts are not
    read at all here: each (layer, expert) of `chosen` is registered as the
    three extents of its checkpoint tensors (gate and up one after the
    other in the packed gate_up part, down at its part's offset) and the
    engine reads them when they are first copied (Note [Host tier]). Every
    tensor is checked as for fill_from_checkpoint, and every shard against
    the index (size, mtime) as it is opened: from then on the engine checks
    it at every read. `devices[layer]`: the engine device of that layer."""

    index = checkpoint if isinstance(checkpoint, dict) else index_checkpoint(checkpoint)
    experts = expert_locations(index, block_names, chosen, gate_up_shape, down_shape, dtype)
    down_offset = layout[1].offset
    files = {}
    for layer, e, (gate, up, down) in experts:
        for loc in (gate, up, down):
            if loc.path not in files:
                # Opened first, then checked: the engine reads the file it
                # opened, and a shard replaced between a stat and the open
                # would have passed a check made before it.
                f = handle.open_file(loc.path)
                info = handle.file_info(f)
                _check_unchanged(loc, info["size"], info["mtime_ns"])
                files[loc.path] = f
        extents = [(files[loc.path], loc.offset, loc.nbytes, at)
                   for loc, at in ((gate, 0), (up, gate.nbytes), (down, down_offset)) if loc.nbytes]
        prefetcher.register_disk(layer, e, extents, layout, device=devices[layer])


def _open_unchanged(reader, loc: TensorLocation) -> int:
    """Opens loc's shard, refusing one that changed since it was indexed."""
    f = reader.open(loc.path)
    info = reader.file_info(f)
    _check_unchanged(loc, info["size"], info["mtime_ns"])
    return f


def _check_unchanged(loc: TensorLocation, size: int, mtime_ns: int) -> None:
    """Refuses loc's shard if its size or mtime now differ from the index's."""
    if size != loc.file_size or mtime_ns != loc.file_mtime_ns:
        raise CheckpointError(f"{loc.path} changed since the checkpoint was indexed (size {loc.file_size} -> "
                              f"{size}); index it again")


def _land(reader, item, dst: np.ndarray, free: list) -> int:
    ticket, staging, loc, at = item
    start = reader.wait(ticket)
    dst[at : at + loc.nbytes] = staging[start : start + loc.nbytes]
    free.append(staging)
    return loc.nbytes


def block_names(model, hf_blocks) -> list:
    """The module path of each MoE block of `hf_blocks` in `model`."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(block), "") for block, _, _ in hf_blocks]


def model_device(hf_blocks, layer: int = 0) -> torch.device:
    """Where MoE layer `layer` computes: its experts' device, or, for
    experts on the meta device (read from a checkpoint), its router's."""
    _, experts, router = hf_blocks[layer]
    device = experts.gate_up_proj.device
    if device.type != "meta":
        return device
    weight = next((p for p in router.parameters() if p.device.type != "meta"), None)
    if weight is None:
        raise ValueError(f"the experts and the router of MoE layer {layer} are on the meta device: put the "
                         "model's other weights on their device first")
    return weight.device
