"""BM6's rows on one block (one model and batch; bench/generate.py): set a
row up, run its warm-up, measured, repeated and time-to-first-token
generates, turn what they measured into figures, compare them with the
resident row, and check the model was restored after the block."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import time
import traceback

import prefetch
from bench.lib.common import best_of_ratio, fmt, host_steal_s, percentile
from bench.lib.generate_figures import decode_counters, delta
from bench.lib.generate_model import (
    RoutingRecorder,
    RowSkipped,
    StepTimer,
    generate,
    gpu_memory_report,
    make_sync,
)
from bench.lib.generate_modes import (
    ENGINE_ROWS,
    FIGURES,
    MPL_ROWS,
    AccelerateMode,
    ByHandMode,
    EngineMode,
    PolicyLangMode,
    ResidentMode,
    cpu_sync_noop,
    shared_host_experts,
)
from bench.lib.generate_profile import profile_generate, profile_path
from bench.lib.generate_twin import drop_twin


class Block:
    """One model and batch: prompts, the resident reference and the routing."""

    def __init__(self, torch, model, state, batch, args, cuda, device, sync, model_name=None):
        self.torch, self.model, self.state, self.batch = torch, model, state, batch
        self.model_name = model_name  # BM6's name of the model (--profile's file names)
        self.args, self.cuda, self.device, self.sync = args, cuda, device, sync
        self.timer_sync = make_sync(torch, cuda, args.timer_sync)  # the per-token clock's wait
        vocab = model.config.vocab_size

        def prompt(seed, length):
            g = torch.Generator().manual_seed(seed)
            return torch.randint(1, vocab, (batch, length), generator=g).to(device)

        self.prompt = prompt(100 + batch, args.prompt_tokens)
        self.warm_prompt = prompt(200 + batch, args.prompt_tokens)
        self.ttft_prompt = prompt(300 + batch, args.ttft_tokens)
        self.warm_ttft_prompt = prompt(400 + batch, args.ttft_tokens)
        self.reference = None  # resident's generated ids
        self.resident_p50 = None
        self.resident_ttft = None
        self.routing = None  # resident routing of the measured prompt: per step, per layer
        self.ttft_routed = None  # distinct (layer, expert) the TTFT prompt routes
        self.ttft_steps = None  # its routing (one step: the prefill), for the oracle's TTFT
        self.traces = {}  # share -> on-demand's recorded steps
        self.twin = None  # Note [Paired generates]: a second resident copy of the model, or None
        self.twin_ids = None  # its generated ids for the measured prompt
        self.twin_reason = "not measured: --paired 0"
        self.phase = None  # what the current row is doing (named in a failed row's reason)
        self.failed_in = None  # the phase a failed row's first error came from


def make_mode(block: Block, row: str, budget, trace, out: dict):
    """The mode that sets `row` up on the block's model; puts the device
    bytes it holds experts in into out["device_expert_bytes"] (offloaded
    rows)."""
    torch, model, state = block.torch, block.model, block.state
    if row == "resident":
        return ResidentMode(model, None)
    if row == "resident-eager":
        return ResidentMode(model, "eager")
    if row in ENGINE_ROWS:
        out["parked_resident_experts"] = bool(block.args.park_resident_experts)
        if block.args.park_resident_experts:  # Note [Parked resident experts] in bench/lib/generate_model.py
            state.park(shared_host_experts(model, block.cuda))
        mode = EngineMode(model, budget, row, trace, block.cuda)
        out["device_expert_bytes"] = budget
    elif row == "torch-by-hand":
        mode = ByHandMode(torch, model, state, budget, block.device, block.cuda)
        out["device_expert_bytes"] = mode.device_bytes
    elif row == "accelerate-cpu-offload":
        mode = AccelerateMode(model, state, block.device)
        out["device_expert_bytes"] = mode.layer_bytes
    elif row in MPL_ROWS:
        mode = PolicyLangMode(torch, model, state, budget, row, block.device, block.cuda,
                              block.args.mpl_capacity)
        out["device_expert_bytes"] = mode.pool_bytes
    else:
        raise ValueError(row)
    return mode


@dataclasses.dataclass
class Measured:
    """What a row's generates measured (run_row turns it into figures)."""

    timer: StepTimer  # the measured generate's clock at each logits call
    t0: float  # its start
    ids: object  # its generated ids
    before: dict  # the mode's counters before it, at its first logits call, at its end
    at_first: dict
    after: dict
    accesses: object  # distinct routed (layer, expert) of the decode steps, or None
    extra: dict  # the mode's own figures
    runs: list  # decode p50s (ms) of the --repeats generates after it
    ttft_s: float
    steal: list  # host steal (ms or None) during the measured generate and each repeat
    pairs: list  # Note [Paired generates]: [row p50, twin p50] (ms) per pair
    profile: dict | None = None  # --profile: bench/lib/generate_profile.profile_generate's figures


