"""BM6's --ab ROW_A ROW_B: two engine rows of one block against each other
in alternating generates (Note [Two rows side by side])."""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import sys
import threading
import time

from bench.lib.common import fmt
from bench.lib.generate_model import ModelState, generate
from bench.lib.generate_modes import ENGINE_ROWS, EngineMode, shared_host_experts
from bench.lib.generate_rows import Block, alternate_p50s, clear_exception_frames, decode_p50, oracle_trace

# -- Note [Two rows side by side]
# "The gate never slower than on-demand" asks for a ratio of two offloaded
# rows a few per cent apart, and BM6 measured each against the resident
# twin at another moment: the host's slow spells (Note [Paired generates])
# moved single pairs by 1.2-1.8x, so the two rows' medians of four pairs
# disagreed with their p50s and adjacent ratios at Qwen3-30B-A3B and OLMoE
# at 25 % (runs 161, 165). With --ab A B, after a block's rows, the twin is
# offloaded as row B while the model is offloaded as row A (the twin shares
# the model's packed host experts: the same weights, no second host copy),
# both caches on the device at once, and --ab-pairs pairs of
# --paired-tokens generates run A then B (odd pairs B first), each pair
# within a second or so: its ratio compares the two rows in the same spell
# of the host, and x_ab, the median of the pairs' A/B ratios, drops the
# pairs a spell split. Each generate starts a new sequence (new_sequence,
# as the paired generates do). The twin is used up (the block's last
# work; restore_check drops it anyway), the model restored after. Each
# side's generated ids are checked against the resident model's. Whether
# the pairs say one row is faster at all: `a_faster`, the pairs whose A
# was faster, and `sign_p`, the two-sided sign test's p over the pairs
# that differ (the chance of a split at least that uneven if neither row
# were faster). Runs 168-169 gave x_ab 0.985 and 1.043 over 12 pairs with
# A faster in 7 and 4 of them: p 0.77 and 0.39, neither row shown faster.
# A target such as "A never slower than B" is not shown by a p that says
# only that neither row was shown faster; what the pairs bound is how much
# slower A can be. `x_ab_ci` is the distribution-free confidence interval
# for the median pair ratio (median_ci: two order statistics of the
# ratios, their coverage from the binomial law of how many ratios fall
# below the median, at least 95 %), [low, high, coverage]: its high end is
# the most by which A's median pair can be slower than B's at that
# confidence. Runs 168-169's pairs give [0.944, 1.053] (OLMoE) and [0.863,
# 1.219] (Qwen3), each 96.1 %. --ab-control first runs the same pairs
# with ROW_B on both sides (the model and the twin restored between), so
# the estimators' own bias and spread come from the same lease. Side A is
# always the model and side B the twin, so a difference between the two
# copies (where their weights and buffers sit, what ran on each last) is
# in every pair; the control reads it, and on the H200 it read 1.005
# (OLMoE) and 1.011 (Qwen3) in runs 173-174, as large as Qwen3's gate
# against on-demand. --ab-swap removes it: after the A/B, both copies are
# restored (and parked again) and the same pairs run with ROW_B on the
# model and ROW_A on the twin ("swapped"); "pooled" takes the pairs of
# both as [A, B], so each row runs on each copy in half of them and the
# copies' difference moves half the pairs up and half down, which the
# median of the ratios does not follow.

# -- Note [Where a pair's time went]
# Qwen3-30B-A3B's A/B pairs in runs 169 and 174 ran whole generates at
# one of two speeds, about 57 and about 109 ms a token, on one side of a
# pair or on both (docs/results.md, stop 51), and a pair split that way
# bounds nothing. Each alternating pair also keeps `pairs_detail`: per
# side, as the pair's ms ([A, B]), the generate's wall ms, the host's
# steal ms in it (/proc/stat, None where not counted), the CUDA caching
# allocator's retries in it (Note [Allocator retries]; None on the CPU),
# and for an engine row the change in its counters over the generate:
# host_ms, engine_ms and sync_ms (the controller's host work, its engine
# calls, its waits for the routing read-back), calls (layer calls),
# copies, zero_copy_reads and misses. A slow generate whose sync_ms grew
# waited on the device; one whose host_ms or engine_ms grew, or with
# steal, was slowed on the host; one with neither, between the offloaded
# layers (attention, the lm head, transformers' own host work). The
# counters are read between generates, outside the timed ones.


