"""Hypothesis rule-based state machine: the engine against a plain Python
model of it. Workers run only inside `drain` and `acquire` steps (the handle
is otherwise paused), so every step is deterministic and the model can
predict every counter, the queue, the eviction order (LRU, cyclic or
next-use with hints) and the bytes of every acquired tensor.

CI: derandomized, 200 examples of 50 steps, for each machine: host and
caller-runs paths, each with LRU and with cyclic eviction; host with
next-use."""
import numpy as np
import pytest
from conftest import wait_drained
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from payload import check, content

import prefetch

SIZE = 512  # every tensor fills exactly one slot
CAPACITY = 6  # slots in the budget
IDS = 10  # ids 0..9 may be registered
MAX_PINNED = CAPACITY - 2  # so an acquire of 2 misses always finds room
STALE_AFTER = 8  # acquire calls; kCyclicStaleAfterAcquires in src_cpp/device_cache.h
NONE = prefetch.NO_NEXT_USE

COUNTERS = (
    "requests", "enqueued", "deduplicated", "upgraded", "touched", "cancelled",
    "acquires", "hits", "misses", "late", "on_demand", "evictions", "wasted", "copies", "copy_errors",
    "declined",
)


class Residents:
    """The resident ids in eviction order, as the engine's policy keeps them.
    lru: one list, next victim first. cyclic (Note [Cyclic eviction]):
    `fresh` (not acquired since it arrived, oldest first, stamped with the
    acquire clock) and `used` (acquired, oldest first); victims are stale
    fresh ids, then used newest first, then the other fresh ids. next-use
    (Note [Next-use eviction]): `lru` holds the ids, `seq` their touch
    order (made resident, used, requested), `arrival` their order of
    arrival at their time (a touch, or a hint to another time); victims
    are unhinted ids (least recently touched first), expired hints
    (earliest first, first arrived first), then valid hints (farthest
    first, last arrived first)."""

    def __init__(self, policy):
        self.policy = policy
        self.lru = []
        self.fresh = []
        self.used = []
        self.stamp = {}
        self.clock = 0  # acquire calls
        self.seq = {}  # next-use: id -> touch sequence
        self.touches = 0
        self.arrival = {}  # next-use: id -> arrival sequence at its time
        self.arrivals = 0
        self.hint = {}  # next-use hints, resident or not: id -> time (NONE = none)
        self.now = None  # the hint clock (None: never set)

    def __contains__(self, tid):
        return tid in self.lru or tid in self.fresh or tid in self.used

    def __len__(self):
        return len(self.lru) + len(self.fresh) + len(self.used)

    def order(self):
        if self.policy == "lru":
            return list(self.lru)
        if self.policy == "next-use":
            def key(t):
                return (self.hint.get(t, NONE), self.arrival[t])
            unhinted = sorted((t for t in self.lru if self.hint.get(t, NONE) == NONE), key=lambda t: self.seq[t])
            hinted = [t for t in self.lru if self.hint.get(t, NONE) != NONE]
            expired = sorted((t for t in hinted if self.now is not None and self.hint[t] < self.now), key=key)
            valid = sorted((t for t in hinted if t not in expired), key=key, reverse=True)
            return unhinted + expired + valid
        stale = [t for t in self.fresh if self.clock - self.stamp[t] > STALE_AFTER]
        return stale + self.used[::-1] + [t for t in self.fresh if t not in stale]

    def remove(self, tid):
        for ids in (self.lru, self.fresh, self.used):
            if tid in ids:
                ids.remove(tid)

    def insert(self, tid):  # a copy made it resident
        if self.policy in ("lru", "next-use"):
            self.lru.append(tid)
            self.touches += 1
            self.seq[tid] = self.touches
            self.arrivals += 1
            self.arrival[tid] = self.arrivals
        else:
            self.fresh.append(tid)
            self.stamp[tid] = self.clock

    def request(self, tid):  # a prefetch asked for it while resident
        self.remove(tid)
        self.insert(tid)

    def use(self, tid):  # acquired
        self.remove(tid)
        if self.policy == "cyclic":
            self.used.append(tid)
        else:
            self.insert(tid)


