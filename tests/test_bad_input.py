"""Every bad input gets a clear Python exception and leaves the engine as it
was: same queue, same residents, same counters."""
import numpy as np
import pytest
from conftest import wait_drained

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
    # The fixture's prefetches of 0 and 1 run meanwhile: let them land, or
    # one lands between the snapshots (CI on ed33fdc, under ASan).
    wait_drained(h)
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


BAD_OPTIONS = [
    (dict(device_budget_bytes=0), ValueError, r"device_budget_bytes must be in 256\.\..*, got 0"),
    (dict(device_budget_bytes=255), ValueError, r"device_budget_bytes must be in 256\.\."),
    (dict(device_budget_bytes=[]), ValueError, "at least one device"),
    (dict(device_budget_bytes=1e6), TypeError, r"device_budget_bytes must be an int, got float 1000000\.0"),
    (dict(device_budget_bytes="4096"), TypeError, "device_budget_bytes must be an int, got str"),
    (dict(device_budget_bytes=True), TypeError, "device_budget_bytes must be an int, got a bool"),
    (dict(device_budget_bytes=None), TypeError, "device_budget_bytes must be an int, got NoneType"),
    (dict(device_budget_bytes=[4096, 2.5]), TypeError, r"device_budget_bytes\[1\] must be an int, got float"),
    (dict(device_budget_bytes=[4096, -1]), ValueError, r"device_budget_bytes\[1\] must be in 256\.\."),
    (dict(device_budget_bytes=2**70), ValueError, "device_budget_bytes must be in"),
    (dict(device_budget_bytes=4096, eviction_policy="mru"), ValueError, "eviction policy"),
    (dict(device_budget_bytes=4096, eviction_policy=1), TypeError, "eviction_policy must be"),
    (dict(device_budget_bytes=4096, backend=None), TypeError, "backend must be"),
    (dict(device_budget_bytes=[4096], num_devices=2), ValueError, "num_devices=2 disagrees"),
    (dict(device_budget_bytes=4096, num_devices=0), ValueError, r"num_devices must be in 1\.\.64"),
    (dict(device_budget_bytes=4096, num_devices=1.0), TypeError, "num_devices must be an int"),
    (dict(device_budget_bytes=4096, copy_chunk_bytes=0), ValueError, "copy_chunk_bytes must be in 1"),
    (dict(device_budget_bytes=4096, copy_chunk_bytes=4e6), TypeError, "copy_chunk_bytes must be an int"),
    (dict(device_budget_bytes=4096, max_bytes_in_flight=-1), ValueError, "max_bytes_in_flight must be in 1"),
    (dict(device_budget_bytes=4096, max_bytes_in_flight=2.0**28), TypeError, "max_bytes_in_flight must be an int"),
    (dict(device_budget_bytes=4096, copy_lanes=0), ValueError, r"copy_lanes must be in 1\.\.8, got 0"),
    (dict(device_budget_bytes=4096, copy_lanes=2**40), ValueError, r"copy_lanes must be in 1\.\.8"),
    (dict(device_budget_bytes=4096, copy_lanes="2"), TypeError, "copy_lanes must be an int"),
    (dict(device_budget_bytes=4096, copy_poll_us=-1), ValueError, r"copy_poll_us must be in 0\.\.100000, got -1"),
    (dict(device_budget_bytes=4096, copy_poll_us=10**6), ValueError, r"copy_poll_us must be in 0\.\.100000"),
    (dict(device_budget_bytes=4096, copy_poll_us=2.5), TypeError, "copy_poll_us must be an int"),
    (dict(device_budget_bytes=4096, start_paused=1), TypeError, "start_paused must be True or False"),
    (dict(device_budget_bytes=4096, poison_freed_slots="yes"), TypeError, "poison_freed_slots must be True or False"),
    (dict(device_budget_bytes=4096, faults={"copy_delay_us": 1}), ValueError, "faults= needs backend='fault'"),
    (dict(device_budget_bytes=4096, debug_issue_delay_us=-1), ValueError, "debug_issue_delay_us"),
]


@pytest.mark.parametrize("options,error,message", BAD_OPTIONS)
def test_bad_constructor_options_name_the_option(options, error, message):
    options = dict(options)
    options.setdefault("backend", "host")
    with pytest.raises(error, match=message):
        prefetch.PrefetchHandle(**options)


def test_constructor_options_accept_numpy_ints_and_bools():
    with prefetch.PrefetchHandle(
        device_budget_bytes=np.int64(4096), backend="host", copy_lanes=np.int32(3),
        start_paused=np.bool_(True), num_devices=np.uint8(1),
    ) as h:
        assert h.budget_bytes(0) == 4096
        h.register(0, b"abcd")
        h.prefetch_tensors([0])
        assert h.queued() == [(prefetch.DEFAULT_PRIORITY, 0)]  # start_paused held it


def test_positional_constructor_arguments_say_keywords_only():
    with pytest.raises(TypeError, match=r"keyword arguments only.*device_budget_bytes=1048576"):
        prefetch.PrefetchHandle(1 << 20)
    with pytest.raises(TypeError, match="keyword arguments only, got 2 positional"):
        prefetch.PrefetchHandle(1 << 20, "host")
    with pytest.raises(TypeError, match="device_budget_bytes"):
        prefetch.PrefetchHandle(backend="host")  # the required option is named


def test_a_built_handle_cannot_be_initialised_again():
    with prefetch.PrefetchHandle(device_budget_bytes=4096, backend="host") as h:
        h.register(0, b"abcd")
        with pytest.raises(RuntimeError, match="already initialised"):
            h.__init__(device_budget_bytes=8192, backend="host")
        assert 0 in h and h.budget_bytes() == 4096  # the engine it had is untouched


@pytest.mark.parametrize("stream", [5, 0, {0: 5}, np.int64(7)])
def test_host_backend_refuses_a_stream_and_changes_nothing(h, stream):
    before = snapshot(h)
    with pytest.raises(ValueError, match="host backend has no streams"):
        h.acquire([2], stream=stream, timeout=1)
    with pytest.raises(ValueError, match="host backend has no streams"):
        h.acquire_slots([2], stream=stream, timeout=1)
    assert snapshot(h) == before  # nothing pinned, queued or counted
    h.resume()
    h.acquire([2], timeout=10)
    with pytest.raises(ValueError, match="host backend has no streams"):
        h.release([2], stream=stream)
    assert h.stats()["pinned_count"] == 1  # still acquired
    h.release([2], stream={})  # an empty dict names no stream
    assert h.stats()["pinned_count"] == 0