def _at_most(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k): the chance that at most k of n pairs fall
    one way if either way were as likely."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def sign_test(pairs) -> tuple[int, int, float | None]:
    """(pairs whose A was faster, pairs that differ, the two-sided exact
    sign test's p over those; None without any) for `pairs` of [A, B] ms,
    pairs with a missing side left out."""
    done = [(a, b) for a, b in pairs if a is not None and b is not None]
    a_faster = sum(a < b for a, b in done)
    n = sum(a != b for a, b in done)
    if n == 0:
        return a_faster, 0, None
    return a_faster, n, min(1.0, 2 * _at_most(n, min(a_faster, n - a_faster)))


def median_ci(ratios, level: float = 0.95) -> list | None:
    """[low, high, coverage]: the distribution-free interval for the median
    of what `ratios` sample, the k-th smallest and k-th largest ratio with
    k the largest for which the interval covers the median with
    probability >= `level` (1 - 2 P(Binomial(n, 1/2) < k)); None when even
    the smallest and largest ratio cover less (fewer than 6 ratios at
    95 %)."""
    r = sorted(ratios)
    n = len(r)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * _at_most(n, k - 1)
        if coverage < level:
            break
        best = [r[k - 1], r[n - k], coverage]
    return best


# -- Note [Lockstep pairs]
# Alternating pairs put the two generates of a pair a second or so
# apart, and the H200 host's spells still split pairs: runs 168-169's
# single pair ratios spread 0.59-1.84, so 12 pairs bound a median only
# to 0.944-1.053 and 0.863-1.219. With --ab-lockstep N the two sides
# also run N pairs in lockstep: each side's generate in a thread of its
# own, taking turns one token at a time (A's prefill, B's prefill, A's
# first decode step, B's, ...; odd pairs B first), so each side's step t
# runs within a step's time of the other's, in the same spell. A side's
# step is timed from the moment it gets its turn back to its next
# token's logits (after the --timer-sync wait, which must be the compute
# stream's: a device-wide wait would time each side over the other
# side's copies too, and BM6 refuses it), so neither side's clock runs
# while the other computes; a pair is the two sides' p50 step times, as
# in the alternating pairs, and x_ab, x_ab_ci, a_faster and sign_p are
# taken the same way. Each side's prefill is timed too, from the turn
# that starts its generate to its first logits (prefill_pairs_ms,
# prefill_x_ab and the rest): at batch 1 and a quarter cached the gate
# and on-demand differ only on synced forwards such as the prefill (stop
# 48 in docs/results.md), so that is where a difference between them
# shows. What lockstep changes besides the clock: a side's copies still
# queued or on the link when it hands the turn over go on during the
# other side's step, time they would not have had in a generate of its
# own; `handoffs_with_copies` says for each side how often that could
# happen (the share of its hand-overs with ids queued or bytes counted
# in flight, which the engine counts until its copy worker next looks:
# an upper bound). Near 0 on both sides, lockstep and alternating pairs
# measure the same thing; far from it, lockstep flatters the side with
# copies left over. And each side's step runs right after the other
# side's, on host caches that hold the other model's state: lockstep
# compares the two rows under the same conditions, not at a lone
# generate's speed, so its ms are not BM6's p50s (on the development VM,
# the first version's control: lockstep p50s 4.8-6.0 ms against 3.5-4.2
# alternating with two OpenMP threads, 3.3-4.0 against 3.5-3.8 with
# one). The two threads are a difference of their own. With each side
# kept to one thread, the same row on both sides (--ab on-demand
# on-demand) gave, on the 2-core development VM (--smoke-cpu,
# smoke-olmoe, 12 pairs of 8 tokens), x_ab 1.00 (0.99-1.01) alternating
# and 0.94 (0.90-0.96) in lockstep, side A faster in all 12 lockstep
# pairs, and 1.02-1.03 in three later runs: each thread that calls into
# torch's CPU kernels has an OpenMP team of its own, and the waiting
# side's team spins on the cores the running side needs (with
# OMP_NUM_THREADS=1 1.01 and later 1.02-1.03, with
# OMP_WAIT_POLICY=PASSIVE 0.99 (0.79-1.09): part of the bias, not all of
# it, cause not found). So the threads swap sides every two pairs (side
# 0 first, then side 1, in each thread: a four-pair cycle), which turns
# a thread's bias into spread that the interval covers, and one warm-up
# pair, not counted, gives each thread its first generate (the first
# counted pair had read 0.68 in two of three runs). With both, the same
# VM gave the control 1.02 (0.98-1.02), 1.03 (1.01-1.03) and 0.99
# (0.98-1.01) in lockstep (docs/results.md, stop 49): a lockstep A/B is
# read against its control, not against 1.00. --ab-control runs that
# control (ROW_B against ROW_B) in the same lease before the A/B, in the
# block's ab.control. On the H200 (runs 173-174, OLMoE and Qwen3 at
# batch 1 and a quarter cached) handoffs_with_copies read 0.98-1.00 on
# every side, control included, and lockstep decode pairs spread over
# 0.6-2.0 where alternating ones spread 0.97-1.05 (OLMoE): each side's
# copies run on into the other's step, so there alternating pairs are
# the estimator and lockstep is tight only for the synced prefill.


