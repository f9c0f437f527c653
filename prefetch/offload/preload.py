"""Preload: the cache filled ahead of the first tokens (Note [Preload]),
the wait for it (Note [Waiting for the preload]) and a prompt's next layer
read ahead (Note [Prefill read-ahead])."""
from __future__ import annotations

import time

import numpy as np

from prefetch._engine import NUM_BANDS
from prefetch.errors import InvalidArgumentError

__all__ = ["Preload", "LEAST_URGENT_BAND"]

LEAST_URGENT_BAND = NUM_BANDS - 1  # the engine's least urgent priority


class Preload:
    """Owned by an OffloadController (its `preloader`; the controller's
    `preload`, `wait_preloaded` and `read_ahead` call these):
    `queue(slots, only_if_all)` queues registered experts at the least
    urgent band and returns how many; `wait(timeout, progress)` blocks
    until the engine has copied everything queued; `read_ahead` adds a
    prompt's next layer to a layer's guesses. The counts go to the
    accounting (`preloaded`, `read_aheads`)."""

    def __init__(self, handle, prefetcher, accounting, num_layers: int, num_experts: int):
        self._handle = handle
        self._prefetcher = prefetcher
        self._accounting = accounting
        self._num_layers = num_layers
        self._num_experts = num_experts
        # Note [Prefill read-ahead]: cache slots (set by the transformers
        # adapter; 0 turns it off).
        self.read_ahead_slots = 0

    def queue(self, slots: int, only_if_all: bool = False) -> int:
        """Note [Preload]
        A cache starts empty, so the first tokens after offloading copy on
        demand every expert they route to, and until every routed expert
        has come once a step still misses now and then (BM6 at a cache of
        every expert: 34 first copies and 24 of 64 steps off the steady
        path). This queues, at the least urgent band (every miss
        and guess goes first), as many of the registered experts as
        `slots` cache slots hold: all of them layer by layer where they
        fit, otherwise the first experts of every layer in turn, so each
        layer starts with the same share; with `only_if_all`, nothing
        unless all of them fit. Returns how many were queued."""
        chosen = sorted(self._prefetcher.registered_experts())  # layer by layer
        if len(chosen) > slots:
            if only_if_all:
                return 0
            # Each expert's rank in its layer: the layers' first experts,
            # then their second ones, and so on.
            rank: dict = {}
            ranked = []
            for layer, e in chosen:
                ranked.append((rank.get(layer, 0), layer, e))
                rank[layer] = rank.get(layer, 0) + 1
            chosen = [(layer, e) for _, layer, e in sorted(ranked)][:max(0, slots)]
        if not chosen:
            return 0
        ids = np.fromiter((self._prefetcher.tensor_id(layer, e) for layer, e in chosen), dtype=np.int64,
                          count=len(chosen))
        self._handle.prefetch_tensors(ids, priority=LEAST_URGENT_BAND)
        self._accounting.preloaded += len(chosen)
        return len(chosen)

    def wait(self, timeout: float | None = None, *, progress: bool = False) -> bool:
        """Note [Waiting for the preload]
        The preload (Note [Preload]) copies in the background, and a
        serving stack that takes requests at once competes with it: Qwen3-
        30B-A3B's 54 GiB take about a second on the H200's link, and BM6's
        generates right after offloading found 173 experts not yet copied
        there. This blocks until the engine has no copy queued or being
        issued (its counters balance: enqueued + on_demand == copies +
        copy_errors + cancelled, queue_depth 0) and then, on CUDA, until the
        issued copies have landed (the engine's copy streams are the
        device's: torch.cuda.synchronize). It waits for every copy, not the
        preload's alone: call it before serving. A failed copy counts as
        done (the acquirer of its expert gets CopyFailedError). Returns
        True when done, False when `timeout` seconds passed first (the
        copies go on). `progress`: print how many of the preloaded experts
        are resident while it waits, at once and then about once a second.
        After close() it raises HandleClosedError, as every engine call
        does."""
        if timeout is not None and not timeout >= 0:
            raise InvalidArgumentError(f"timeout must be None or >= 0 seconds, not {timeout!r}")
        handle = self._handle
        start = time.monotonic()
        next_report = start  # the first report at once, then about once a second
        while True:
            s = handle.stats()
            issued = s["copies"] + s["copy_errors"] + s["cancelled"]
            if s["queue_depth"] == 0 and issued >= s["enqueued"] + s["on_demand"]:
                break
            now = time.monotonic()
            if timeout is not None and now - start >= timeout:
                return False
            if progress and now >= next_report:
                preloaded = self._accounting.preloaded
                print(f"prefetch: preloading, {min(s['resident_count'], preloaded)} of {preloaded} "
                      "experts cached", flush=True)
                next_report = now + 1.0
            time.sleep(0.001)
        if handle.backend == "cuda":
            import torch

            for d in range(handle.num_devices):
                torch.cuda.synchronize(handle.arena(d).device)
        return True

    def read_ahead(self, layer: int, experts: np.ndarray, guesses: dict, has_predictor: bool) -> dict:
        """Note [Prefill read-ahead]
        A call that routes to nearly every expert of its layer (90 % or
        more: a prompt, where each of hundreds of rows picks top-k) is
        followed by a next layer that does the same. Without a predictor
        nothing would be copied for that layer until its own routing, and
        the link would idle through this layer's compute and the host work
        in between, once per layer of the prefill (BM6, Qwen3-30B-A3B, a
        512-token prompt at a quarter of the experts cached: time to first
        token 1.40x its floor on-demand, 1.01x with the gate, which does
        keep the link busy). So, with no predictor, such a call also
        queues the next layer's experts at band 1, behind this layer's
        misses; the next layer's own call cancels those still queued, as it
        does a guess's. Only where the cache holds two layers' experts: a
        smaller one would evict the read-ahead before its use, or this
        layer's later pieces. Decode calls route to far fewer experts (8
        rows of top-8 over 64 experts: about 63 %) and never read ahead."""
        nxt = layer + 1
        num_experts = self._num_experts
        if (has_predictor or nxt >= self._num_layers or self.read_ahead_slots < 2 * num_experts
                or experts.shape[0] < 0.9 * num_experts or nxt in guesses):
            return guesses
        self._accounting.read_aheads += 1
        return {**guesses, nxt: np.arange(num_experts, dtype=np.int64)}
