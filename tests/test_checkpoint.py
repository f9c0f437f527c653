"""prefetch.checkpoint: safetensors headers and sharded indexes, read as
untrusted input (Note [Safetensors headers are untrusted]). Files are
written here by hand in the documented format: 8-byte little-endian header
length, JSON header, data."""
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prefetch
from prefetch.checkpoint import INDEX_FILE, index_checkpoint, read_safetensors_header, read_tensor
from prefetch.errors import CheckpointError


def write_safetensors(path, tensors, *, header=None, pad=b"", raw_header=None):
    """tensors: {name: numpy array}, laid out back to back. `header`
    replaces the computed one (a dict), `raw_header` its bytes."""
    entries, blobs, pos = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
                 np.dtype(np.uint8): "U8"}[arr.dtype]
        entries[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    head = raw_header if raw_header is not None else json.dumps(header if header is not None else entries).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs) + pad)
    return entries


def arrays(seed):
    rng = np.random.default_rng(seed)
    return {f"model.layers.{seed}.mlp.experts.{e}.w": rng.standard_normal((4, 3)).astype(np.float32)
            for e in range(3)}


def test_sharded_checkpoint_round_trip(tmp_path):
    a, b = arrays(0), arrays(1)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", a)
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", b)
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in a},
                  **{n: "model-00002-of-00002.safetensors" for n in b}}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index = index_checkpoint(tmp_path)
    assert set(index) == set(a) | set(b)
    for name, arr in {**a, **b}.items():
        loc = index[name]
        assert loc.dtype == "F32" and loc.shape == arr.shape and loc.nbytes == arr.nbytes
        assert read_tensor(loc).tobytes() == arr.tobytes()
        out = np.empty(loc.nbytes, dtype=np.uint8)
        assert read_tensor(loc, out) is out and out.tobytes() == arr.tobytes()


def test_folder_without_index_and_empty_tensors(tmp_path):
    tensors = {"x": np.arange(6, dtype=np.int64), "empty": np.zeros((0, 5), np.float16),
               "y": np.ones(3, np.uint8)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    index = index_checkpoint(tmp_path)
    for name, arr in tensors.items():
        assert read_tensor(index[name]).tobytes() == arr.tobytes()


def header_case(tmp_path, header=None, raw=None, pad=b"", tensors=None):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, tensors if tensors is not None else {"w": np.zeros(4, np.float32)}, header=header,
                      raw_header=raw, pad=pad)
    return path


GOOD = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header,raw,match", [
    (None, b"[1, 2]", "not a JSON object"),
    (None, b"{not json", "not JSON"),
    (None, b"\xff\xfe{}", "not JSON"),
    (None, b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "w": {}}', "repeated key 'w'"),
    ({"w": {**GOOD, "extra": 1}}, None, "exactly the fields"),
    ({"w": {"dtype": "F32", "shape": [4]}}, None, "exactly the fields"),
    ({"w": {**GOOD, "dtype": "F128"}}, None, "unknown dtype 'F128'"),
    ({"w": {**GOOD, "shape": [-4]}}, None, "non-negative integers"),
    ({"w": {**GOOD, "shape": [True, 4]}}, None, "non-negative integers"),
    ({"w": {**GOOD, "shape": "4"}}, None, "non-negative integers"),
    ({"w": {**GOOD, "data_offsets": [0, 17]}}, None, r"data_offsets \[0, 17\]"),
    ({"w": {**GOOD, "data_offsets": [8, 4]}}, None, "begin <= end"),
    ({"w": {**GOOD, "data_offsets": [-16, 0]}}, None, "begin <= end"),
    ({"w": {**GOOD, "data_offsets": [0, 1.5e1]}}, None, "begin <= end"),
    ({"w": {**GOOD, "shape": [3]}}, None, r"data_offsets span 16 bytes; shape \[3\] of F32 is 12 bytes"),
    ({"w": {**GOOD, "dtype": ["F32"]}}, None, r"unknown dtype \['F32'\]"),  # not hashable: was a TypeError
    ({"w": {**GOOD, "dtype": {}}}, None, "unknown dtype {}"),
    # Each under Python's 4300 digits, their product over: formatting it was a bare ValueError.
    ({"w": {**GOOD, "shape": [10 ** 4000, 10 ** 4000]}}, None, "is more bytes than that"),
    ({"w": {**GOOD, "shape": [10 ** 4000, 0]}}, None, "data_offsets span 16 bytes; .* is 0 bytes"),
    ({"w": GOOD, "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, None, "overlap"),
    ({"w": GOOD, "__metadata__": {"format": 1}}, None, "__metadata__"),
])
def test_malformed_headers_raise_checkpoint_error(tmp_path, header, raw, match):
    path = header_case(tmp_path, header=header, raw=raw)
    with pytest.raises(CheckpointError, match=match):
        read_safetensors_header(path)