class _OtherSideFailed(RuntimeError):
    """A side woken because the other side of its lockstep pair failed."""


class _Turns:
    """Two threads taking turns: `wait_for(side)` blocks until it is
    `side`'s turn; `hand_over(side)` gives the turn to the other side; a
    failure on either side (`fail`) wakes both."""

    def __init__(self, first: int, timeout_s: float):
        self._cv = threading.Condition()
        self._turn = first
        self._failed = False
        self._timeout_s = timeout_s

    def start(self, first: int) -> None:
        """A new pair: `first` has the turn."""
        with self._cv:
            self._turn = first
            self._cv.notify_all()

    def wait_for(self, side: int) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._turn == side or self._failed, timeout=self._timeout_s):
                raise TimeoutError(f"lockstep: side {side} waited {self._timeout_s:g} s for its turn")
            if self._failed:
                raise _OtherSideFailed("lockstep: the other side failed")

    def hand_over(self, side: int) -> None:
        with self._cv:
            self._turn = 1 - side
            self._cv.notify_all()

    def fail(self) -> None:
        with self._cv:
            self._failed = True
            self._cv.notify_all()


class _LockstepTimer:
    """A logits processor for one side of a lockstep pair: times the step
    since the side's last turn began, hands the turn over and waits for it
    again (the last side's last token hands over and returns)."""

    def __init__(self, side: int, turns: _Turns, sync, tokens: int, last: bool, copies_pending):
        self.side, self.turns, self.sync, self.tokens, self.last = side, turns, sync, tokens, last
        self.copies_pending = copies_pending
        self.steps_s = []
        self.prefill_s = None  # from the turn that starts the generate to its first logits
        self.calls = 0
        self.handoffs_with_copies = 0
        self._resumed = None

    def start(self) -> None:
        """The side's first turn begins: its generate (the prefill) is next."""
        self._resumed = time.perf_counter()

    def __call__(self, input_ids, scores):
        self.sync()
        now = time.perf_counter()
        if self.calls == 0:
            self.prefill_s = now - self._resumed if self._resumed is not None else None
        else:
            self.steps_s.append(now - self._resumed)
        self.calls += 1
        self.handoffs_with_copies += bool(self.copies_pending())
        self.turns.hand_over(self.side)
        if not (self.last and self.calls == self.tokens):
            self.turns.wait_for(self.side)
        self._resumed = time.perf_counter()
        return scores


