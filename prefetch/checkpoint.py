"""Where each tensor of a safetensors checkpoint lies on disk, read from the
files' headers without reading the tensors.

Note [Safetensors headers are untrusted]
A safetensors file is an 8-byte little-endian header length N, N bytes of
JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, and an
optional "__metadata__" of strings}), then the data; offsets count from the
end of the header. Everything in it is checked before a location is
returned: N within the file (and at most 100 MiB, the reference library's
limit); the JSON an object without repeated keys; every entry exactly those
three fields, a known dtype, a shape of non-negative integers, offsets
inside the data with begin <= end, end - begin equal to the shape's
elements times the dtype's size, and no two tensors overlapping. A sharded
checkpoint's index (model.safetensors.index.json) may name only plain file
names inside the folder, each shard must exist, and every tensor it maps
must be in its shard. Whatever fails raises CheckpointError naming the file
and the field; nothing reads outside a file.

A location also keeps the file's size and modification time at indexing:
`read_tensor` refuses a file that changed since (replaced, truncated) and a
short read, rather than returning other bytes.

The disk tier (issue #15) registers experts from this index: the engine's
host tier reads the extents it gives (`register_disk`, Note [Host tier] in
src_cpp/archer_prefetch_handle.h).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from prefetch.errors import CheckpointError, InvalidArgumentError
from prefetch.untrusted_files import RepeatedKeyError, no_repeated_keys, open_regular

__all__ = ["TensorLocation", "read_safetensors_header", "index_checkpoint", "read_tensor", "DTYPE_BYTES"]

# Element size of each safetensors dtype code.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20
INDEX_FILE = "model.safetensors.index.json"
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorLocation:
    """One tensor's bytes: `nbytes` at absolute `offset` of `path`, as
    `dtype` (a safetensors code) of `shape`; the file's size and mtime when
    it was indexed."""

    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple
    file_size: int
    file_mtime_ns: int


def _json(raw: bytes, where: str, what: str):
    """`raw` as UTF-8 JSON without repeated keys; CheckpointError naming
    `where` (and `what` for bytes that are not JSON) otherwise."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_repeated_keys)
    except RepeatedKeyError as err:
        raise CheckpointError(f"{where}: repeated key {err.key!r} in the JSON") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{where}: {what}: {err}") from None