def test_header_length_and_short_files(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte header length"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="runs past the file"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 200 << 20) + b" " * 64)
    with pytest.raises(CheckpointError, match="runs past the file"):
        read_safetensors_header(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_safetensors_header(tmp_path / "missing.safetensors")
    # The errors are ValueErrors too, and exported from the package.
    assert issubclass(prefetch.CheckpointError, ValueError)


def test_index_files_are_checked(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(4, np.float32)})
    cases = [
        ({"weight_map": {"w": "../a.safetensors"}}, "not a plain file name"),
        ({"weight_map": {"w": "/etc/passwd"}}, "not a plain file name"),
        ({"weight_map": {"w": 3}}, "not a plain file name"),
        ({"weight_map": {"w": ["a.safetensors"]}}, "not a plain file name"),
        ({"weight_map": {"w": "b.safetensors"}}, "'b.safetensors' named by .* is missing"),
        ({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}, "'v' mapped to 'a.safetensors'"),
        ({"weights": {}}, "no weight_map"),
        ([1], "no weight_map"),
    ]
    for doc, match in cases:
        (tmp_path / INDEX_FILE).write_text(json.dumps(doc))
        with pytest.raises(CheckpointError, match=match):
            index_checkpoint(tmp_path)
    (tmp_path / INDEX_FILE).write_bytes(b"{oops")
    with pytest.raises(CheckpointError, match="not a readable JSON index"):
        index_checkpoint(tmp_path)
    os.remove(tmp_path / INDEX_FILE)
    write_safetensors(tmp_path / "b.safetensors", {"w": np.ones(4, np.float32)})
    with pytest.raises(CheckpointError, match="tensor 'w' is in .*a.safetensors and in .*b.safetensors"):
        index_checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no .* and no \\*.safetensors file"):
        index_checkpoint(empty)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_changed_file_is_refused_and_no_descriptor_leaks(tmp_path):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"w": np.arange(8, dtype=np.float32), "v": np.arange(4, dtype=np.float32)})
    index = index_checkpoint(tmp_path)
    before = open_fds()
    with pytest.raises(ValueError, match="bytes"):
        read_tensor(index["w"], np.empty(3, np.uint8))
    # Truncated under us: the size check refuses it before reading.
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(CheckpointError, match="changed since it was indexed"):
        read_tensor(index["v"])
    # Same size and mtime, but shorter than the location says: a short read.
    stat = os.stat(path)
    loc = index["v"].__class__(**{**index["v"].__dict__, "file_size": stat.st_size,
                                  "file_mtime_ns": stat.st_mtime_ns})
    with pytest.raises(CheckpointError, match="short read"):
        read_tensor(loc)
    os.remove(path)
    with pytest.raises(CheckpointError, match="cannot open"):
        read_tensor(index["w"])
    assert open_fds() == before


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), cut=st.integers(min_value=0, max_value=400))
def test_arbitrary_bytes_never_escape_as_anything_but_checkpoint_error(tmp_path, data, cut):
    # Random files, and a valid file cut or with bytes replaced: either a
    # checked index whose every location lies inside the file, or a
    # CheckpointError; never another exception, never a read outside.
    path = tmp_path / "fuzz.safetensors"
    write_safetensors(path, {"w": np.arange(6, dtype=np.float32), "v": np.arange(2, dtype=np.int64)})
    good = path.read_bytes()
    mutated = good[:cut] + data + good[cut + len(data):]
    for blob in (data, mutated, good[:cut]):
        path.write_bytes(blob)
        try:
            index = read_safetensors_header(path)
        except CheckpointError:
            continue
        size = len(blob)
        for loc in index.values():
            assert 8 <= loc.offset and loc.offset + loc.nbytes <= size
            assert read_tensor(loc).nbytes == loc.nbytes


def test_a_huge_shape_is_refused_without_multiplying_it_out(tmp_path):
    # The product of a header's dimensions was taken in full before the
    # comparison with its span: 1000 dimensions of 4000 digits took 72 s.
    import time

    big = int("9" * 4000)
    path = header_case(tmp_path, raw=json.dumps({"w": {**GOOD, "shape": [big] * 1000}}).encode())
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="more bytes than that"):
        read_safetensors_header(path)
    assert time.perf_counter() - t0 < 10  # about 0.3 s here; the old code would take minutes


def _fifo(path):
    os.mkfifo(path)
    return path


def _in_child(code: str, timeout: float = 60):
    """Runs `code` in a child Python (a hang is then a failure, not a stuck
    suite); returns its output."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    # open() of a FIFO waits for a writer: a *.safetensors FIFO in a
    # checkpoint folder hung index_checkpoint for good.
    fifo = _fifo(str(tmp_path / "a.safetensors"))
    write_safetensors(tmp_path / "b.safetensors", {"w": np.zeros(4, np.float32)})
    out = _in_child(f"""
from prefetch.checkpoint import index_checkpoint, read_safetensors_header
from prefetch.errors import CheckpointError
try:
    read_safetensors_header({fifo!r})
except CheckpointError as e:
    print("refused:", e)
print(sorted(index_checkpoint({str(tmp_path)!r})))  # the FIFO is not a shard
""")
    assert "refused:" in out and "not a regular file" in out and "['w']" in out


def test_an_index_that_cannot_be_read_is_not_taken_for_no_index(tmp_path):
    write_safetensors(tmp_path / "b.safetensors", {"w": np.zeros(4, np.float32)})
    os.symlink(tmp_path / "gone.json", tmp_path / INDEX_FILE)  # dangling: was ignored, the folder read without it
    with pytest.raises(CheckpointError, match="not a readable JSON index"):
        index_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        index_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no such directory"):
        index_checkpoint(tmp_path / "b.safetensors")
