"""BM6's figures from what was measured (bench/generate.py): a row's counter
figures over its decode steps, and within a block the ratios to the resident
reference and the TTFT and decode floors."""
from __future__ import annotations

from bench.lib.common import ENGINE_COUNTS


def delta(a, b, key):
    if a.get(key) is None or b.get(key) is None:
        return None
    return b[key] - a[key]


# The engine's counts a row reports over its decode steps: BM5's
# ENGINE_COUNTS, acquires that found their copy under way (late) and
# evictions.
DECODE_ENGINE_COUNTS = (*ENGINE_COUNTS, "late", "evictions")


def decode_counters(at_first: dict, end: dict, accesses) -> dict:
    """Counter figures over the decode steps (first logits call to the end)."""
    hits, misses = delta(at_first, end, "hits"), delta(at_first, end, "misses")
    hit_rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
    out = {"bytes_moved": delta(at_first, end, "bytes"), "copies": delta(at_first, end, "copies"),
           "hit_rate": hit_rate}
    copies_at_use = delta(at_first, end, "copies_at_use")
    if accesses and copies_at_use is not None:
        out["hit_rate"] = 1.0 - copies_at_use / accesses
        out["copies"] = copies_at_use
        out["routed_accesses"] = accesses
    # Where the engine rows' copies and guesses went over the same steps
    # (as BM5's ENGINE_COUNTS): a row whose counters lack one (the resident
    # model, by hand, moe-policylang, accelerate) gets no key for it.
    for key in DECODE_ENGINE_COUNTS:
        value = delta(at_first, end, key)
        if value is not None:
            out[key] = value
    calls = delta(at_first, end, "calls")
    for key in ("host", "engine", "sync"):  # engine and sync: the engine rows only
        seconds = delta(at_first, end, f"{key}_s")
        if calls and seconds is not None:
            out[f"{key}_us_per_layer"] = seconds / calls * 1e6
    return out


def settle(block_rows, block: dict, info: dict):
    """Ratios within the block and the floors (after the model's second raw
    bandwidth reading)."""
    from prefetch.integration import RoutingTrace, belady_misses

    # The reference: the faster of the resident row and its rerun after the
    # block (a transient slowdown of the host is not the model's speed).
    runs = [v for v in (block["resident_p50_ms"], block.get("resident_again_p50_ms")) if v is not None]
    res_p50 = min(runs) if runs else None
    block["resident_ref_p50_ms"] = res_p50
    res_ttft = block["resident_ttft_ms"]
    raw = info.get("raw_h2d_gbps")
    eb = info["expert_bytes"]
    routing = block.get("routing")
    traces = block.get("traces") or {}
    ttft_floor = None
    if res_ttft is not None:
        io = block["ttft_routed_experts"] * eb / (raw * 1e9) * 1e3 if raw and block["ttft_routed_experts"] else None
        ttft_floor = max(res_ttft, io) if io is not None else None  # the floor needs both: null, not resident
        block["ttft_io_floor_ms"] = io
    block["ttft_floor_ms"] = ttft_floor
    for r in block_rows:
        p50 = r.get("p50_ms")
        r["x_resident"] = p50 / res_p50 if p50 is not None and res_p50 else None
        r["ttft_floor_ms"] = ttft_floor
        r["ttft_over_floor"] = r["ttft_ms"] / ttft_floor if r.get("ttft_ms") is not None and ttft_floor else None
        if r["share"] is None or routing is None:
            continue
        budget = int(r["share"] * info["total_expert_bytes"])
        capacity = budget // eb
        # The routing on-demand recorded at this share (what the oracle
        # replays); the resident's where there is none.
        steps = traces.get(r["share"])
        r["io_floor_trace"] = "on-demand" if steps is not None else "resident"
        steps = steps if steps is not None else routing
        decode_tokens = len(steps) - 1
        io_floor = None
        if raw and capacity >= 1 and decode_tokens > 0:
            loads = belady_misses(RoutingTrace(info["layers"], info["experts"], steps), capacity, start_step=1)
            r["belady_loads"] = loads
            io_floor = loads * eb / (raw * 1e9) / decode_tokens * 1e3
        r["io_floor_ms"] = io_floor
        # max(resident, IO floor): null where either is (without the link's
        # bandwidth the floor is not known, and the resident alone would
        # make over_floor a second x_resident).
        floor = max(res_p50, io_floor) if res_p50 is not None and io_floor is not None else None
        r["floor_ms"] = floor
        r["over_floor"] = p50 / floor if p50 is not None and floor else None
    block.pop("routing", None)
    block.pop("traces", None)
