"""The sync-free decode part of OffloadController (Note [Sync-free decode]
in prefetch/host_experts.py): each layer pins what is cached without
waiting for its routing, the step's routings come back in one copy at the
next step, and each step picks its path (Note [Which path a step takes] in
prefetch/offload/path_choice.py)."""
from __future__ import annotations

import time

import numpy as np

from prefetch._engine import mark_pinned, read_routed
from prefetch.expert_ids import EMPTY as _EMPTY
from prefetch.offload.path_choice import PathChoice
from prefetch.read_back import to_host

__all__ = ["SyncFreeDecode"]


class SyncFreeDecode:
    """Owned by an OffloadController (its `sync`): the sync-free path.
    `enable` sets it up for a model's experts (the controller's
    enable_sync_free); per step `choose_path` picks the path; per layer
    `pin_layer` makes the engine call and `note_routing` keeps the routing,
    `queue_read_back` after a step's last layer; `read_routings` reads a
    step's routings back. The step plan (prefetch/offload/step_plan.py)
    shares `step_plan`, `pin_call`, `hints_to_send` and `expect_step`.
    The engine-call state every path shares (what is held, the uses,
    fetches and hints still to send), the clock and the predictor are the
    shared ExchangeState (prefetch/offload/exchange_state.py); the routing
    and engine-call parts are wired in after it is made."""

    def __init__(self, state, *, acct, gate):
        self._s = state
        self._acct = acct
        self._gate = gate
        self._routing = self._calls = None  # wire

    def wire(self, *, routing, calls) -> None:
        """The sibling parts made after this one."""
        self._routing, self._calls = routing, calls
        self._routings: list = []  # (layer, step, device routing, pinned mask), not read back yet
        self._steady = None  # this step's pins are all held (Note [Steady pins])
        self.active = False  # this step's path (Note [Which path a step takes]), once enabled
        self._path = None
        self.sync_free_steps = 0  # steps that took the sync-free path (choose_path's answers)
        self.steady_steps = 0  # steps whose layers made one engine call in all (Note [Steady pins])
        self.early_read_backs = 0  # reads served by a queued copy (Note [Routing read-back queued early])

    def enable(self, num_experts: int, adaptive: bool = True) -> None:
        """Sets the path up for `num_experts` experts a layer (the
        controller's enable_sync_free)."""
        st = self._s
        self.active = True  # this step's path (Note [Which path a step takes])
        self._adaptive = adaptive
        self._path = PathChoice()
        self._engine_counts = None  # (hits, misses) at the start of a synced step
        self._step_missed = None  # fraction of routed experts the last step missed
        # Tensor id of every (layer, expert), -1 where not registered here (the
        # prefetcher's table per layer ends at the last expert it registered).
        self._all_ids = np.full((st.num_layers, num_experts), -1, dtype=np.int64)
        for layer in range(st.num_layers):
            table = st.prefetcher._ids.get(layer, _EMPTY)[:num_experts]
            self._all_ids[layer, : table.shape[0]] = table
        # Expert parallel: only this rank's experts are pinned, used and
        # fetched (the others are not registered here; their id is -1).
        self._owned = self._all_ids >= 0
        self._layer_ids = [ids[own] for ids, own in zip(self._all_ids, self._owned)]
        # The pinned offsets of every layer, one row each (-1: not pinned).
        self._all_out = np.full((st.num_layers, num_experts), -1, dtype=np.int64)
        self._pin_out = list(self._all_out)
        # The engine writes the pinned offsets here; it is _pin_out itself
        # where the rank owns the whole layer.
        self._pin_buf = [out if own.all() else np.empty(int(own.sum()), dtype=np.int64)
                         for out, own in zip(self._pin_out, self._owned)]
        self._owns_all = bool(self._owned.all())
        # Per layer, which experts the last pin_layer pinned. A noted routing
        # keeps its layer's row (a view); pin_layer reads the noted routings
        # before it writes a row one of them still refers to, so
        # read_routings gathers them in one index.
        self._pinned = np.zeros((st.num_layers, num_experts), dtype=bool)
        # Flat views (entry layer * experts + expert) for read_routed and
        # mark_pinned, the bool tables as bytes; _routed: the last read's
        # routed (layer, expert) pairs.
        self._pinned_u8 = self._pinned.reshape(-1).view(np.uint8)
        self._pinned_rows = list(self._pinned)
        self._pinned_rows_u8 = list(self._pinned.view(np.uint8))
        self._owned_u8 = self._owned.reshape(-1).view(np.uint8)
        self._all_ids_flat = self._all_ids.reshape(-1)
        self._routed = np.zeros((st.num_layers, num_experts), dtype=bool)
        self._routed_u8 = self._routed.reshape(-1).view(np.uint8)
        # (layer, expert) pairs any step read so far, on either path: a
        # sync-free step's miss of a pair never read before is one no path
        # avoids, and does not fail a try (Note [Which path a step takes]).
        self.seen = np.zeros((st.num_layers, num_experts), dtype=bool)
        self._seen_u8 = self.seen.reshape(-1).view(np.uint8)
        self._step_missed_again = None  # of the last sync-free step: misses of pairs read before
        # Note [Steady pins]: every layer's ids this rank owns, row by row, and
        # where one call pins them all; _steady: this step's pins are all held.
        self._all_owned_ids = self._all_ids[self._owned]
        self._all_out_flat = self._all_out.reshape(-1)  # a view
        self._all_buf = self._all_out_flat if self._owns_all else np.empty_like(self._all_owned_ids)
        self._steady = None
        self._last_misses = None  # routed experts the last read step did not find pinned
        # Note [Step pins]: the pin call's answers for a whole step's reads.
        self._step_buf = np.empty(st.num_layers * num_experts, dtype=np.int64)
        # Note [Routing read-back queued early]: (routings covered, the
        # page-locked slice copied into, event after it) of the copy queued
        # at the last layer; the buffer and event are reused.
        self._early = None
        self._early_buf = None
        self._early_event = None

    @property
    def path_switches(self) -> int:
        """Switches between the sync-free and the synced path so far."""
        return self._path.switches

    @property
    def sync_free_held(self) -> int:
        """Synced steps that missed little but waited out a failed try's
        hold (Note [Which path a step takes])."""
        return self._path.held

    def choose_path(self) -> bool:
        """Called at layer 0 of a step whose calls could run sync-free: reads
        the last step's routings, and from what that step missed picks this
        step's path (PathChoice, Note [Which path a step takes]).
        sync_free=True skips the choice."""
        st = self._s
        if self._routings:
            self.read_routings()
        if not self._adaptive:
            self.sync_free_steps += 1
            return True
        if not self.active:
            counts = self._engine_hits_misses()
            if self._engine_counts is not None:
                hits, misses = (n - b for n, b in zip(counts, self._engine_counts))
                if hits + misses:
                    self._step_missed = misses / (hits + misses)
            self._engine_counts = counts
        active = self._path.after(self._step_missed, self._step_missed_again)
        self._step_missed = self._step_missed_again = None
        if active != self.active:
            self.active = active
            # Synced steps count their misses from here on.
            self._engine_counts = None if active else self._engine_hits_misses()
        if not self.active and (st.use is not None or st.fetch is not None):
            self._calls.flush()  # the last sync-free step's uses and misses reach the engine now
        self.sync_free_steps += self.active
        return self.active

    def _engine_hits_misses(self) -> tuple[int, int]:
        s = self._s.handle.stats()
        return s["hits"], s["misses"]

    def pin_layer(self, layer: int, hidden, stream) -> tuple[np.ndarray, np.ndarray]:
        """The sync-free path's one engine call for `layer`: release what the
        last layer held, report the uses read from the last step's routing
        and prefetch what it read from host memory (at layer 0; see
        `read_routings`), queue a host-side predictor's guesses, pin every
        resident expert of `layer`. Returns (the slot offset of each expert
        of the layer, -1 where not pinned: read from host memory; the pinned
        mask)."""
        st = self._s
        routings = self._routings
        if routings and routings[-1][0] >= layer:  # a new step (or a layer again): its rows are rewritten below
            self.read_routings()
        if self._steady is not None:
            if layer != 0 and stream == st.held_stream:
                return self._pin_out[layer], self._pinned_rows[layer]
            self._steady = None  # a new step (or another stream): the call below releases them
        elif layer == 0:
            if self._steady_step() and self._nothing_queued():
                self._pin_all(stream)
                return self._pin_out[0], self._pinned_rows[0]
            plan = self.step_plan()
            if plan is not None:
                self.pin_step(plan[0], plan[1], stream)
                return self._pin_out[0], self._pinned_rows[0]
        use, fetch = st.use, st.fetch
        if st.host_guesses and self._gate.predicts_now():
            routing = self._routing
            guesses = routing.host_predict(st.step, layer, hidden)
            # Scored when their layers' routings are read back, a step later
            # (read_routings), as the synced path scores its guesses.
            routing.expect(st.step, layer, guesses)
            if not routing.held_back(guesses):
                extra = [self._owned_ids(target, g) for target, g in guesses.items() if g.shape[0]]
                if fetch is not None and fetch.shape[0]:
                    extra.append(fetch)
                if len(extra) == 1:  # the oracle at distance 1 on a cached step: distinct already
                    fetch = extra[0]
                elif extra:
                    fetch = np.unique(np.concatenate(extra))
        hint_ids, hint_when, had_hints = self.hints_to_send()
        out, buf = self._pin_out[layer], self._pin_buf[layer]
        self.pin_call(self._layer_ids[layer], buf, use, fetch, hint_ids, hint_when, had_hints, stream)
        if buf is not out:
            out[self._owned[layer]] = buf
        st.held = mark_pinned(out, self._pinned_rows_u8[layer], buf, self._layer_ids[layer])
        return out, self._pinned_rows[layer]

    def whole_step_offsets(self) -> np.ndarray | None:
        """Every layer's pinned slot offsets as one flat [layers x experts]
        array (-1: not pinned) while this step's first layer pinned the
        whole step (Note [Steady pins], Note [Step pins]); None otherwise.
        The controller's own array: read it, do not keep it past the step."""
        return self._all_out_flat if self._steady is not None else None

    # -- Note [Steady pins]
    # A decode whose cache holds its working set runs sync-free steps that
    # miss nothing and fetch nothing, and each of its layers still made an
    # engine call (release the last layer's pins, pin this one's): 31-42 us
    # a layer inside generate on the H200 host, a third of what
    # an offloaded layer adds to the resident model's. In such a step
    # nothing needs a free slot, so at layer 0 of a step whose last step
    # missed nothing, with nothing to fetch or guess and no copy queued,
    # one call pins every resident expert of every layer this rank owns
    # (and reports the last step's uses and sends its next-use hints: an
    # oracle on a next-use handle has hints every step, and on the H200 it
    # was steady on no step while a step with hints was not); the other
    # layers make no engine call, and the last layer releases them all, as
    # it releases its own pins on the layer-by-layer path, so nothing stays
    # pinned between steps and copies queued by others find free slots
    # there. A host-side predictor's guesses name cached experts only once
    # nothing is fetched: it waits for two steps that asked for no copy, or,
    # if it knows the whole step (the oracle), for the last pins to cover
    # the step's reads (`_step_pinned`). A copy landing during the step is
    # not pinned: its expert is read from host memory, and that miss puts
    # the next step back on the layer-by-layer path. The eviction policy's
    # acquire clock ticks once for the call, not once a layer.

    # -- Note [Step pins]
    # A predictor that knows a whole step ahead (the oracle: `step_reads`)
    # made each layer of a sync-free step pay for an engine call and its
    # own guesses: on BM6's gemma-4 trace on the H200, 120 us of host
    # work and 50 us in the engine a layer, against 37 ms a resident step
    # of 30 layers, and the oracle ran 1.21-1.24x the resident model where
    # its copies were all landed in time. Yet at a step's first layer it
    # already knows what every layer of the step reads and what the next
    # step will. So at layer 0 of a sync-free step, where the predictor
    # gives both, one engine call releases the last step's pins, reports
    # its uses, sends the hints, pins every resident expert this step
    # reads (all layers) and queues the next step's reads as prefetches
    # (the engine skips those already resident, in layer order); the
    # other layers make no engine call, as in a steady step, and the last
    # layer releases the pins. The copies then have a whole step to land,
    # not one layer. What the step reads and is not resident at layer 0
    # is read from host memory (a zero-copy read, a miss: the next step
    # goes synced if there are many, Note [Which path a step takes]); an
    # expert it reads that the plan did not name is read from host memory
    # too, and the predictor's precision drops with it (the next step's
    # reads are filed as its guesses): a paused predictor gets no step
    # plan. The experts that the last step read from host memory are not
    # prefetched (the per-layer path prefetches them): the plan names what
    # is read next. Only where this step's and the next step's reads fit
    # the cache together (else the next step's fetches would evict this
    # step's pins' neighbours or be declined), and only without expert
    # parallel (each rank's rows need the per-layer map). A step that can
    # go steady (Note [Steady pins]: nothing to fetch, its reads pinned
    # already) does that instead: its pins and its map are then the last
    # step's.

    def step_plan(self, step: int | None = None, host: bool = False):
        """Note [Step pins]: (the reads of `step`, default this one, and of
        the step after) as sorted flat indices layer * experts + expert,
        or None where the predictor gives no plan for it. `host`: for the
        host-routed path (Note [Host-routed step pins] in
        prefetch/offload/step_plan.py), whose room also keeps a layer's worth of
        slots for experts the pins do not cover."""
        st = self._s
        reads_of = getattr(st.predictor, "step_reads", None)
        owns_all = st.local is None if host else self._owns_all
        if reads_of is None or not owns_all or not st.cache_slots or self._gate.paused:
            return None
        step = st.step if step is None else step
        now = reads_of(step, st.num_layers, st.num_experts, ahead=False)
        if now is None:
            return None
        nxt = reads_of(step + 1, st.num_layers, st.num_experts, ahead=False)
        if nxt is None:
            nxt = _EMPTY
        room = max(nxt.shape[0], st.num_experts) if host else nxt.shape[0]
        if now.shape[0] + room > st.cache_slots:
            return None
        return now, nxt

    def pin_step(self, now: np.ndarray, nxt: np.ndarray, stream) -> None:
        """Note [Step pins]: the step's one engine call; fills every
        layer's row of _pin_out and _pinned."""
        st = self._s
        hint_ids, hint_when, had_hints = self.hints_to_send()
        ids = self._all_ids_flat
        pin = ids[now]
        buf = self._step_buf[: pin.shape[0]]
        fetch = ids[nxt] if nxt.shape[0] else None
        self.pin_call(pin, buf, st.use, fetch, hint_ids, hint_when, had_hints, stream)
        out = self._all_out_flat
        out.fill(-1)
        out[now] = buf
        st.held = mark_pinned(out, self._pinned_u8, buf, pin)
        self._steady = True
        self._acct.step_pins += 1
        self.expect_step(st.step + 1, nxt)

    def expect_step(self, step: int, flat: np.ndarray) -> None:
        """Files the plan's reads of `step` (sorted flat indices) as the
        guesses for its layers, scored when their routings are read."""
        st = self._s
        if not flat.shape[0]:
            return
        e = st.num_experts
        bounds = np.searchsorted(flat, np.arange(st.num_layers + 1, dtype=np.int64) * e).tolist()
        st.pending.file_step(step, flat, bounds, e)  # Note [Guesses filed a step at a time]

    def _steady_step(self) -> bool:
        """Layer 0, routings read: the last step missed nothing and there is
        nothing to fetch or guess (hints ride on the call; a host-side
        predictor only probing because nothing was fetched, Note
        [Speculation with nothing to fetch], is not run: its guesses name
        cached experts)."""
        st = self._s
        return (self._last_misses == 0 and (st.fetch is None or not st.fetch.shape[0])
                and (not st.host_guesses or self._gate.nothing_fetched or self._step_pinned()))

    def _step_pinned(self) -> bool:
        """A host-side predictor that knows the whole step (the oracle's
        `step_reads`): every expert this rank owns that the step reads, and
        the next step's first layers, was pinned by the last pins, so its
        guesses would name cached experts only. Without this a host-side
        predictor went steady only after _IDLE_STEPS_TO_PROBE steps that
        asked for no copy, and each first copy of an expert started that
        count again: the oracle was steady on 20 of BM6's steps at a full
        cache where on-demand was on 39. A pin that went stale
        since (an eviction by a copy that ran after it) is read from host
        memory on the steady step, and that miss puts the next step back
        on the layer-by-layer path."""
        st = self._s
        reads = getattr(st.predictor, "step_reads", None)
        flat = reads(st.step, st.num_layers, st.num_experts) if reads is not None else None
        if flat is None:
            return False
        if not self._owns_all:
            flat = flat[self._owned_u8[flat].view(bool)]
        return bool(self._pinned_u8[flat].all())

    def _nothing_queued(self) -> bool:
        """No copy waits for a slot. (Not `bytes_in_flight == 0`: on CUDA
        that gauge drops only when the copy worker next wakes, so after a
        step's last copy it stayed above 0 and no step was steady on the
        H200 host. A copy still in flight when its expert is pinned costs
        a wait on its event on the stream (Note [Pins without waiting]); in
        a steady step the last such copy was issued two steps ago or
        earlier.)"""
        return not self._s.handle.queued()  # a few us less than stats() (one device per handle here)

    def _pin_all(self, stream) -> None:
        """A steady step's one engine call: release what is held, pin every
        resident expert of every layer (rows of _pin_out and _pinned),
        report the last step's uses."""
        st = self._s
        hint_ids, hint_when, had_hints = self.hints_to_send()
        self.pin_call(self._all_owned_ids, self._all_buf, st.use, None, hint_ids, hint_when, had_hints, stream)
        if not self._owns_all:
            self._all_out[self._owned] = self._all_buf
        st.held = mark_pinned(self._all_out_flat, self._pinned_u8, self._all_buf, self._all_owned_ids)
        self._steady = True
        self.steady_steps += 1
        if st.host_guesses:  # its guesses are not made this step
            self._gate.paused_layers += st.num_layers

    def hints_to_send(self):
        """(tensor ids, next-use times, whether there were hints) of the
        predictor's hints not sent yet; expert parallel: this rank's only.
        `pin_call` clears them once sent (even if none is this rank's)."""
        st = self._s
        hints = st.late_hints
        if not hints:
            return None, None, False
        if st.local is not None:
            _, hints = self._calls.only_local({}, hints)
        hint_ids, hint_when = self._calls.hint_arrays(hints)
        return hint_ids, hint_when, True

    def pin_call(self, pin, pin_into, use, fetch, hint_ids, hint_when, had_hints, stream) -> None:
        """The engine call of `pin_layer`, `_pin_all` and `pin_step`: release what is
        held (another stream's first, in its own call), report `use`,
        prefetch `fetch`, send the hints and pin `pin` into `pin_into`. Bad
        arguments are refused before anything changes: what was held stays
        held, and the uses, prefetches and hints stay to be sent."""
        st = self._s
        if st.held is not None and stream != st.held_stream:
            self._calls.release_held()
        held, st.held = st.held, None
        t0 = time.perf_counter_ns()
        try:
            st.handle.exchange(release=held, pin=pin, pin_into=pin_into, use=use, prefetch=fetch, priority=1,
                               hint_ids=hint_ids, hint_when=hint_when, now=st.clock if had_hints else None,
                               stream=stream)
        except (ValueError, KeyError, TypeError, OverflowError):
            st.held = held
            raise
        finally:
            self._acct.engine_ns += time.perf_counter_ns() - t0
        st.use = st.fetch = None
        if had_hints:
            st.late_hints = []
        st.held_stream = stream

    def _owned_ids(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Tensor ids of those of `experts` this rank owns (all of them
        without expert parallel)."""
        st = self._s
        if self._owns_all:
            return st.ids(layer, experts)
        return st.ids(layer, experts[self._owned[layer][experts]])

    def note_routing(self, layer: int, top_k_index) -> None:
        """Keeps `layer`'s routing (a device tensor: no copy yet); which
        experts were pinned stays in the layer's row of `_pinned` until the
        routing is read. The whole step's routings come back in one copy at
        the next step's first layer (`read_routings`)."""
        st = self._s
        self._routings.append((layer, st.step, top_k_index, top_k_index.numel()))

    def queue_read_back(self) -> None:
        """Note [Routing read-back queued early]
        Called after the last MoE layer of a sync-free step has queued its
        compute: the step's routings go into one page-locked buffer with a
        non_blocking copy queued on the current stream now, and an event
        after it. `read_routings`, at the next step's first layer, then
        waits only for that event, which the GPU passed before the token
        it read back, instead of for everything queued since (the next
        step's embedding, attention and router, that a copy issued then
        sits behind): no host sync that drains the GPU's queue mid-step.
        CPU tensors (the host backend) skip this: their read is a copy."""
        import torch

        routings = self._routings
        if not routings:
            return
        device = routings[0][2].device
        if device.type != "cuda" or any(r[2].device != device for r in routings):
            return
        flat = [r[2].reshape(-1) for r in routings]
        n = sum(f.shape[0] for f in flat)
        buf = self._early_buf
        if buf is None or buf.shape[0] < n or buf.dtype != flat[0].dtype:
            with torch.inference_mode(False):  # a later step outside inference mode writes it too
                buf = self._early_buf = torch.empty(max(n, 1024), dtype=flat[0].dtype, pin_memory=True)
        # The buffer's last copy was read by the read_routings that emptied
        # the list (nothing is queued on it now).
        dst = buf[:n]
        stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            dst.copy_(torch.cat(flat) if len(flat) > 1 else flat[0], non_blocking=True)
        if self._early_event is None:
            self._early_event = torch.cuda.Event()
        self._early_event.record(stream)
        self._early = (len(routings), dst, self._early_event)

    def read_routings(self) -> None:
        """One device-to-host copy of every routing noted since the last
        read (by then the GPU has run them: generate reads each new token
        back; or the copy queued by `queue_read_back`), then per layer:
        trace, scores, predictor; and for the next engine call the uses
        (every routed expert) and the prefetches (those read from host
        memory)."""
        import torch

        st = self._s
        routings, self._routings = self._routings, []
        early, self._early = self._early, None
        t0 = time.perf_counter_ns()
        if early is not None and early[0] == len(routings):
            early[2].synchronize()
            host = early[1].numpy()
            self.early_read_backs += 1
        else:  # routings noted after the queued copy (a partial step): read them all now
            flat = [r[2].reshape(-1) for r in routings]
            host = to_host(torch.cat(flat) if len(flat) > 1 else flat[0])
        self._acct.sync_ns += time.perf_counter_ns() - t0
        # One flat [layers x experts] table (a read holds each layer at most
        # once: pin_layer reads the routings before a layer comes again),
        # in one C pass (prefetch/_routing.pxi). Each layer's pinned row is
        # still the one its routing saw (pin_layer reads the routings before
        # rewriting a row). Expert parallel: this rank's reads only.
        # The same pass counts the misses of pairs read before and adds
        # this read's pairs to _seen.
        use, fetch, hits, misses, again = read_routed(routings, host, st.num_experts, self._routed_u8,
                                                      self._pinned_u8, None if self._owns_all else self._owned_u8,
                                                      self._all_ids_flat, self._seen_u8)
        self._last_misses = misses
        self._acct.pinned_hits += hits
        self._acct.zero_copy_reads += misses
        if hits + misses:
            self._step_missed = misses / (hits + misses)
            self._step_missed_again = again / (hits + misses)
        extra = []
        if st.observes or st.pending:
            routed = self._routed
            for layer, step, _, _ in routings:
                guesses, hints = self._routing.observe(layer, np.flatnonzero(routed[layer]), {}, step=step)
                if st.late_predict and not self._routing.held_back(guesses):
                    extra.extend(self._owned_ids(t, g) for t, g in guesses.items() if g.shape[0])
                if hints:
                    st.late_hints.extend(hints)
        elif st.trace is not None:  # Note [Routings nobody reads]: recorded, and nothing else
            st.trace.add_routed([(step, layer) for layer, step, _, _ in routings], self._routed)
        if extra:
            fetch = np.unique(np.concatenate([fetch, *extra]))
        st.use = use if st.use is None else np.concatenate([st.use, use])
        st.fetch = fetch if st.fetch is None else np.unique(np.concatenate([st.fetch, fetch]))

    # -- Note [Routings nobody reads]
    # read_routings gave each layer of the step read to `observe` (score
    # the guesses filed for it, record it in the trace, tell the
    # predictor) whenever there was a predictor, a trace or a guess to
    # score. The next-layer gate guesses on synced steps only (its guesses
    # ride on their routing sync) and its observe does nothing, so on a
    # sync-free step of the gate with no trace and no guess left to score
    # that pass did nothing, at about 4 us a layer: read_routings took
    # 408-424 us a step with the gate against 200-222 with no predictor on
    # the development VM (a 48-layer tiny OLMoE, half its experts cached,
    # 32 tokens, 31 sync-free steps), the one thing
    # the gate's sync-free decode did that on-demand's did not. A predictor
    # says `observes = False` when its observe does nothing; then with no
    # guess pending the pass runs only to record the trace, which it does
    # without observe's other work. After: 194-207 us with the gate, 200-226
    # with none; with --record-trace (BM6's engine rows record) 294-322 us
    # against 407-449 before. The trace then
    # takes the step's rows in one numpy pass (RoutingTrace.add_routed):
    # 63 us a step at the median against 103 for a per-layer `add`, on
    # the development VM too.
