"""ExchangeState: the state an offloaded model's parts share (what is held
and on which stream, the uses, fetches and hints still to send, the guesses
queued and filed, the routing clock and step, the predictor and what it says
of itself). The controller owns one and hands it, with the handle and the
sibling parts each needs, to its parts: no part holds the controller
(issue #59: no layer calls back up into the one above it)."""
from __future__ import annotations

import threading

import numpy as np

from prefetch.expert_ids import Guesses

__all__ = ["ExchangeState"]


class ExchangeState:
    """Plain shared state, no behaviour beyond `ids`.

    - `handle`, `prefetcher`: the engine handle and its (layer, expert) ->
      tensor id mapping; `num_layers`, `num_experts`, `top_k`, `local`
      ([layers, experts] bool of this rank's experts, or None).
    - `forward_lock`: Note [One forward at a time] (prefetch/integration.py).
    - `step`, `clock`, `seen_layer0`: the routing clock (never goes back),
      the step in the request, whether layer 0 routed this request.
    - `held`, `held_stream`: tensor ids acquired, released by the next call.
    - `use`, `fetch`, `late_hints`: for the next engine call.
    - `queued_guess` (layer -> experts sent to the engine), `pending`
      ((step, layer) -> guessed experts, to be scored), `trace`.
    - `predictor` and its flags `late_predict`, `observes`,
      `distinct_guesses`, `host_guesses` (set by the controller's setter).
    - `sync_free`, `expert_bytes`, `cache_slots`, `flat_ids`.
    """

    __slots__ = ("handle", "prefetcher", "num_layers", "num_experts", "top_k", "local", "forward_lock",
                 "step", "clock", "seen_layer0", "held", "held_stream", "use", "fetch", "late_hints",
                 "queued_guess", "pending", "trace", "predictor", "late_predict", "observes",
                 "distinct_guesses", "host_guesses", "sync_free", "expert_bytes", "cache_slots", "flat_ids")

    def __init__(self, handle, prefetcher, *, num_layers: int, num_experts: int, top_k: int, local=None,
                 trace=None):
        self.handle = handle
        self.prefetcher = prefetcher
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.local = local
        self.forward_lock = threading.RLock()
        self.step = 0
        self.clock = -1  # routing calls so far, minus one: never goes back (hint_next_use)
        self.seen_layer0 = False  # a second layer-0 routing starts a new step
        self.held: np.ndarray | None = None
        self.held_stream = None
        self.use = None  # tensor ids read (from read_routings), for the next engine call
        self.fetch = None  # of those, the ones read from host memory: prefetched
        self.late_hints: list = []
        self.queued_guess: dict[int, np.ndarray] = {}
        self.pending = Guesses()
        self.trace = trace
        self.predictor = None
        self.late_predict = self.observes = self.distinct_guesses = self.host_guesses = False
        # Sync-free decode (Note [Sync-free decode] in prefetch/host_experts.py):
        # off until the transformers adapter enables it.
        self.sync_free = False
        self.expert_bytes = 0
        # Note [Step pins], Note [Host-routed step pins]: 0, no step plans.
        self.cache_slots = 0
        self.flat_ids = None  # (prefetcher version, [layers * experts] tensor ids)

    def ids(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Tensor ids of `experts` (distinct, in range: from _distinct) of
        `layer`; an unregistered one maps to -1, which the engine refuses."""
        return self.prefetcher._ids[layer][experts]
