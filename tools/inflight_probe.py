"""Does stats()["bytes_in_flight"] drop to 0 once a CUDA handle's copies are
done and nothing more is queued? (Note [Steady pins] in
prefetch/sync_free.py no longer waits for it.) Prints the gauge over time.

    python3 tools/inflight_probe.py
"""
import time

import numpy as np
import torch

import prefetch


def main() -> None:
    h = prefetch.PrefetchHandle(device_budget_bytes=64 << 20, backend="cuda" if torch.cuda.is_available() else "host")
    host = torch.empty(8 << 20, dtype=torch.uint8)
    if torch.cuda.is_available():
        host = host.pin_memory()
    for i in range(4):
        h.register(i, host[i * (2 << 20):(i + 1) * (2 << 20)])
    h.prefetch_tensors(np.arange(4, dtype=np.int64), 1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for wait_ms in (0, 10, 100, 1000):
        time.sleep(wait_ms / 1e3)
        s = h.stats()
        print(f"after {wait_ms:4d} ms more: copies {s['copies']} queue_depth {s['queue_depth']} "
              f"bytes_in_flight {s['bytes_in_flight']}")
    h.close()


if __name__ == "__main__":
    main()