def repeat_p50s(block: Block, mode, new_tokens: int, steal: list) -> list:
    """--repeats: the measured generate again (counters and trace are the
    first one's); x_adjacent compares medians of the repeats. Appends each
    generate's host steal (ms, or None) to `steal`."""
    runs = []
    for _ in range(max(0, block.args.repeats - 1)):
        _, p50 = decode_p50(block, block.model, new_tokens, steal)
        mode.new_sequence()
        if p50 is not None:
            runs.append(p50)
    return runs


def alloc_retries(block: Block):
    """Note [Allocator retries]
    How many times so far torch's CUDA caching allocator found no room on
    the device for an allocation, freed its cached blocks and retried (None
    on the CPU). Each retry frees with cudaFree, which waits for the device.
    Qwen3-30B-A3B with its twin (Note [Paired generates]) holds two 54 GiB
    copies of the experts and a row's cache on a 140 GiB H200: run 159's
    on-demand row ran out of memory there, and in run 158 the rows beside
    the twin ran at two speeds (the oracle's pairs 1.75, 1.71, 1.11, 1.11)
    without a cause found. A row's alloc_retries (its measured and repeated
    generates, and its paired ones) says whether its times include a full
    device's retries. Run 161 (the resident experts parked) counted none
    in any row and still had single pairs at 1.5-1.8x: the host's slow
    spells, not the allocator."""
    if not block.cuda:
        return None
    return int(block.torch.cuda.memory_stats(block.device).get("num_alloc_retries", 0))


def steal_ms(start):
    """ms of host steal since `start` (a host_steal_s reading), or None."""
    end = host_steal_s()
    return None if start is None or end is None else (end - start) * 1e3


def decode_p50(block: Block, model, new_tokens: int, steal: list | None = None):
    """One generate of the measured prompt on `model`: (its generated ids,
    its decode p50 in ms, None without a decode step). Appends the
    generate's host steal (ms, or None) to `steal` if given."""
    timer = StepTimer(block.timer_sync)
    s0 = host_steal_s()
    ids = generate(block.torch, model, block.prompt, new_tokens, block.sync, timer)[0]
    if steal is not None:
        steal.append(steal_ms(s0))
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return ids, (statistics.median(decode) * 1e3 if decode else None)


# Counters of an engine row whose change over one generate says where its
# time went (Note [Where a pair's time went]).
_DETAIL_COUNTERS = ("host_s", "engine_s", "sync_s", "calls", "copies", "zero_copy_reads", "misses")


def _generate_detail(block: Block, mode, before: dict, steal, retries0, wall_ms: float) -> dict:
    """One generate's figures for `pairs_detail`: its wall ms, host steal
    ms and allocator retries (None where not known), and the change of
    each of _DETAIL_COUNTERS its mode counts (seconds as ms)."""
    retries = alloc_retries(block)
    out = {"wall_ms": wall_ms, "steal_ms": steal,
           "alloc_retries": None if retries0 is None or retries is None else retries - retries0}
    after = mode.counters() if mode is not None else {}
    for key in _DETAIL_COUNTERS:
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            continue
        name = key.removesuffix("_s") + "_ms" if key.endswith("_s") else key
        out[name] = (b - a) * 1e3 if key.endswith("_s") else b - a
    return out


