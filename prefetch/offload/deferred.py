"""DeferredSpeculation: a host-routed layer's predictor part, run once
the layer's compute is queued (Note [Speculation after launch]) and sent
with the next acquire (Note [Speculation rides on the next acquire])."""
from __future__ import annotations

__all__ = ["DeferredSpeculation"]


class DeferredSpeculation:
    """Owned by an OffloadController (its `speculation`): `defers()` says
    whether a host-routed layer's predictor part waits; `defer` files a
    layer's routing for it; `speculate` runs it; `acquire_with_unsent`
    sends what `speculate(with_next_acquire=True)` left with the next
    acquire, `send_unsent` on its own; `close` scores and records what is
    pending and sends nothing. `deferred`: (layer, routed experts) not
    speculated yet; `unsent`: (layer, guesses, hints, clock) made and not
    sent yet."""

    def __init__(self, state):
        self._s = state
        self._routing = self._calls = None  # wire
        self.deferred = None
        self.unsent = None

    def wire(self, *, routing, calls) -> None:
        """The sibling parts this one calls (made after it, or calling it)."""
        self._routing, self._calls = routing, calls

    def defers(self) -> bool:
        """Note [Speculation after launch]
        On a host-routed layer (OffloadedMoEBlock, BM5) the GPU has drained
        by the time the routing reaches the host, and it idles until the
        layer's experts are acquired and their compute is queued: every
        microsecond of host work in between is added to the step. Scoring
        and recording the routing, the predictor's observe and predict, its
        hints and the queueing of its guesses need not be in that window
        when the predictor's guesses are host data (no hidden state to read
        back: `host_guesses`, `reads_routing`, or no predictor). Then
        `route_and_acquire` makes the critical call alone (release the last
        layer, cancel this layer's stale guesses, acquire) and the rest runs
        in `speculate`, which the caller calls once the layer's compute is
        queued, while the GPU works; the next `route_and_acquire` (or
        `flush`) runs it if the caller did not. Its engine call then goes
        with the next acquire's (Note [Speculation rides on the next
        acquire]). Measured on BM5 with the
        oracle on the gemma-4 trace (H200 host, before this): the
        predictor's part took 4.5-5.7 ms of a 37 ms step at a hit rate of
        1.00. The best moment is the next layer's, just before its routing
        read-back: the GPU then has this layer's expert compute and the next
        layer's attention and router queued, the longest work the host can
        hide behind (right after this layer's launch, the expert compute
        alone, a fraction of a millisecond at batch 1, was often done before
        the predictor was). OffloadedMoEBlock and BM5 call it there, except
        after a step's last layer: the next call is the next step's first,
        after the lm head and the token's read-back, too late for guesses
        aimed at the next step's first layers, so the last layer speculates
        right after its launch (without that exception, on the H200 host, the
        oracle's hit rate fell from 1.000 to 0.997 on gemma-4 and from
        0.856 to 0.847 on gpt-oss-120b). What the later moment costs: the
        guesses made there for the layer about to be acquired are dropped
        (its acquire takes them at band 0), so a host-guess predictor of
        distance d prefetches d - 1 layers ahead in effect. Where the copies
        set the pace that decides the step: on a CPU model of the link under
        BM5's gpt-oss-120b replay at 25 %, the oracle ran 1.27-1.33x the
        IO floor at distance 2 and 1.06-1.07x at 4 (1.19-1.28x at 2 when it
        speculated right after each acquire instead). A predictor that
        guesses from the hidden state on the device (the next-layer gate)
        keeps the single call: its guesses are read back with the routing,
        before the acquire."""
        st = self._s
        p = st.predictor
        return p is None or st.late_predict or bool(getattr(p, "host_guesses", False))

    def defer(self, layer: int, routed) -> None:
        """Layer `layer` was acquired, routed to `routed`; its predictor
        part waits for `speculate`."""
        self.deferred = (layer, routed)

    def acquire_with_unsent(self, layer: int, experts, stream, timeout: float, acquire_ids=None):
        """Note [Speculation rides on the next acquire]
        `speculate(with_next_acquire=True)` makes the last layer's guesses
        and hints on the host and leaves them for this call: one engine
        crossing a layer instead of two (the issue's "one call per layer";
        a call is 4-8 us of the engine's own on this project's development
        VM and 10.9 us on the H200 host by bench/engine_path.py, plus the
        controller's work around it). The
        guesses lose only the routing read-back's wait, during which the
        GPU computes the layer's attention and router: the guesses for
        this very layer are dropped (its acquire takes them at band 0),
        the later ones queue at their distance from this layer, and the
        hints keep the clock they were made at, so this layer's acquire
        evicts as a call made then would."""
        _, guesses, hints, clock = self.unsent
        self.unsent = None
        if layer in guesses:  # still scored (observe_and_guess filed them), not sent
            guesses = {t: g for t, g in guesses.items() if t != layer}
        # The guesses for this layer queued by earlier calls are cancelled
        # by this call, as ever (exchange's `stale`).
        return self._calls.exchange(layer, experts, guesses, hints, stream=stream, timeout=timeout, now=clock,
                                acquire_ids=acquire_ids)

    def send_unsent(self) -> None:
        """Sends the guesses and hints `speculate(with_next_acquire=True)`
        left when something other than the next acquire comes first."""
        layer, guesses, hints, clock = self.unsent
        self.unsent = None
        if not self._s.handle.closed:
            self._calls.send_guesses(layer, guesses, hints, now=clock)

    def speculate(self, with_next_acquire: bool = False) -> None:
        """The deferred part of the last `route_and_acquire` (Note
        [Speculation after launch]): score and record its routing, run the
        predictor, queue its guesses and send its hints in one engine call.
        Nothing to do after a call that did it all, or twice.
        `with_next_acquire`: the guesses and hints go with the next
        `route_and_acquire`'s engine call instead (Note [Speculation rides
        on the next acquire]); for a caller about to make it (any other
        engine call sends them first)."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return
        st = self._s
        if st.predictor is None and st.trace is None and not st.pending:
            # Nothing to score, record, guess or hint: the next acquire goes
            # alone, the same engine call (on-demand's speculate phase took
            # 3.7-4.3 us a layer on the H200 host in a host-only BM5 replay).
            return
        layer, routed = deferred
        guesses, hints = self._routing.observe_and_guess(layer, routed)
        if self._s.handle.closed:
            return
        if with_next_acquire:
            self.unsent = (layer, guesses, hints, st.clock)
        else:
            self._calls.send_guesses(layer, guesses, hints)

    def close(self) -> None:
        """The controller closes: the deferred routing is scored and
        recorded; nothing more is prefetched."""
        self.unsent = None
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            self._routing.observe(*deferred, {})

    def drop(self) -> None:
        self.unsent = None
        self.deferred = None
