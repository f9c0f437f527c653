"""prefetch.read_back.to_host: the routing read-back through a page-locked
buffer and an event (Note [Read-back without a pageable copy])."""
import os
import threading

import numpy as np
import pytest

from prefetch.read_back import to_host

torch = pytest.importorskip("torch")

SPIN_CYCLES = int(os.environ.get("PREFETCH_TEST_SPIN_CYCLES", 400_000_000))
UNDER_TOOL = os.environ.get("PREFETCH_TEST_UNDER_TOOL") == "1"


def test_a_host_tensor_comes_back_flat_with_its_values():
    import prefetch

    assert prefetch.to_host is to_host and "to_host" in prefetch.__all__
    t = torch.tensor([[3, 1], [4, 1]], dtype=torch.int64)
    got = to_host(t)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64
    assert got.tolist() == [3, 1, 4, 1]
    assert to_host(t.t()).tolist() == [3, 4, 1, 1]  # not contiguous: the logical order
    assert to_host(torch.empty(0, dtype=torch.int64)).shape == (0,)


def test_buffers_made_in_inference_mode_can_be_written_outside_it():
    # A serving stack may read its first routing inside torch.inference_mode
    # and a later one outside it: the buffer and views must be normal tensors.
    from prefetch import read_back

    key = (-1, torch.int64, torch.Size([2, 3]))  # a device index no read uses
    with torch.inference_mode():
        view, array = read_back._views(key, pin=False)
    assert not view.is_inference()
    view.copy_(torch.arange(6).reshape(2, 3))  # outside inference mode now
    assert array.tolist() == list(range(6))
    with torch.inference_mode():
        view.copy_(torch.zeros(2, 3, dtype=torch.int64))
    assert array.tolist() == [0] * 6
    read_back._local.buffers.pop((-1, torch.int64))
    read_back._local.views.pop(key)


@pytest.mark.gpu
def test_a_device_read_waits_for_the_queued_work_and_owns_its_values():
    stream = torch.cuda.current_stream()
    t = torch.zeros(8, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(SPIN_CYCLES)  # the read must wait for this and the fill behind it
    t.fill_(7)
    if stream.query():
        if UNDER_TOOL:
            pytest.skip("the spin ended before the read: the ordering was not exercised")
        raise AssertionError("the spin ended before the read: the ordering was not exercised")
    first = to_host(t)
    assert first.tolist() == [7] * 8
    # The next read reuses the page-locked buffer: the first result is a copy.
    second = to_host(torch.arange(8, device="cuda") * 2)
    assert second.tolist() == list(range(0, 16, 2)) and first.tolist() == [7] * 8
    # Longer than the buffer so far (it grows), of another dtype, not contiguous.
    big = torch.arange(3000, dtype=torch.int32, device="cuda").reshape(1000, 3)
    assert to_host(big.t()).tolist() == big.t().reshape(-1).cpu().tolist()
    # More distinct shapes than the views kept: each still reads its values.
    for n in range(1, 80):
        assert to_host(torch.full((n,), n, dtype=torch.int64, device="cuda")).tolist() == [n] * n
    # First read of a shape inside inference mode, the next outside it.
    with torch.inference_mode():
        assert to_host(torch.full((3, 5), 4, device="cuda")).tolist() == [4] * 15
    assert to_host(torch.full((3, 5), 6, device="cuda")).tolist() == [6] * 15
    # A stream of our own: the read follows that stream's work.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        u = torch.zeros(4, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(SPIN_CYCLES)
        u.fill_(5)
        assert to_host(u).tolist() == [5] * 4


@pytest.mark.gpu
def test_threads_read_through_buffers_of_their_own():
    errors = []

    def reader(value):
        try:
            for _ in range(200):
                t = torch.full((64,), value, dtype=torch.int64, device="cuda")
                got = to_host(t)
                if got.tolist() != [value] * 64:
                    errors.append((value, got[:4].tolist()))
                    return
        except Exception as ex:  # noqa: BLE001 - reported below
            errors.append(ex)

    threads = [threading.Thread(target=reader, args=(v,)) for v in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