def alternate_p50s(block: Block, sides, pairs: int, tokens: int, want=None,
                   detail: list | None = None) -> tuple[list, bool]:
    """Pairs of generates of `tokens` on the two `sides` ((model, its mode
    or None) each), the first side first in even pairs and second in odd
    ones; a side's mode starts a new sequence after each of its generates.
    Returns ([first p50, second p50] (ms) per pair, whether every generate's
    ids equal `want` (True when `want` is None)). `detail`: a list to append
    [first side's, second side's] _generate_detail to, per pair (Note
    [Where a pair's time went])."""
    out, equal = [], True
    for i in range(pairs):
        got, about = [None, None], [None, None]
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            model, mode = sides[j]
            if detail is not None:
                before = mode.counters() if mode is not None else {}
                retries0, s0, t0 = alloc_retries(block), host_steal_s(), time.perf_counter()
            ids, got[j] = decode_p50(block, model, tokens)
            if detail is not None:
                about[j] = _generate_detail(block, mode, before, steal_ms(s0), retries0,
                                            (time.perf_counter() - t0) * 1e3)
            if mode is not None:
                mode.new_sequence()
            if want is not None:
                equal = equal and bool(block.torch.equal(ids, want))
        out.append(got)
        if detail is not None:
            detail.append(about)
    return out, equal


def paired_p50s(block: Block, mode, new_tokens: int) -> list:
    """Note [Paired generates]: [row p50, twin p50] (ms) per pair, each
    generate of --paired-tokens, or of the row's own `new_tokens` where
    that is fewer (accelerate's few)."""
    if block.twin is None:
        return []
    tokens = min(block.args.paired_tokens, new_tokens)
    return alternate_p50s(block, [(block.model, mode), (block.twin, None)], block.args.paired, tokens)[0]


def measure_row(block: Block, row: str, share, mode, recorder, new_tokens: int, warm_tokens: int,
                out: dict) -> Measured:
    """The warm-up, measured, repeated, paired, profiled (--profile) and
    TTFT generates of `row` with its mode set up (the engine rows' routing
    trace goes to out["trace_steps"])."""
    torch, model, sync = block.torch, block.model, block.sync
    block.phase = "warm-up"
    generate(torch, model, block.warm_prompt, warm_tokens, sync)
    mode.new_sequence()
    marks = {}

    def first():
        marks["counters"] = mode.counters()
        marks["calls"] = recorder.mark() if recorder else None

    timer = StepTimer(block.timer_sync, on_first=first, on_step=mode.on_step)
    mode.start_measuring()
    before = mode.counters()
    retries0 = alloc_retries(block)
    s0 = host_steal_s()
    block.phase = "measured generate"
    ids, t0, _ = generate(torch, model, block.prompt, new_tokens, sync, timer)
    # The timer outlives the row (Measured) and its callbacks hold the mode:
    # kept, they kept the row's offload and its cache alive through the
    # restore, which then had no room for a parked model's experts beside
    # the twin (run 111: "ran out of GPU memory in its restore").
    timer.on_first = timer.on_step = None
    steal = [steal_ms(s0)]
    after = mode.counters()
    accesses = recorder.distinct_accesses(marks["calls"]) if recorder else None
    extra = mode.extra()
    if isinstance(mode, EngineMode):
        out["trace_steps"] = mode.trace_steps(new_tokens)
    mode.new_sequence()
    block.phase = "repeats"
    runs = repeat_p50s(block, mode, new_tokens, steal)
    retries1 = alloc_retries(block)
    block.phase = "paired generates"
    pairs = paired_p50s(block, mode, new_tokens)
    retries2 = alloc_retries(block)
    if retries0 is not None:
        out["alloc_retries"] = {"measured": retries1 - retries0, "paired": retries2 - retries1}
    profiled = None
    if block.args.profile:
        block.phase = "profiled generate"
        path = profile_path(block.args.profile, block.model_name, block.batch, share, row)
        profiled = profile_generate(block, mode, path, min(block.args.profile_tokens, new_tokens))
    block.phase = "time to first token"
    if row == "resident":
        # The floor of every row's TTFT: not the process's first
        # prefill of this shape.
        generate(torch, model, block.ttft_prompt, 1, sync)
    mode.before_ttft(block.ttft_steps)
    _, s0, s1 = generate(torch, model, block.ttft_prompt, 1, sync)
    return Measured(timer, t0, ids, before, marks["counters"], after, accesses, extra, runs, s1 - s0, steal,
                    pairs, profiled)


