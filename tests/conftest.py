"""Markers: `gpu` skips without CUDA; `multi_gpu(n)` skips with fewer than n
CUDA devices. Both skip cleanly on CI (no GPU). `hf` marks every test of a
file that names transformers: .ci/run runs those again on the newest
supported transformers. `harness` marks the tests of the benchmark harness
(HARNESS_FILES: BM6's rows, A/B pairs and reports, BM7 under torchrun, over
tiny CPU models), about half the suite's time: they are Python over the
engine calls the library's own tests make, so the sanitizer steps and the
newest-transformers step leave them out. `breadth` marks those and the
family table's tests (tests/test_families.py: every transformers MoE family,
the same offload each time): the sanitizer steps leave out `breadth`, the
newest-transformers step only `harness` (the family table is its point)."""
import importlib.util
import os
import pathlib
import time

import numpy as np
import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


_USES_TRANSFORMERS: dict = {}
HARNESS_FILES = {"test_bench_generate.py", "test_bench_generate_trace.py", "test_bench_ep_generate.py"}
BREADTH_FILES = HARNESS_FILES | {"test_families.py"}


def _uses_transformers(path: str) -> bool:
    """Whether a test file names transformers (the `hf` marker)."""
    if path not in _USES_TRANSFORMERS:
        _USES_TRANSFORMERS[path] = "transformers" in pathlib.Path(path).read_text(encoding="utf-8")
    return _USES_TRANSFORMERS[path]


def pytest_collection_modifyitems(config, items):
    count = _cuda_device_count()
    for item in items:
        if _uses_transformers(str(item.path)):
            item.add_marker(pytest.mark.hf)
        if item.path.name in HARNESS_FILES:
            item.add_marker(pytest.mark.harness)
        if item.path.name in BREADTH_FILES:
            item.add_marker(pytest.mark.breadth)
        if "gpu" in item.keywords and count == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        marker = item.get_closest_marker("multi_gpu")
        if marker is not None:
            need = marker.args[0] if marker.args else 2
            if count < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA devices, found {count}"))


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """A bench's main() run in-process (tests/test_bench_*.py) turns
    autograd off for the whole process; each test starts with it as the
    test before found it and leaves it so."""
    torch = importlib.import_module("torch") if importlib.util.find_spec("torch") else None
    before = torch.is_grad_enabled() if torch is not None else None
    yield
    if torch is not None:
        torch.set_grad_enabled(before)


@pytest.fixture
def rng():
    seed = int(os.environ.get("PREFETCH_TEST_SEED", "1234"))
    return np.random.default_rng(seed)


def random_bytes(rng, n: int) -> np.ndarray:
    """Random contents, never all zeros."""
    data = rng.integers(0, 256, size=n, dtype=np.uint8)
    data[0] = 0xA5
    return data


def wait_until(predicate, timeout=10.0):
    """Polls `predicate` every millisecond for up to `timeout` seconds;
    returns its last answer (assert it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return predicate()


def wait_drained(h, timeout: float = 10.0) -> dict:
    """Waits until the handle's workers have nothing queued or in flight;
    returns that stats snapshot. Fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = h.stats()
        if s["queue_depth"] == 0 and s["bytes_in_flight"] == 0:
            return s
        assert time.monotonic() < deadline, "workers did not drain"
        time.sleep(0.0002)


@pytest.fixture
def make_handle():
    import prefetch

    handles = []

    def make(**kwargs):
        kwargs.setdefault("backend", "host")
        h = prefetch.PrefetchHandle(**kwargs)
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.close()


ENGINE_CALLS = ("exchange", "step", "release", "acquire", "acquire_slots", "prefetch_tensors", "hint_next_use",
                "cancel")


def _as_logged(x):
    """An engine call's argument as the call saw it: arrays copied to lists
    (a buffer the caller reuses would change under a kept reference)."""
    return np.asarray(x).tolist() if isinstance(x, np.ndarray) else x


class CountingHandle:
    """Wraps a PrefetchHandle and counts the calls an offloaded layer makes
    into the engine: `calls["exchange"]` (the per-layer call, under its
    deprecated alias `step` too), `calls["release"]`, and every other
    crossing of ENGINE_CALLS under "other". Given `log`, also appends each
    such call to it as (name, args, kwargs), arrays as lists."""

    def __init__(self, handle, log: list | None = None):
        self.real = handle
        self.calls = {"exchange": 0, "release": 0, "other": 0}
        self.log = log

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if callable(attr) and name in ENGINE_CALLS:
            name = "exchange" if name == "step" else name
            key = name if name in self.calls else "other"

            def counted(*a, **k):
                self.calls[key] += 1
                if self.log is not None:
                    self.log.append((name, [_as_logged(x) for x in a], {n: _as_logged(v) for n, v in k.items()}))
                return attr(*a, **k)

            return counted
        return attr