def _show(value, limit: int = 200) -> str:
    """repr(value) for an error message, cut to `limit` characters; a
    header's integers can be too long for Python to print at all."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits
        return f"<a {type(value).__name__} with an integer too long to print>"
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: str, name, entry, data_start: int, data_len: int, stat) -> TensorLocation:
    where = f"{path}: tensor {_show(name)}"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise CheckpointError(f"{where}: expected exactly the fields dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:  # a list or object is not hashable
        raise CheckpointError(f"{where}: unknown dtype {_show(dtype)} (known: {', '.join(DTYPE_BYTES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {_show(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len):
        raise CheckpointError(f"{where}: data_offsets {_show(offsets)} are not [begin, end] with 0 <= begin <= end "
                              f"<= {data_len} (the data's length)")
    span = offsets[1] - offsets[0]
    nbytes = DTYPE_BYTES[dtype]
    if 0 in shape:
        nbytes = 0
    else:
        # Stop once past the span: a product of huge dimensions took time
        # quadratic in their digits (a 4 MB header of 1000 dims, 72 s).
        for d in shape:
            nbytes *= d
            if nbytes > span:
                break
    if nbytes != span:
        size = f"{nbytes} bytes" if nbytes <= span else "more bytes than that"
        raise CheckpointError(f"{where}: data_offsets span {span} bytes; shape {_show(shape)} of {dtype} is {size}")
    return TensorLocation(path, data_start + offsets[0], nbytes, dtype, tuple(shape), stat.st_size,
                          stat.st_mtime_ns)


def read_safetensors_header(path) -> dict:
    """{tensor name: TensorLocation} of one safetensors file, every field
    checked (Note [Safetensors headers are untrusted])."""
    path = os.fspath(path)
    try:
        with open_regular(path) as f:  # a FIFO is refused, not waited on (an OSError: below)
            stat = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {stat.st_size} bytes, shorter than the 8-byte header length")
            (size,) = struct.unpack("<Q", head)
            if size > stat.st_size - 8 or size > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {size} runs past the file ({stat.st_size} bytes) "
                                      f"or over {MAX_HEADER_BYTES} bytes")
            raw = f.read(size)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    if len(raw) != size:
        raise CheckpointError(f"{path}: short read of the header ({len(raw)} of {size} bytes)")
    header = _json(raw, path, "the header is not JSON")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings")
    data_start = 8 + size
    data_len = stat.st_size - data_start
    out = {name: _entry(path, name, entry, data_start, data_len, stat) for name, entry in header.items()}
    spans = sorted((loc.offset, loc.offset + loc.nbytes, name) for name, loc in out.items() if loc.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")
    return out


def _shard_path(folder: str, name) -> str:
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise CheckpointError(f"{folder}/{INDEX_FILE}: shard {_show(name)} is not a plain file name in the folder")
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: shard {name!r} named by {INDEX_FILE} is missing")
    return path


def index_checkpoint(folder) -> dict:
    """{tensor name: TensorLocation} of a checkpoint folder: the shards its
    model.safetensors.index.json maps, or without one every *.safetensors
    file in it. A tensor in two shards, or mapped to a shard that lacks it,
    is an error."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a checkpoint folder (no such directory)")
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):  # a dangling link is an index that cannot be read, not no index
        try:
            with open_regular(index) as f:
                raw = f.read()
        except OSError as err:
            raise CheckpointError(f"{index}: not a readable JSON index: {err}") from None
        doc = _json(raw, index, "not a readable JSON index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        shards = {}
        for name in weight_map.values():  # checked before any use as a key
            if not (isinstance(name, str) and name in shards):
                shards[name] = _shard_path(folder, name)
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")
                       and os.path.isfile(os.path.join(folder, n)))
        if not names:
            raise CheckpointError(f"{folder}: no {INDEX_FILE} and no *.safetensors file")
        shards = {name: os.path.join(folder, name) for name in names}
        weight_map = None
    out = {}
    for path in shards.values():
        for tensor, loc in read_safetensors_header(path).items():
            if tensor in out:
                raise CheckpointError(f"{folder}: tensor {tensor!r} is in {out[tensor].path} and in {path}")
            out[tensor] = loc
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            loc = out.get(tensor)
            if loc is None or loc.path != shards[shard]:
                raise CheckpointError(f"{index}: tensor {tensor!r} mapped to {shard!r}, which does not hold it")
    return out


def read_tensor(loc: TensorLocation, out=None) -> np.ndarray:
    """The tensor's bytes as a uint8 array (into `out`, a writable
    C-contiguous uint8 array of loc.nbytes, when given). Refuses a file
    whose size or mtime changed since it was indexed, and a short read."""
    if out is None:
        out = np.empty(loc.nbytes, dtype=np.uint8)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.flags.c_contiguous
              and out.flags.writeable and out.nbytes == loc.nbytes):
        raise InvalidArgumentError(f"out must be a writable C-contiguous uint8 array of {loc.nbytes} bytes")
    try:
        fd = os.open(loc.path, os.O_RDONLY)
    except OSError as err:
        raise CheckpointError(f"{loc.path}: cannot open: {err}") from err
    try:
        stat = os.fstat(fd)
        if stat.st_size != loc.file_size or stat.st_mtime_ns != loc.file_mtime_ns:
            raise CheckpointError(f"{loc.path}: changed since it was indexed (size {loc.file_size} -> "
                                  f"{stat.st_size}, mtime {loc.file_mtime_ns} -> {stat.st_mtime_ns})")
        view = memoryview(out).cast("B")
        done = 0
        while done < loc.nbytes:
            try:
                got = os.preadv(fd, [view[done:]], loc.offset + done)
            except OSError as err:
                raise CheckpointError(f"{loc.path}: read failed at byte {loc.offset + done}: {err}") from err
            if got == 0:
                raise CheckpointError(f"{loc.path}: short read ({done} of {loc.nbytes} bytes at offset "
                                      f"{loc.offset})")
            done += got
    finally:
        os.close(fd)
    return out