class Model:
    def __init__(self, policy="lru"):
        self.version = {}  # registered id -> version
        self.queue = []  # [(band, id)], kept sorted by (band, FIFO)
        self.residents = Residents(policy)  # resident ids and their eviction order
        self.unused = set()  # resident ids copied by a prefetch, not yet acquired
        self.pins = {}  # id -> pins
        self.want = {}  # id -> the acquire call a prefetch wants it by (0: none)
        self.c = dict.fromkeys(COUNTERS, 0)
        self.closed = False

    def queued_band(self, tid):
        for band, qid in self.queue:
            if qid == tid:
                return band
        return None

    def push(self, tid, band):
        # FIFO within a band: after the last entry of that band.
        pos = len(self.queue)
        for i, (b, _) in enumerate(self.queue):
            if b > band:
                pos = i
                break
        self.queue.insert(pos, (band, tid))

    def remove(self, tid):
        self.queue = [(b, q) for b, q in self.queue if q != tid]

    def prefetch(self, ids, band):
        for tid in ids:
            self.c["requests"] += 1
            current = self.queued_band(tid)
            if tid in self.residents:
                self.residents.request(tid)
                self.want[tid] = self.residents.clock + band
                self.c["touched"] += 1
                self.c["deduplicated"] += 1
            elif current is not None:
                if band < current:
                    self.remove(tid)
                    self.push(tid, band)
                    self.want[tid] = self.residents.clock + band
                    self.c["upgraded"] += 1
                self.c["deduplicated"] += 1
            else:
                self.push(tid, band)
                self.want[tid] = self.residents.clock + band
                self.c["enqueued"] += 1

    def needed_sooner(self, victim, tid):
        """Note [Speculation never hurts]: `victim` is wanted no later than
        the speculative `tid`, by the acquire clock or by its hint."""
        r = self.residents
        want_v, want_t = self.want.get(victim, 0), self.want.get(tid, 0)
        if want_v != 0 and want_v >= r.clock and want_v <= want_t:
            return True
        hint_v, hint_t = r.hint.get(victim, NONE), r.hint.get(tid, NONE)
        valid = r.now is None or hint_v >= r.now
        return hint_t != NONE and hint_v != NONE and valid and hint_v <= hint_t

    def evict_one(self, tid, band):
        """Evicts the first evictable victim for `tid`; False when the only
        candidates were refused by admission control."""
        speculative = band != 0 and self.pins.get(tid, 0) == 0
        refused = False
        for victim in self.residents.order():
            if self.pins.get(victim, 0) != 0:
                continue
            if speculative and self.needed_sooner(victim, tid):
                refused = True
                continue
            self.residents.remove(victim)
            self.c["evictions"] += 1
            if victim in self.unused:
                self.unused.discard(victim)
                self.c["wasted"] += 1
            return True
        if refused:
            return False
        raise AssertionError("model: no victim (the test keeps pins below capacity)")

    def drain(self):
        while self.queue:
            band, tid = self.queue.pop(0)
            if len(self.residents) >= CAPACITY and not self.evict_one(tid, band):
                self.want[tid] = 0
                self.c["declined"] += 1
                continue
            self.residents.insert(tid)
            self.c["copies"] += 1
            if self.pins.get(tid, 0) == 0:
                self.unused.add(tid)
            else:
                self.unused.discard(tid)

    def acquire(self, ids):
        self.residents.clock += 1
        for tid in ids:
            self.pins[tid] = self.pins.get(tid, 0) + 1
            self.c["acquires"] += 1
            if tid in self.residents:
                self.c["hits"] += 1
                continue
            self.c["misses"] += 1
            current = self.queued_band(tid)
            if current is None:
                self.push(tid, 0)
                self.c["on_demand"] += 1
            elif current != 0:
                self.remove(tid)
                self.push(tid, 0)
                self.c["upgraded"] += 1
        self.drain()
        for tid in ids:
            self.unused.discard(tid)
            self.want[tid] = 0
            self.residents.use(tid)

    def pinned(self):
        return sorted(t for t, n in self.pins.items() if n > 0)


