"""BM6's --ab ROW_A ROW_B: two engine rows of one block against each other
in alternating generates (Note [Two rows side by side])."""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time

from bench.common import fmt
from bench.generate_modes import ENGINE_ROWS, EngineMode, shared_host_experts
from bench.generate_rows import Block, alternate_p50s, clear_exception_frames, decode_p50, oracle_trace

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
# 1.219] (Qwen3), each 96.1 %.


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


def ab_rows(rows) -> tuple[str, str]:
    """--ab's two rows, checked: engine rows (they offload a whole model
    through the library), two different ones."""
    if len(rows) != 2 or rows[0] == rows[1]:
        raise ValueError(f"--ab needs two different rows, got {rows}")
    bad = [r for r in rows if r not in ENGINE_ROWS]
    if bad:
        raise ValueError(f"--ab takes engine rows ({', '.join(ENGINE_ROWS)}), not {bad}")
    return rows[0], rows[1]


def run_ab(block: Block, name: str, share: float, started: float) -> dict:
    """Note [Two rows side by side]: the A/B of --ab's rows at `share` on this
    block; null figures with the reason where it cannot run."""
    args, torch = block.args, block.torch
    a, b = ab_rows(args.ab)
    out = {"model": name, "batch": block.batch, "share": share, "rows": [a, b], "pairs_ms": [],
           "x_ab": None, "x_ab_ci": None, "a_faster": None, "sign_p": None, "tokens_equal": None, "copies": None,
           "parked_resident_experts": None, "reason": None}
    if time.monotonic() - started > args.budget_s:
        out["reason"] = f"not run: --budget-s {args.budget_s:g} s spent"
        return out
    if block.reference is None:
        out["reason"] = "not run: the resident row did not run"
        return out
    if block.twin is None:
        out["reason"] = f"not run: no second copy of the model ({block.twin_reason})"
        return out
    trace = None
    if any(r.removesuffix("-synced") == "oracle" for r in (a, b)):
        trace = oracle_trace(block, share)
        if trace is None:
            out["reason"] = "not run: no recorded routing trace for the oracle (on-demand did not run)"
            return out
    budget = int(share * block.state.total_bytes)
    twin, block.twin = block.twin, None
    block.twin_reason = "used by --ab"
    modes = []
    try:
        block.phase = "--ab setup"
        host = shared_host_experts(block.model, block.cuda)
        if args.park_resident_experts:  # as the engine rows do (Note [Parked resident experts])
            block.state.park(host)
        out["parked_resident_experts"] = block.state.parked is not None
        modes.append(EngineMode(block.model, budget, a, trace, block.cuda, host=host))
        # Each side its own trace object (oracle_trace makes a new one).
        trace_b = None if trace is None else oracle_trace(block, share)
        modes.append(EngineMode(twin, budget, b, trace_b, block.cuda, host=host))
        sides = list(zip((block.model, twin), modes))
        tokens = min(args.paired_tokens, args.new_tokens)
        block.phase = "--ab warm-up"
        for model, mode in sides:
            decode_p50(block, model, tokens)
            mode.new_sequence()
        block.phase = "--ab pairs"
        out["pairs_ms"], equal = alternate_p50s(block, sides, args.ab_pairs, tokens, block.reference[:, :tokens])
        ratios = [x / y for x, y in out["pairs_ms"] if x is not None and y]
        out["x_ab"] = statistics.median(ratios) if ratios else None
        out["x_ab_ci"] = median_ci(ratios)
        out["a_faster"], _, out["sign_p"] = sign_test(out["pairs_ms"])
        out["tokens_equal"] = equal
        out["copies"] = [mode.counters()["copies"] for mode in modes]  # warm-up and pairs
    except Exception as exc:  # noqa: BLE001 - the A/B reports why it failed; the block goes on
        out["reason"] = f"failed in {block.phase}: {type(exc).__name__}: {str(exc)[:300]}"
        clear_exception_frames(exc)  # its frames hold the caches: gone before the restore
    finally:
        block.phase = "restore"
        for mode in modes:
            with contextlib.suppress(Exception):
                mode.close()
        modes = sides = None
        del twin
        block.state.restore()
        gc.collect()
        if block.cuda:
            torch.cuda.empty_cache()
    ci = out["x_ab_ci"]
    ci_text = f"{fmt(ci[0])}-{fmt(ci[1])} at {fmt(100 * ci[2])} %" if ci else "null (too few pairs)"
    print(f"  {name} b{block.batch} {fmt(share):>5} --ab {a} / {b}: x_ab {fmt(out['x_ab'])} ({ci_text}) over "
          f"{len(out['pairs_ms'])} pairs ({a} faster in {out['a_faster']}, sign test p {fmt(out['sign_p'])}), "
          f"tokens equal {out['tokens_equal']}"
          + (f" ({out['reason']})" if out["reason"] else ""), file=sys.stderr, flush=True)
    return out