def row_figures(m: Measured, out: dict) -> dict:
    """`out` with the figures of what `m` measured."""
    times = m.timer.times
    decode = [b - a for a, b in zip(times, times[1:])]
    p50 = statistics.median(decode) * 1e3 if decode else None
    out["p50_runs_ms"] = ([p50] if p50 is not None else []) + m.runs
    out["steal_runs_ms"] = m.steal
    out["paired_runs_ms"] = m.pairs
    if m.profile is not None:
        out["profile"] = m.profile
    out["x_paired"] = statistics.median(r / t for r, t in m.pairs) if m.pairs else None
    out.update({
        "p50_ms": statistics.median(out["p50_runs_ms"]) if out["p50_runs_ms"] else None,
        "p90_ms": percentile(decode, 0.9) * 1e3 if decode else None,
        "decode_tokens": len(decode),
        "prefill_ms": (times[0] - m.t0) * 1e3,
        "ttft_ms": m.ttft_s * 1e3,
        "generated": m.ids,
    })
    out.update(decode_counters(m.at_first, m.after, m.accesses))
    out["prefill_bytes"] = delta(m.before, m.at_first, "bytes")
    out.update({k: v for k, v in m.extra.items() if k not in out})
    return out


def clear_exception_frames(exc: BaseException) -> None:
    """Clears the finished frames of `exc`'s traceback and of the
    exceptions it was raised from or during (__cause__, __context__): their
    locals (a row's offload, its cache) go now, not when the exception
    does. The frames still running are left as they are."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def run_row(block: Block, row: str, share, trace=None) -> dict:
    """Sets up `row`, runs the warm-up, measured and TTFT generates, tears
    down and restores the model. Returns the figures."""
    torch, args = block.torch, block.args
    budget = None if share is None else block.state.cache_bytes(share)
    new_tokens = args.accelerate_tokens if row == "accelerate-cpu-offload" else args.new_tokens
    warm_tokens = 1 if row == "accelerate-cpu-offload" else args.warmup_tokens
    out = {"budget_bytes": budget, "new_tokens": new_tokens}
    mode = None
    recorder = None
    block.phase, block.failed_in = "setup", None
    try:
        with cpu_sync_noop(torch, row in MPL_ROWS and not block.cuda):
            mode = make_mode(block, row, budget, trace, out)
            if mode.accesses_from_routing:
                recorder = RoutingRecorder(block.model)
            measured = measure_row(block, row, share, mode, recorder, new_tokens, warm_tokens, out)
    except BaseException as exc:
        # The failed calls' frames hold the row's offload and its cache
        # while the exception is in flight: cleared, the restore below has
        # that memory back (a parked model's experts are copied back into it).
        clear_exception_frames(exc)
        block.failed_in = block.phase
        raise
    finally:
        block.phase = "restore"
        if recorder is not None:
            recorder.close()
        if mode is not None:
            with contextlib.suppress(Exception):
                mode.close()
        mode = None
        block.state.restore()
        block.phase = block.failed_in  # restored: a failure is the phase's it came from
        gc.collect()
        if block.cuda:
            torch.cuda.empty_cache()
    return row_figures(measured, out)


def failed_where(block: Block) -> str:
    """" in its <phase>" for a row that failed (" in its restore, after an
    error in its <phase>" when the restore failed as well), or ""."""
    if block.phase is None:
        return ""
    if block.failed_in is not None and block.failed_in != block.phase:
        return f" in its {block.phase}, after an error in its {block.failed_in}"
    return f" in its {block.phase}"


def out_of_memory(block: Block, exc: BaseException) -> bool:
    """Whether `exc` is running out of device memory: torch's allocator or
    the engine's cache."""
    return isinstance(exc, (block.torch.OutOfMemoryError, prefetch.OutOfMemoryError))


def report_out_of_memory(block: Block, row: str) -> None:
    """Logs what holds the GPU's memory after `row` ran out of it."""
    if block.cuda:
        print(f"  {row} ran out of GPU memory{failed_where(block)}:\n    "
              f"{gpu_memory_report(block.torch, block.device)}", file=sys.stderr, flush=True)


def record_routing(block: Block):
    """The resident model's routing of the measured prompt (per decode step)
    and the distinct (layer, expert) the TTFT prompt routes: untimed runs
    with router hooks."""
    torch, model, sync = block.torch, block.model, block.sync
    rec = RoutingRecorder(model)
    try:
        generate(torch, model, block.prompt, block.args.new_tokens, sync)
        block.routing = rec.steps()
        rec.calls = []
        generate(torch, model, block.ttft_prompt, 1, sync)
        block.ttft_steps = rec.steps()[:1]
        block.ttft_routed = sum(len(layer) for layer in block.ttft_steps[0])
    finally:
        rec.close()


def null_row(base: dict, reason: str) -> dict:
    row = dict(base)
    for key in FIGURES:
        row.setdefault(key, None)
    row["reason"] = reason
    return row


def compare_to_resident(block: Block, row: str, share, trace, res: dict):
    """Takes the generated ids and routing trace out of `res` and adds what
    they say against the resident row (which, when `row` is it, becomes
    the block's reference)."""
    generated = res.pop("generated")
    steps = res.pop("trace_steps", None)
    if row == "resident":
        block.reference = generated
        block.resident_p50, block.resident_ttft = res["p50_ms"], res["ttft_ms"]
        record_routing(block)
    if row == "on-demand" and steps is not None:
        block.traces[share] = steps
    if row in ("oracle", "oracle-synced") and steps is not None:
        res["oracle_replayed_exactly"] = steps == trace.steps
    ref = block.reference[:, :generated.shape[1]]
    res["tokens_equal"] = bool(block.torch.equal(generated, ref))
    if row != "resident" and block.reference is not None:
        repeats = block.args.repeats
        steal = []
        adjacent = [v for v in (resident_p50_now(block, steal) for _ in range(repeats)) if v is not None]
        res["resident_adjacent_runs_ms"] = adjacent
        res["resident_adjacent_steal_ms"] = steal
        res["resident_adjacent_p50_ms"] = statistics.median(adjacent) if adjacent else None
        if res["resident_adjacent_p50_ms"] and res.get("p50_runs_ms"):
            res["x_adjacent"] = statistics.median(res["p50_runs_ms"]) / res["resident_adjacent_p50_ms"]
            res["x_adjacent_best"] = best_of_ratio(res["p50_runs_ms"], adjacent)
    if block.routing is not None and row in ENGINE_ROWS and steps is not None:
        res["routing_equals_resident"] = steps == block.routing[:len(steps)]


def run_planned_row(block: Block, name: str, row: str, share, started: float) -> dict:
    """One row of a block's plan: its figures, or null ones with the reason
    it did not run."""
    args, batch = block.args, block.batch
    block.phase = block.failed_in = None  # not an earlier row's
    base = {"model": name, "batch": batch, "share": share, "row": row}
    if time.monotonic() - started > args.budget_s:
        return null_row(base, f"not run: --budget-s {args.budget_s:g} s spent")
    if row != "resident" and block.reference is None:
        return null_row(base, "not run: the resident row did not run")
    trace = None
    if row in ("oracle", "oracle-synced"):
        trace = oracle_trace(block, share)
        if trace is None:
            return null_row(base, "not run: no recorded routing trace (on-demand did not run)")
    try:
        retry = False
        try:
            res = run_row(block, row, share, trace)
        except Exception as exc:  # noqa: BLE001 - only running out of memory beside the twin is retried
            if block.twin is None or not out_of_memory(block, exc):
                raise
            report_out_of_memory(block, row)
            # Note [Paired generates]: the twin's room was an estimate; a
            # row it crowds out runs again without it, unpaired.
            where = "" if share is None else f" at {share:.0%}"
            drop_twin(block, f"dropped: {row}{where} ran out of GPU memory beside it")
            retry = True
        if retry:
            # Outside the handler: the first try's exception, and what its
            # frames hold (run 109: its 54 GiB cache), is gone by now.
            gc.collect()
            if block.state.parked is not None:
                block.state.restore()  # the restore after the failed row ran out of memory too: finished now
            res = run_row(block, row, share, trace)
    except RowSkipped as exc:
        return null_row(base, str(exc))
    except Exception as exc:  # noqa: BLE001 - a row that fails reports why; the others still run
        if out_of_memory(block, exc):  # each such error reported once: here, or before the retry
            report_out_of_memory(block, row)
        failed = null_row(base, f"failed: {type(exc).__name__}{failed_where(block)}: {str(exc)[:300]}")
        print(f"  {name} b{batch} {row} failed: {exc!r}", file=sys.stderr, flush=True)
        return failed
    compare_to_resident(block, row, share, trace, res)
    r = {**base, **res}
    print(f"  {name} b{batch} {fmt(share) if share is not None else '-':>5} {row:<26} p50 "
          f"{fmt(r['p50_ms']):>9} ms  ttft {fmt(r['ttft_ms']):>9} ms  hit {fmt(r.get('hit_rate'))}  "
          f"equal {r['tokens_equal']}", file=sys.stderr, flush=True)
    retries = r.get("alloc_retries")
    if retries and any(retries.values()):
        print(f"    allocator retries (the device was full; they are in these times): {retries}",
              file=sys.stderr, flush=True)
    return r


def oracle_trace(block: Block, share):
    from prefetch.integration import RoutingTrace

    steps = block.traces.get(share)
    if steps is None and block.traces:
        steps = next(iter(block.traces.values()))
    if steps is None:
        return None
    return RoutingTrace(block.state.num_layers, block.state.num_experts, [list(map(list, s)) for s in steps])


def resident_p50_now(block: Block, steal: list):
    """The resident model's decode p50 (ms) measured now, on the restored
    model; None if the model is not in its resident state. Appends the
    generate's host steal (ms, or None) to `steal`."""
    try:
        block.state.check()
    except RuntimeError:
        return None
    return decode_p50(block, block.model, block.args.new_tokens, steal)[1]


def restore_check(block: Block, name) -> dict:
    """The resident generate once more after the block's rows: the model must
    generate the same ids (the rows restored it)."""
    out = {"model": name, "batch": block.batch, "resident_p50_ms": block.resident_p50,
           "resident_ttft_ms": block.resident_ttft, "routing": block.routing, "traces": block.traces,
           "ttft_routed_experts": block.ttft_routed, "twin_reason": block.twin_reason,
           "twin_tokens_equal": (None if block.twin_ids is None or block.reference is None
                                 else bool(block.torch.equal(block.twin_ids, block.reference)))}
    block.twin = None  # Note [Paired generates]: its memory goes with the block
    if block.reference is None:
        out["restore_check"] = None
        return out
    try:
        block.state.check()
    except RuntimeError as exc:
        out["restore_check"] = False
        out["restore_reason"] = str(exc)
        return out
    ids, out["resident_again_p50_ms"] = decode_p50(block, block.model, block.args.new_tokens)
    out["restore_check"] = bool(block.torch.equal(ids, block.reference))
    return out