class EngineMachine(RuleBasedStateMachine):
    handle_options: dict = {"backend": "host"}

    def __init__(self):
        super().__init__()
        self.h = prefetch.PrefetchHandle(
            device_budget_bytes=CAPACITY * SIZE, start_paused=True, poison_freed_slots=True, **self.handle_options
        )
        self.m = Model(self.handle_options.get("eviction_policy", "lru"))
        self.held = []  # acquired ids (with repeats), in acquire order
        self.steps = 0  # steps taken (the invariant runs after each)

    def teardown(self):
        self.h.close()

    def _run_workers(self, fn):
        self.h.resume()
        try:
            result = fn()
            wait_drained(self.h)
        finally:
            self.h.pause()
        return result

    # ---------------------------------------------------------------- rules

    @rule(tid=st.integers(0, IDS - 1))
    def register(self, tid):
        if self.m.closed:
            with pytest.raises(RuntimeError, match="closed"):
                self.h.register(tid, b"x")
            return
        if tid in self.m.version:
            with pytest.raises(ValueError, match="already registered"):
                self.h.register(tid, content(tid, 0, SIZE))
            return
        version = self.m.version.get(("next", tid), 0)
        self.h.register(tid, content(tid, version, SIZE))
        self.m.version[tid] = version

    @rule(tid=st.integers(0, IDS - 1))
    def reregister(self, tid):
        """Unregister and register a new version (stale bytes would show)."""
        if self.m.closed or tid not in self.m.version or self.m.pins.get(tid, 0) > 0:
            return
        self.h.unregister(tid)
        self.m.remove(tid)
        if tid in self.m.residents:
            self.m.residents.remove(tid)
        self.m.unused.discard(tid)
        self.m.residents.hint.pop(tid, None)  # a new registration has no hint
        self.m.want.pop(tid, None)  # nor a wanted-by time
        version = self.m.version.pop(tid) + 1
        self.h.register(tid, content(tid, version, SIZE))
        self.m.version[tid] = version

    @rule(data=st.data(), band=st.integers(0, 19), bad=st.sampled_from([None, 99, -1, 2**40, 1.5, True]))
    def prefetch(self, data, band, bad):
        if self.m.closed:
            with pytest.raises(RuntimeError, match="closed"):
                self.h.prefetch_tensors([0], priority=band)
            return
        known = sorted(self.m.version)
        ids = data.draw(st.lists(st.sampled_from(known), max_size=8)) if known else []
        if bad is not None:
            ids = [*ids, bad]
            with pytest.raises((KeyError, TypeError)):
                self.h.prefetch_tensors(ids, priority=band)
            return
        self.h.prefetch_tensors(ids, priority=band)
        self.m.prefetch(ids, band)

    @rule()
    def drain(self):
        if self.m.closed:
            return
        self._run_workers(lambda: None)
        self.m.drain()

    @rule(data=st.data())
    def acquire(self, data):
        if self.m.closed:
            with pytest.raises(RuntimeError, match="closed"):
                self.h.acquire([0])
            return
        known = sorted(self.m.version)
        room = MAX_PINNED - len(self.m.pinned())
        if not known or room <= 0:
            return
        ids = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=min(2, room), unique=True))
        self.drain()
        views = self._run_workers(lambda: self.h.acquire(ids, timeout=10))
        self.m.acquire(ids)
        for tid, view in zip(ids, views):
            check(view, tid, self.m.version[tid])
        self.held.extend(ids)

    @rule(data=st.data())
    def reuse(self, data):
        """Acquires and releases one resident id six times: six layers'
        worth of acquire calls that hit, which age every other entry on the
        cyclic policy's clock (so prefetched entries can go stale)."""
        if self.m.closed:
            return
        resident = self.m.residents.order()
        if not resident or MAX_PINNED - len(self.m.pinned()) <= 0:
            return
        tid = data.draw(st.sampled_from(resident))
        self.drain()
        for _ in range(6):
            (view,) = self._run_workers(lambda: self.h.acquire([tid], timeout=10))
            self.m.acquire([tid])
            check(view, tid, self.m.version[tid])
            self.h.release([tid])
            self.m.pins[tid] -= 1

    @rule(data=st.data())
    def release(self, data):
        if self.m.closed or not self.held:
            return
        tid = data.draw(st.sampled_from(self.held))
        self.h.release([tid])
        self.held.remove(tid)
        self.m.pins[tid] -= 1

    @rule(tid=st.integers(0, IDS - 1))
    def release_without_acquire(self, tid):
        if self.m.closed or tid not in self.m.version or self.m.pins.get(tid, 0) > 0:
            return
        with pytest.raises(RuntimeError, match="not acquired"):
            self.h.release([tid])

    @rule(data=st.data())
    def cancel(self, data):
        if self.m.closed or not self.m.version:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.m.version)), max_size=4, unique=True))
        removed = self.h.cancel(ids)
        expected = [t for t in ids if self.m.queued_band(t) is not None and self.m.pins.get(t, 0) == 0]
        for t in expected:
            self.m.remove(t)
        self.m.c["cancelled"] += len(expected)
        assert removed == len(expected)

    @rule(band=st.integers(0, 19))
    def cancel_below(self, band):
        if self.m.closed:
            return
        removed = self.h.cancel_below(band)
        expected = [t for b, t in self.m.queue if b >= band and self.m.pins.get(t, 0) == 0]
        for t in expected:
            self.m.remove(t)
        self.m.c["cancelled"] += len(expected)
        assert removed == len(expected)

    @rule(data=st.data())
    def evict(self, data):
        if self.m.closed or not self.m.version:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.m.version)), max_size=3, unique=True))
        expected = [t for t in ids if t in self.m.residents and self.m.pins.get(t, 0) == 0]
        assert self.h.evict(ids) == len(expected)
        for t in expected:
            self.m.residents.remove(t)
            self.m.c["evictions"] += 1
            if t in self.m.unused:  # prefetched, never acquired: wasted either way
                self.m.unused.discard(t)
                self.m.c["wasted"] += 1

    @rule(data=st.data(), advance=st.one_of(st.none(), st.integers(-2, 6)),
          bad=st.sampled_from([None, None, None, "unknown", "negative"]))
    def hint(self, data, advance, bad):
        """next-use hints for registered ids (resident or not) at times near
        the clock, some cleared; sometimes the clock moves (a negative move
        must be refused) or the call carries a bad id or time."""
        if self.m.closed or not self.m.version:
            return
        r = self.m.residents
        ids = data.draw(st.lists(st.sampled_from(sorted(self.m.version)), max_size=4, unique=True))
        base = r.now if r.now is not None else 0
        when = [data.draw(st.one_of(st.just(NONE), st.integers(max(0, base - 3), base + 12))) for _ in ids]
        now = None if advance is None else base + advance
        before = self.h.resident()
        if (now is not None and now < 0) or bad is not None:
            now = None  # one fault per call: the clock check comes first
        if bad == "unknown":
            with pytest.raises(KeyError):
                self.h.hint_next_use([*ids, 99], [*when, 1], now=now)
        elif bad == "negative":
            with pytest.raises(ValueError, match="negative"):
                self.h.hint_next_use([*ids, 0], [*when, -1], now=now)
        elif now is not None and r.now is not None and now < r.now:
            with pytest.raises(ValueError, match="never goes back"):
                self.h.hint_next_use(ids, when, now=now)
        else:
            self.h.hint_next_use(ids, when, now=now)
            for tid, t in zip(ids, when):
                if tid in r and r.hint.get(tid, NONE) != t:  # arrives at another time: its newest
                    r.arrivals += 1
                    r.arrival[tid] = r.arrivals
                r.hint[tid] = t
            if now is not None:
                r.now = now
            return
        assert self.h.resident() == before  # refused calls change nothing

    @rule()
    def pressure(self):
        """Prefetch everything registered: more than the budget holds."""
        if self.m.closed or not self.m.version:
            return
        ids = sorted(self.m.version)
        self.h.prefetch_tensors(ids, priority=7)
        self.m.prefetch(ids, 7)
        self.drain()

    # Close late, so most of each run exercises an open handle.
    @precondition(lambda self: not self.m.closed and self.steps >= 40)
    @rule()
    def close(self):
        self.h.close()
        self.m.closed = True
        self.held.clear()

    # ----------------------------------------------------------- invariants

    @invariant()
    def matches_model(self):
        self.steps += 1
        if self.m.closed:
            with pytest.raises(RuntimeError, match="closed"):
                self.h.stats()
            return
        s = self.h.stats()
        got = {k: s[k] for k in COUNTERS}
        assert got == self.m.c
        assert s["resident_bytes"] <= CAPACITY * SIZE
        assert s["resident_bytes"] == len(self.m.residents) * SIZE
        assert s["acquires"] == s["hits"] + s["misses"]
        assert s["requests"] == s["enqueued"] + s["deduplicated"]
        assert s["pinned_count"] == len(self.m.pinned())
        assert s["registered"] == len(self.m.version)
        assert self.h.resident() == self.m.residents.order()
        assert self.h.queued() == self.m.queue
        assert set(self.m.pinned()) <= set(self.m.residents.order())  # acquired ids are resident
        # The default speculative cap stays within two to four chunks (Note [A
        # cap that follows the worker's wake-ups]; default chunk 4 MiB).
        assert 2 * (4 << 20) <= s["speculative_cap_bytes"] <= 4 * (4 << 20)
        if "faults" in self.handle_options and s["on_demand"] > 0:
            assert 0 < s["caller_copies"] <= s["on_demand"]  # the async path really ran


