"""A transformers model's experts read straight from its safetensors
checkpoint into the packed host copy (HostExperts), through DiskReader.

Note [Experts from the checkpoint]
An expert's packed entry is its parts (ExpertsLayout: every stacked tensor
of the experts module), each at a 256-byte aligned offset. A checkpoint
holds each part in one of two ways:
- fused, as transformers keeps it in memory: one [experts, ...] tensor
  named after the experts module and the part ("model.layers.3.mlp.experts.
  gate_up_proj", gpt-oss and every family saved that way). Expert e's part
  is then the e-th of equal contiguous byte ranges of that tensor;
- one tensor per expert, per layer prefix (the decoder layer's module
  path): "mlp.experts.{e}.gate_proj.weight", "...up_proj.weight",
  "...down_proj.weight" (Qwen3-MoE, OLMoE and the like), or
  "block_sparse_moe.experts.{e}.w1.weight", "...w3.weight", "...w2.weight"
  (Mixtral: w1 gate, w3 up, w2 down). transformers fuses them on load into
  gate_up_proj [experts, 2I, H] = cat(gate [I, H], up [I, H]) and
  down_proj [experts, H, I]: gate, up and down are three byte ranges of
  the expert's entry. Only that layout (concatenated gate|up, not
  transposed, no bias) is read from per-expert tensors.
Each range is read from its shard into an aligned staging buffer (O_DIRECT
reads whole blocks) and copied into place. Every tensor is checked against
the model before anything is read: present, the model's dtype and shape,
its file unchanged since indexing (size, mtime). The model's own expert
parameters are never read: they may be on the meta device, so a model too
large for host memory twice over is packed without holding its experts
twice.
"""
from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import torch

from prefetch.checkpoint import TensorLocation, index_checkpoint
from prefetch.errors import CheckpointError
from prefetch.progress import report_progress

__all__ = ["expert_locations", "expert_tensor_names", "fill_from_checkpoint", "register_from_disk"]

# (gate, up, down) name templates under a decoder layer's prefix, for
# checkpoints that keep one tensor per expert.
TEMPLATES = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
)

# torch dtype -> safetensors dtype code
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _layer_prefix(block_name: str) -> str:
    """The decoder layer's module path: the MoE block's parent."""
    return block_name.rsplit(".", 1)[0] if "." in block_name else ""


def _code(dtype) -> str:
    code = _CODES.get(dtype)
    if code is None:
        raise CheckpointError(f"experts of dtype {dtype} cannot be read from a checkpoint here")
    return code


def _checked(loc: TensorLocation | None, name: str, code: str, shape: tuple, where: str) -> TensorLocation:
    if loc is None:
        raise CheckpointError(f"{where}: {name!r} is not in the checkpoint")
    if loc.dtype != code or tuple(loc.shape) != tuple(shape):
        raise CheckpointError(f"{name!r} in {loc.path} is {loc.dtype} {list(loc.shape)}; the model needs {code} "
                              f"{list(shape)}")
    return loc


def _fused_parts(index: dict, experts_name: str, layout, layer: int):
    """Per part, the fused [experts, ...] tensor of `experts_name` in
    `index` (checked), or None where the checkpoint has no fused tensors."""
    num = layout.num_experts
    names = [_join(experts_name, part.name) for part in layout.parts]
    if not any(n in index for n in names):
        return None
    return [_checked(index.get(n), n, _code(part.dtype), (num, *part.shape), f"layer {layer}")
            for n, part in zip(names, layout.parts)]


def _split_templates(index: dict, prefix: str, first: int, layout, layer: int, block: str):
    """The per-expert name templates of layer `layer`, for the one layout
    they can hold (gate_up_proj then down_proj, concatenated, untransposed)."""
    if tuple(p.name for p in layout.parts) != ("gate_up_proj", "down_proj"):
        raise CheckpointError(f"layer {layer}: no fused expert tensors of {block!r} in the checkpoint, and experts "
                              f"with parts {[p.name for p in layout.parts]} are not read from per-expert tensors")
    templates = next((t for t in TEMPLATES if _join(prefix, t[0].format(e=first)) in index), None)
    if templates is None:
        looked = ", ".join(repr(_join(prefix, t[0].format(e=first))) for t in TEMPLATES)
        raise CheckpointError(f"layer {layer}: no expert tensor of {block!r} in the checkpoint (looked for fused "
                              f"{_join(block, layout.parts[0].name)!r} and per-expert {looked})")
    return templates


