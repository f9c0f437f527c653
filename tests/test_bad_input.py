"""Every bad input gets a clear Python exception and leaves the engine as it
was: same queue, same residents, same counters."""
import numpy as np
import pytest

import prefetch


@pytest.fixture
def h(make_handle):
    handle = make_handle(device_budget_bytes=4096, start_paused=True)
    for tid in range(4):
        handle.register(tid, np.full(100, tid + 1, np.uint8))
    handle.prefetch_tensors([0, 1], priority=3)
    return handle


def snapshot(handle):
    s = handle.stats()
    for gauge in ("last_batch_ns", "last_batch_start_ns", "last_batch_end_ns"):
        s.pop(gauge)
    return handle.queued(), handle.resident(), s


BAD_IDS = [
    ([0, 99], KeyError, "tensor id 99"),
    ([2, -1], KeyError, "tensor id -1"),
    ([2**40], KeyError, "not registered"),
    ([2**70], OverflowError, "int64"),
    ([1.0], TypeError, "float"),
    ([True], TypeError, "bool"),
    ([0, np.bool_(True)], TypeError, "bool"),
    (np.array([1.5]), TypeError, "float64"),
    (np.array([True, False]), TypeError, "bool"),
    (np.zeros((2, 2), np.int64), ValueError, "1-D"),
    (np.array([2**63 + 5], dtype=np.uint64), OverflowError, "int64"),
    ("0123", TypeError, "str"),
    (3, TypeError, "int"),
    (None, TypeError, "NoneType"),
    ([[1]], TypeError, "list"),
]


@pytest.mark.parametrize("ids,exc,match", BAD_IDS)
def test_bad_ids_in_prefetch_change_nothing(h, ids, exc, match):
    before = snapshot(h)
    with pytest.raises(exc, match=match):
        h.prefetch_tensors(ids)
    assert snapshot(h) == before


@pytest.mark.parametrize("ids,exc,match", BAD_IDS)
def test_bad_ids_in_cancel_change_nothing(h, ids, exc, match):
    before = snapshot(h)
    with pytest.raises(exc, match=match):
        h.cancel(ids)
    assert snapshot(h) == before


@pytest.mark.parametrize("ids,exc,match", BAD_IDS)
def test_bad_ids_in_acquire_change_nothing(h, ids, exc, match):
    before = snapshot(h)
    with pytest.raises(exc, match=match):
        h.acquire(ids, timeout=0.01)
    assert snapshot(h) == before


@pytest.mark.parametrize(
    "priority,exc", [(-1, ValueError), (20, ValueError), (True, TypeError), (1.0, TypeError), ("1", TypeError)]
)
def test_bad_priority_changes_nothing(h, priority, exc):
    before = snapshot(h)
    with pytest.raises(exc, match="priority"):
        h.prefetch_tensors([2], priority=priority)
    with pytest.raises(exc, match="priority"):
        h.enqueue_prefetch(2, priority=priority)
    with pytest.raises(exc, match="priority"):
        h.cancel_below(priority)
    assert snapshot(h) == before


@pytest.mark.parametrize(
    "tensor_id,exc", [(True, TypeError), (1.5, TypeError), (-3, KeyError), (99, KeyError), (2**80, OverflowError)]
)
def test_bad_single_id(h, tensor_id, exc):
    before = snapshot(h)
    with pytest.raises(exc):
        h.enqueue_prefetch(tensor_id)
    assert snapshot(h) == before


def test_empty_batches_are_noops(h):
    before = snapshot(h)
    h.prefetch_tensors([])
    h.prefetch_tensors(np.array([], dtype=np.int64))
    h.prefetch_tensors(())
    assert h.cancel([]) == 0
    assert h.acquire([]) == []
    h.release([])
    assert snapshot(h) == before


def test_accepted_id_containers_are_lossless(h):
    import torch

    h.cancel_all()
    h.prefetch_tensors(np.array([3, 99, 2, 99], dtype=np.int64)[::2])  # non-contiguous
    h.prefetch_tensors(np.array([0], dtype=np.int32))
    h.prefetch_tensors(np.array([1], dtype=np.uint16))
    h.prefetch_tensors(torch.tensor([3, 0], dtype=torch.int32))
    h.prefetch_tensors(range(1, 2))
    h.prefetch_tensors((np.int64(2),))
    assert h.queued() == [(1, 3), (1, 2), (1, 0), (1, 1)]


def test_torch_id_tensors_are_checked(h):
    import torch

    before = snapshot(h)
    with pytest.raises(TypeError, match="float"):
        h.prefetch_tensors(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="bool"):
        h.prefetch_tensors(torch.tensor([True]))
    with pytest.raises(ValueError, match="1-D"):
        h.prefetch_tensors(torch.zeros(2, 2, dtype=torch.int64))
    assert snapshot(h) == before


def test_duplicate_ids_are_deduplicated(h):
    h.cancel_all()
    h.prefetch_tensors([2, 2, 3, 2])
    assert h.queued() == [(1, 2), (1, 3)]


def test_release_without_acquire_and_double_release(h):
    h.resume()
    h.acquire([2], timeout=10)
    before = snapshot(h)
    with pytest.raises(RuntimeError, match="tensor id 3 is not acquired"):
        h.release([2, 3])  # all-or-nothing: 2 stays pinned
    assert snapshot(h) == before
    h.release([2])
    with pytest.raises(RuntimeError, match="not acquired"):
        h.release([2])
    with pytest.raises(KeyError):
        h.release([77])


def test_duplicate_in_one_acquire_needs_two_releases(h):
    h.resume()
    h.acquire([2, 2], timeout=10)
    h.release([2])
    assert h.stats()["pinned_count"] == 1
    h.release([2])
    assert h.stats()["pinned_count"] == 0


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf")])
def test_bad_timeout(h, timeout):
    before = snapshot(h)
    with pytest.raises(ValueError, match="timeout"):
        h.acquire([2], timeout=timeout)
    assert snapshot(h) == before


def test_bad_registration(h):
    before = snapshot(h)
    with pytest.raises(ValueError, match="already registered"):
        h.register(0, b"x")
    with pytest.raises(ValueError, match="out of range"):
        h.register(prefetch.MAX_TENSOR_ID + 1, b"x")
    with pytest.raises(ValueError, match="out of range"):
        h.register(-5, b"x")
    with pytest.raises(ValueError, match="device"):
        h.register(10, b"x", device=1)
    with pytest.raises(ValueError, match="empty"):
        h.register(10, b"")
    with pytest.raises(ValueError, match="budget"):
        h.register(10, np.zeros(5000, np.uint8))
    with pytest.raises(TypeError):
        h.register(10, 12345)
    with pytest.raises(TypeError):
        h.register(True, b"x")
    with pytest.raises(ValueError, match="runs past"):
        h.register_parts(10, [(b"abcd", 2)], total_bytes=3)
    assert snapshot(h) == before
    assert 10 not in h


def test_bad_constructor_arguments():
    with pytest.raises(ValueError):
        prefetch.PrefetchHandle(device_budget_bytes=0, backend="host")
    with pytest.raises(ValueError):
        prefetch.PrefetchHandle(device_budget_bytes=[], backend="host")
    with pytest.raises(ValueError, match="eviction policy"):
        prefetch.PrefetchHandle(device_budget_bytes=4096, backend="host", eviction_policy="mru")
    with pytest.raises(TypeError):
        prefetch.PrefetchHandle(4096)  # keywords only
    with pytest.raises(ValueError, match="num_devices"):
        prefetch.PrefetchHandle(device_budget_bytes=[4096], num_devices=2, backend="host")