class CallerRunsMachine(EngineMachine):
    """The same model against the async code path: the fault backend claims
    to be asynchronous, so acquirers issue their own on-demand copies."""

    handle_options = {"backend": "fault", "faults": {"report_async": 1}}


class CyclicMachine(EngineMachine):
    handle_options = {"backend": "host", "eviction_policy": "cyclic"}


class CyclicCallerRunsMachine(EngineMachine):
    handle_options = {"backend": "fault", "faults": {"report_async": 1}, "eviction_policy": "cyclic"}


class NextUseMachine(EngineMachine):
    handle_options = {"backend": "host", "eviction_policy": "next-use"}


SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("PREFETCH_STATEFUL_EXAMPLES", "200")),
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for machine in (EngineMachine, CallerRunsMachine, CyclicMachine, CyclicCallerRunsMachine, NextUseMachine):
    machine.TestCase.settings = SETTINGS
TestEngineStateMachine = EngineMachine.TestCase
TestCallerRunsStateMachine = CallerRunsMachine.TestCase
TestCyclicStateMachine = CyclicMachine.TestCase
TestCyclicCallerRunsStateMachine = CyclicCallerRunsMachine.TestCase
TestNextUseStateMachine = NextUseMachine.TestCase


def test_model_payload_never_zero():
    assert np.asarray(content(0, 0, SIZE)).any()