def _copies_pending(mode) -> bool:
    s = mode.ctl.handle.stats()
    return bool(s["queue_depth"] or s["bytes_in_flight"])


def _raise_side_errors(errors: list, ran: int, total: int) -> None:
    """Raises what stopped a lockstep run: the error of the side that
    failed first (the other one was only woken by it), or a RuntimeError
    where fewer than `total` pairs ran."""
    woken = (_OtherSideFailed, threading.BrokenBarrierError)
    failed = [e for e in errors if e is not None and not isinstance(e, woken)]
    if failed:  # the side that failed first; the other one was only woken by it
        raise failed[0]
    if any(e is not None for e in errors) or ran != total:
        raise RuntimeError(f"lockstep: {ran} of {total} pairs ran (errors: {errors})")


def lockstep_p50s(block: Block, sides, pairs: int, tokens: int, want=None, timeout_s: float = 300.0,
                  warmup: int = 1) -> dict:
    """`pairs` lockstep pairs (Note [Lockstep pairs]) of generates of
    `tokens` on the two `sides` ((model, EngineMode) each), after
    `warmup` pairs run the same way and not counted. Pair i (warm-up
    pairs included) starts with side i % 2, and the two threads, kept for
    all the pairs, swap sides every two pairs, so that in any four
    consecutive pairs each side goes first and second in each thread once.
    Each side's mode starts a new sequence after each pair. Returns
    {"pairs_ms": [A p50, B p50] (decode steps, ms) per counted pair,
    "prefill_pairs_ms": [A, B] prefill ms per counted pair (from the turn
    that starts the generate to its first logits), "tokens_equal": whether
    every generate's ids equal `want` (True when None),
    "handoffs_with_copies": each side's share of counted hand-overs with
    copies pending}."""
    total = pairs + warmup
    turns = _Turns(0, timeout_s)
    gate = threading.Barrier(3, timeout=timeout_s)  # the two threads and this one, around each pair
    done = [[None, None] for _ in range(total)]  # per pair and side: (timer, ids)
    errors = [None, None]

    def side_of(thread: int, i: int) -> int:
        return thread ^ ((i // 2) % 2)

    def run(thread):
        try:
            if getattr(block, "cuda", False):  # a new thread's current device is device 0
                block.torch.cuda.set_device(block.device)
            for i in range(total):
                j = side_of(thread, i)
                gate.wait()  # the pair's turns are set
                timer = _LockstepTimer(j, turns, block.timer_sync, tokens, j != i % 2,
                                       lambda mode=sides[j][1]: _copies_pending(mode))
                turns.wait_for(j)
                timer.start()
                ids = generate(block.torch, sides[j][0], block.prompt, tokens, block.sync, timer)[0]
                done[i][j] = (timer, ids)
                gate.wait()  # the pair is over
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors[thread] = exc
            turns.fail()
            gate.abort()

    threads = [threading.Thread(target=run, args=(t,), name=f"lockstep-{t}", daemon=True) for t in range(2)]
    for t in threads:
        t.start()
    out, prefills, equal, pending, ran = [], [], True, [0, 0], 0
    try:
        for i in range(total):
            turns.start(i % 2)
            gate.wait()
            gate.wait()
            p50s, prefill = [], []
            for j, (timer, ids) in enumerate(done[i]):
                if timer.calls != tokens or len(timer.steps_s) != tokens - 1:
                    raise RuntimeError(f"lockstep: side {j} made {timer.calls} of {tokens} tokens")
                p50s.append(statistics.median(timer.steps_s) * 1e3 if timer.steps_s else None)
                prefill.append(timer.prefill_s * 1e3)
                if i >= warmup:
                    pending[j] += timer.handoffs_with_copies
                sides[j][1].new_sequence()
                if want is not None:
                    equal = equal and bool(block.torch.equal(ids, want))
            ran += 1
            if i >= warmup:
                out.append(p50s)
                prefills.append(prefill)
    except threading.BrokenBarrierError:
        pass  # a side failed: its error is raised below
    finally:
        if ran != total:  # a side failed, or this thread did: free the other waiters
            turns.fail()
            gate.abort()
        for t in threads:
            t.join(timeout_s)
    _raise_side_errors(errors, ran, total)
    return {"pairs_ms": out, "prefill_pairs_ms": prefills, "tokens_equal": equal,
            "handoffs_with_copies": [p / (pairs * tokens) if pairs else None for p in pending]}


def _pair_figures(pairs) -> dict:
    """x_ab, x_ab_ci, a_faster and sign_p of [A, B] ms pairs."""
    ratios = [x / y for x, y in pairs if x is not None and y]
    a_faster, _, p = sign_test(pairs)
    return {"x_ab": statistics.median(ratios) if ratios else None, "x_ab_ci": median_ci(ratios),
            "a_faster": a_faster, "sign_p": p}


def ab_rows(rows) -> tuple[str, str]:
    """--ab's two rows, checked: two engine rows (they offload a whole
    model through the library). The same row twice is the control: what
    the estimator gives two sides that do the same work (the model against
    its twin, going first against going second)."""
    if len(rows) != 2:
        raise ValueError(f"--ab needs two rows, got {rows}")
    bad = [r for r in rows if r not in ENGINE_ROWS]
    if bad:
        raise ValueError(f"--ab takes engine rows ({', '.join(ENGINE_ROWS)}), not {bad}")
    return rows[0], rows[1]


def _ci_text(ci) -> str:
    return f"{fmt(ci[0])}-{fmt(ci[1])} at {fmt(100 * ci[2])} %" if ci else "null (too few pairs)"


def _figures_line(name: str, block: Block, share: float, rows, res: dict, how: str) -> str:
    line = (f"  {name} b{block.batch} {fmt(share):>5} --ab {rows[0]} / {rows[1]}{how}: x_ab {fmt(res['x_ab'])} "
            f"({_ci_text(res['x_ab_ci'])}) over {len(res['pairs_ms'])} pairs ({rows[0]} faster in "
            f"{res['a_faster']}, sign test p {fmt(res['sign_p'])}), ")
    if "prefill_x_ab" in res:
        line += (f"prefill x_ab {fmt(res['prefill_x_ab'])} ({_ci_text(res['prefill_x_ab_ci'])}, {rows[0]} faster "
                 f"in {res['prefill_a_faster']}), ")
    if "handoffs_with_copies" in res:
        h = res["handoffs_with_copies"]
        line += f"hand-overs with copies {fmt(h[0])} / {fmt(h[1])}, "
    return line + f"tokens equal {res['tokens_equal']}"


def _side_by_side(block: Block, twin, rows, budget: int, trace, host, out: dict, what: str) -> None:
    """The model offloaded as rows[0] and `twin` as rows[1] (both caches at
    once), warmed, then --ab-pairs alternating pairs and --ab-lockstep
    lockstep pairs, their figures into `out`; both offloads closed after,
    whatever happens (an exception goes on to the caller)."""
    args = block.args
    modes = []
    try:
        block.phase = f"{what} setup"
        modes.append(EngineMode(block.model, budget, rows[0], trace(), block.cuda, host=host))
        modes.append(EngineMode(twin, budget, rows[1], trace(), block.cuda, host=host))  # its own trace object
        sides = list(zip((block.model, twin), modes))
        tokens = min(args.paired_tokens, args.new_tokens)
        block.phase = f"{what} warm-up"
        for model, mode in sides:
            decode_p50(block, model, tokens)
            mode.new_sequence()
        block.phase = f"{what} pairs"
        want = block.reference[:, :tokens]
        out["pairs_detail"] = []
        out["pairs_ms"], equal = alternate_p50s(block, sides, args.ab_pairs, tokens, want, out["pairs_detail"])
        out.update(_pair_figures(out["pairs_ms"]))
        out["tokens_equal"] = equal
        if args.ab_lockstep:
            block.phase = f"{what} lockstep pairs"
            lock = lockstep_p50s(block, sides, args.ab_lockstep, tokens, want)
            prefill = _pair_figures(lock["prefill_pairs_ms"])
            out["lockstep"] = {**lock, **_pair_figures(lock["pairs_ms"]),
                               **{f"prefill_{k}": v for k, v in prefill.items()}}
        counts = [mode.counters() for mode in modes]  # warm-up and every pair
        out["copies"] = [c["copies"] for c in counts]
        out["hit_rates"] = [c["hits"] / (c["hits"] + c["misses"]) if c["hits"] is not None and c["hits"] + c["misses"]
                            else None for c in counts]
    finally:
        for mode in modes:
            with contextlib.suppress(Exception):
                mode.close()
        modes = sides = None
        gc.collect()
        if block.cuda:
            block.torch.cuda.empty_cache()


def _empty_figures() -> dict:
    return {"pairs_ms": [], "pairs_detail": None, "x_ab": None, "x_ab_ci": None, "a_faster": None, "sign_p": None,
            "tokens_equal": None, "copies": None, "hit_rates": None, "lockstep": None}


def _pooled(ab: dict, swapped: dict) -> dict:
    """--ab-swap's pooled figures: the A/B's pairs and the swapped run's
    (run as [B, A], taken as [A, B]) together, alternating and, where both
    ran them, lockstep."""
    def both(x: list, y: list) -> list:  # pairs as run, then swapped ones turned round
        return [list(p) for p in x] + [[b, a] for a, b in y]

    out = {"pairs_ms": both(ab["pairs_ms"], swapped["pairs_ms"]), "pairs_detail": None}
    if ab.get("pairs_detail") is not None and swapped.get("pairs_detail") is not None:
        out["pairs_detail"] = both(ab["pairs_detail"], swapped["pairs_detail"])
    out.update(_pair_figures(out["pairs_ms"]))
    out["tokens_equal"] = ab["tokens_equal"] is True and swapped["tokens_equal"] is True
    out["lockstep"] = None
    if ab.get("lockstep") and swapped.get("lockstep"):
        lock = {"pairs_ms": both(ab["lockstep"]["pairs_ms"], swapped["lockstep"]["pairs_ms"])}
        lock.update(_pair_figures(lock["pairs_ms"]))
        lock["tokens_equal"] = ab["lockstep"]["tokens_equal"] is True and swapped["lockstep"]["tokens_equal"] is True
        out["lockstep"] = lock
    return out


def lean_twin(block: Block):
    """Note [A lean twin]
    The twin of --ab is a resident copy of the model (Note [Paired
    generates]) where --paired made one; Qwen3-30B-A3B's is 57 GiB, which
    with the model's own experts leaves no room on an 80 GiB H100 and
    crowds a 140 GiB H200. The A/B offloads both sides from the one packed
    host copy and never computes on the twin's resident experts, so without
    a resident twin (--paired 0, or no room for one) and with
    --park-resident-experts, the A/B makes its own: a deep copy of the model
    while its experts are parked, which copies the other weights and the
    experts' meta stand-ins (Note [Parked resident experts]), a few GiB.
    Each side-by-side (control, A/B, swap) gets a new one after the model
    is restored and parked again; the block's ab.twin says which kind ran
    ("lean" or "resident"). Each side's tokens are still checked against the
    resident model's."""
    if block.state.parked is None:
        raise RuntimeError("a lean twin is a copy of the parked model: park it first")
    twin = copy.deepcopy(block.model)
    held = sum(t.numel() * t.element_size() for t in (*twin.parameters(), *twin.buffers()) if not t.is_meta)
    print(f"  lean twin: {held / 2**30:.2f} GiB of weights and buffers", file=sys.stderr, flush=True)
    return twin


def run_ab(block: Block, name: str, share: float, started: float) -> dict:
    """Note [Two rows side by side]: the A/B of --ab's rows at `share` on this
    block, after --ab-control's B/B; null figures with the reason where it
    cannot run."""
    args = block.args
    a, b = ab_rows(args.ab)
    out = {"model": name, "batch": block.batch, "share": share, "rows": [a, b], **_empty_figures(),
           "control": None, "swapped": None, "pooled": None, "parked_resident_experts": None, "twin": None,
           "reason": None}
    if time.monotonic() - started > args.budget_s:
        out["reason"] = f"not run: --budget-s {args.budget_s:g} s spent"
        return out
    if block.reference is None:
        out["reason"] = "not run: the resident row did not run"
        return out
    lean = block.twin is None and args.park_resident_experts  # Note [A lean twin]
    if block.twin is None and not lean:
        out["reason"] = f"not run: no second copy of the model ({block.twin_reason})"
        return out
    oracle = any(r.removesuffix("-synced") == "oracle" for r in (a, b))
    if oracle and oracle_trace(block, share) is None:
        out["reason"] = "not run: no recorded routing trace for the oracle (on-demand did not run)"
        return out

    def trace():  # a new trace object for each side (the oracle's), or None
        return oracle_trace(block, share) if oracle else None

    budget = block.state.cache_bytes(share)
    twin, block.twin = block.twin, None
    block.twin_reason = "used by --ab"
    try:
        block.phase = "--ab setup"
        host = shared_host_experts(block.model, block.cuda)
        if args.park_resident_experts:  # as the engine rows do (Note [Parked resident experts])
            block.state.park(host)
        out["parked_resident_experts"] = block.state.parked is not None
        out["twin"] = "lean" if lean else "resident"
        if lean:
            twin = lean_twin(block)
        twin_state = ModelState(twin) if not lean and (args.ab_control or args.ab_swap) else None

        def restore(what: str) -> None:  # both copies back as they were, to be offloaded again
            nonlocal twin
            block.phase = f"{what} restore"
            if lean:
                twin = None  # its offload closed: a new one from the model parked again
            block.state.restore()
            if twin_state is not None:
                twin_state.restore()
            if args.park_resident_experts:
                block.state.park(host)
            if lean:
                twin = lean_twin(block)

        if args.ab_control:
            out["control"] = {"rows": [b, b], **_empty_figures()}
            _side_by_side(block, twin, (b, b), budget, trace, host, out["control"], "--ab-control")
            restore("--ab-control")
        _side_by_side(block, twin, (a, b), budget, trace, host, out, "--ab")
        if args.ab_swap:
            restore("--ab")
            out["swapped"] = {"rows": [b, a], **_empty_figures()}
            _side_by_side(block, twin, (b, a), budget, trace, host, out["swapped"], "--ab-swap")
            out["pooled"] = _pooled(out, out["swapped"])
    except Exception as exc:  # noqa: BLE001 - the A/B reports why it failed; the block goes on
        out["reason"] = f"failed in {block.phase}: {type(exc).__name__}: {str(exc)[:300]}"
        clear_exception_frames(exc)  # its frames hold the caches: gone before the restore
    finally:
        block.phase = "restore"
        del twin
        block.state.restore()
        gc.collect()
        if block.cuda:
            block.torch.cuda.empty_cache()
    _print_figures(name, block, share, out)
    return out


def _print_figures(name: str, block: Block, share: float, out: dict) -> None:
    """run_ab's figures to stderr: the control, the A/B, the swapped copies
    and the pooled pairs (those that ran), each lockstep too, with the
    reason the A/B stopped, if it did."""
    reason = f" ({out['reason']})" if out["reason"] else ""
    for res, how in ((out["control"], " (control)"), (out, ""), (out["swapped"], " (swapped copies)"),
                     (out["pooled"], " (pooled with the swapped copies)")):
        if res is None:
            continue
        rows = res.get("rows", out["rows"])
        print(_figures_line(name, block, share, rows, res, how) + reason, file=sys.stderr, flush=True)
        if res["lockstep"] is not None:
            print(_figures_line(name, block, share, rows, res["lockstep"], how + " in lockstep") + reason,
                  file=sys.stderr, flush=True)