def expert_locations(index: dict, experts_names, chosen, layout) -> list:
    """Per (layer, expert) of `chosen` (per layer, expert ids), the byte
    ranges of its packed entry in `index` (index_checkpoint's): a list of
    (TensorLocation of the range, offset in the packed expert), each
    checked against the model's layout (Note [Experts from the checkpoint]).
    `experts_names`: each layer's experts module path."""
    out = []
    for layer, (name, ex) in enumerate(zip(experts_names, chosen)):
        fused = _fused_parts(index, name, layout, layer)
        if fused is not None:
            for e in ex:
                ranges = [(dataclasses.replace(loc, offset=loc.offset + int(e) * part.nbytes, nbytes=part.nbytes,
                                               shape=tuple(part.shape)), part.offset)
                          for loc, part in zip(fused, layout.parts)]
                out.append((layer, int(e), ranges))
            continue
        prefix = _layer_prefix(_layer_prefix(name))
        first = int(ex[0]) if len(ex) else 0
        templates = _split_templates(index, prefix, first, layout, layer, name)
        gate_up, down = layout.parts
        inter, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        code = _code(gate_up.dtype)
        for e in ex:
            tensors = [_join(prefix, t.format(e=int(e))) for t in templates]
            gate, up, dn = (_checked(index.get(t), t, code, shape, f"layer {layer}, expert {int(e)}")
                            for t, shape in zip(tensors, ((inter, hidden), (inter, hidden), tuple(down.shape))))
            out.append((layer, int(e), [(gate, gate_up.offset), (up, gate_up.offset + gate.nbytes),
                                        (dn, down.offset)]))
    return out


def expert_tensor_names(index: dict, experts_names, layout) -> set:
    """The checkpoint names of every expert tensor of the layers whose
    experts modules are `experts_names`, fused or per expert, as
    expert_locations reads them (check them with it first): what a loader
    of the model's other weights leaves out."""
    out = set()
    for layer, name in enumerate(experts_names):
        fused = [_join(name, part.name) for part in layout.parts]
        if any(n in index for n in fused):
            out.update(n for n in fused if n in index)
            continue
        prefix = _layer_prefix(_layer_prefix(name))
        templates = _split_templates(index, prefix, 0, layout, layer, name)
        out.update(_join(prefix, t.format(e=e)) for t in templates for e in range(layout.num_experts))
    return out

def fill_from_checkpoint(buffer: torch.Tensor, rows: np.ndarray, stride: int, checkpoint, experts_names, chosen,
                         layout, *, threads: int = 4, progress: bool = False) -> None:
    """Reads every chosen expert's parts from `checkpoint` (a folder or
    index_checkpoint's dict) into `buffer` (uint8, CPU): expert (layer, e)
    at rows[layer, e] * stride, in `layout` (Note [Experts from the
    checkpoint])."""
    from prefetch._disk import DiskReader, aligned_empty

    index = checkpoint if isinstance(checkpoint, dict) else index_checkpoint(checkpoint)
    experts = expert_locations(index, experts_names, chosen, layout)
    jobs = []  # (location, byte offset in buffer)
    for layer, e, ranges in experts:
        base = int(rows[layer, e]) * stride
        jobs += [(loc, base + at) for loc, at in ranges if loc.nbytes]
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


def register_from_disk(prefetcher, handle, checkpoint, experts_names, chosen, layout, devices) -> None:
    """Note [Experts on disk]
    With a host tier on the handle (host_budget_bytes), the experts are not
    read at all here: each (layer, expert) of `chosen` is registered as the
    extents of its byte ranges in the checkpoint (Note [Experts from the
    checkpoint]) and the engine reads them when they are first copied
    (Note [Host tier]). Every tensor is checked as for fill_from_checkpoint,
    and every shard against the index (size, mtime) as it is opened: from
    then on the engine checks it at every read. `devices[layer]`: the
    engine device of that layer."""

    index = checkpoint if isinstance(checkpoint, dict) else index_checkpoint(checkpoint)
    experts = expert_locations(index, experts_names, chosen, layout)
    files = {}
    for layer, e, ranges in experts:
        for loc, _ in ranges:
            if loc.path not in files:
                # Opened first, then checked: the engine reads the file it
                # opened, and a shard replaced between a stat and the open
                # would have passed a check made before it.
                f = handle.open_file(loc.path)
                info = handle.file_info(f)
                _check_unchanged(loc, info["size"], info["mtime_ns"])
                files[loc.path] = f
        extents = [(files[loc.path], loc.offset, loc.nbytes, at) for loc, at in ranges if loc.nbytes]
        prefetcher.register_disk(layer, e, extents, layout.parts, device=devices[layer])


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
