"""Tensor contents derived from (id, version), so a checksum on acquire
exposes stale (old version), partial or misplaced (other id) bytes. Never all
zeros and never the poison byte pattern."""
import numpy as np


def content(tensor_id: int, version: int, nbytes: int) -> np.ndarray:
    i = np.arange(nbytes, dtype=np.uint64)
    mixed = (i * np.uint64(2 * tensor_id + 1) + np.uint64(tensor_id * 7919 + version * 104729 + 17)) % np.uint64(251)
    out = mixed.astype(np.uint8)
    out[0] = (tensor_id + version) % 200 + 1  # first byte never 0 or 0xDB
    return out


def check(view, tensor_id: int, version: int) -> None:
    expected = content(tensor_id, version, len(view))
    got = np.asarray(view)
    if not np.array_equal(got, expected):
        bad = int(np.flatnonzero(got != expected)[0])
        raise AssertionError(
            f"tensor {tensor_id} v{version}: byte {bad} is {got[bad]}, expected {expected[bad]}"
            f" ({int((got != expected).sum())} of {len(got)} bytes differ)"
        )
