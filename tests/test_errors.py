"""The exception family (prefetch.errors): each engine failure raises its own
class, which also derives from the builtin prefetch raised before, so old
`except ValueError` / `except RuntimeError` clauses still catch it."""
import numpy as np
import pytest

import prefetch
from prefetch import errors


def test_each_class_is_a_prefetch_error_and_its_builtin():
    builtin = {
        errors.InvalidArgumentError: ValueError,
        errors.UnknownIdError: KeyError,
        errors.AlreadyRegisteredError: ValueError,
        errors.AcquireTimeoutError: TimeoutError,
        errors.HandleClosedError: RuntimeError,
        errors.CopyFailedError: RuntimeError,
        errors.OutOfMemoryError: MemoryError,
        errors.StateError: RuntimeError,
        errors.BackendUnavailableError: RuntimeError,
        errors.DiskReadError: OSError,
    }
    assert set(builtin) == set(errors.BY_KIND)
    for cls, base in builtin.items():
        assert issubclass(cls, errors.PrefetchError) and issubclass(cls, base)
        assert getattr(prefetch, cls.__name__) is cls
    assert prefetch.PrefetchError is errors.PrefetchError


def test_engine_failures_raise_their_class():
    h = prefetch.PrefetchHandle(device_budget_bytes=4096, backend="fault")
    h.register(0, np.zeros(1024, np.uint8))
    h.register(1, np.ones(1024, np.uint8))
    with pytest.raises(errors.UnknownIdError, match="tensor id 7"):
        h.acquire([7])
    with pytest.raises(errors.AlreadyRegisteredError):
        h.register(0, np.zeros(16, np.uint8))
    with pytest.raises(errors.InvalidArgumentError):
        h.prefetch_tensors([0], 99)  # no such band
    with pytest.raises(errors.StateError, match="not acquired"):
        h.release([0])
    h.set_faults(fail_every_nth_copy=1)
    with pytest.raises(errors.CopyFailedError, match="tensor id 1: copy failed"):
        h.acquire([1], timeout=10)
    h.set_faults(fail_every_nth_copy=0)
    h.pause()
    with pytest.raises(errors.AcquireTimeoutError, match="workers paused"):
        h.acquire([0], timeout=0.05)
    h.resume()
    h.set_faults(fail_every_nth_alloc=1)
    with pytest.raises(errors.OutOfMemoryError):
        h.register(2, np.zeros(64, np.uint8))
    h.set_faults(fail_every_nth_alloc=0)
    assert h.stats()["pinned_count"] == 0
    h.close()
    with pytest.raises(errors.HandleClosedError, match="closed"):
        h.stats()
    # Old clauses still catch them.
    with pytest.raises(RuntimeError):
        h.acquire([0])


def test_a_missing_backend_raises_backend_unavailable():
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present: the CUDA backend is available")
    except ImportError:
        pass
    with pytest.raises(errors.BackendUnavailableError, match="CUDA"):
        prefetch.PrefetchHandle(device_budget_bytes=4096, backend="cuda")
