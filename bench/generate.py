"""BM6: transformers `generate` end to end, every row of a block in one process.

    python bench/generate.py [--models olmoe-1b-7b qwen3-30b-a3b] [--batches 1 8]
        [--shares 0.1 0.25 0.5] [--rows ROW ...] [--new-tokens 64] [--warmup-tokens 8]
        [--prompt-tokens 32] [--ttft-tokens 512] [--accelerate-tokens 4] [--vocab 32000]
        [--mpl-capacity memory|slots] [--budget-s 540] [--repeats 1] [--json PATH] [--plot PATH.png]
    python bench/generate.py --smoke-cpu [--json PATH]

Models: transformers OlmoeConfig / Qwen3MoeConfig at the real shapes of
OLMoE-1B-7B-0924 (16 layers, 64 experts, top-8, hidden 2048, expert
intermediate 1024, 16 heads) and Qwen3-30B-A3B (48 layers, 128 experts, top-8,
hidden 2048, moe_intermediate_size 768, 32 heads, 4 kv heads, head_dim 128),
random bf16 weights initialised on the GPU (nothing is downloaded), the vocab
cut to --vocab (the output says so). A block is one model and one batch size;
the model is built once per model and every row of every block runs in this
one process. Prompts are fixed random ids; decoding is greedy with
min_new_tokens = max_new_tokens (no eos), so every row generates the same
count. Each block first runs the resident model over the measured and TTFT
lengths on other prompts (Note [Warm every sequence length] in
bench/generate_model.py); each row then runs a warm-up generate on a
different prompt, the measured generate, then the time-to-first-token
generate.

Rows (share = device cache budget / all expert bytes; share-free rows have none):
  resident          every expert on the GPU, transformers' default experts
                    implementation (grouped_mm in 5.17): the reference
  resident-eager    every expert on the GPU, experts_implementation "eager"
  on-demand         prefetch.offload_moe_experts, predictor=None (records the
                    routing trace the oracle replays)
  gate              ... predictor=NextLayerGatePredictor()
  oracle            ... predictor=OraclePredictor(trace of on-demand's measured
                    generate), eviction_policy "next-use"
                    (all three with the default sync_free=None: on-demand and
                    oracle decode without a routing sync, Note [Sync-free
                    decode]; the gate's guesses need that sync, so it stays
                    on the synced path)
  on-demand-synced / oracle-synced
                    the same with sync_free=False: every layer reads its
                    routing on the host first
  torch-by-hand     plain PyTorch a user would write: an LRU over (layer,
                    expert) of budget // expert-bytes device slots (one
                    preallocated [slots, ...] tensor per weight), experts in
                    pinned host memory, copy_(non_blocking=True) per miss on a
                    side stream with events; hooked in as a transformers
                    experts implementation, computing with grouped_mm on the
                    slot tensors (expert ids remapped to slots); a layer routed
                    to more experts than slots runs in pieces
  accelerate-cpu-offload
                    accelerate.cpu_offload of each layer's experts module (what
                    device_map offload does: the whole layer's experts copied in
                    at every call); only --accelerate-tokens tokens
  moe-policylang-lru / moe-policylang-lookahead
                    the pip package moe-policylang (transformers experts
                    backend; plain copies), cache {eviction = lru}, the second
                    with prefetch {strategy = lookahead} and async transfers
                    (CUDA only: without them its prefetch moves nothing).
                    Its cache is keyed by expert id across all layers and each
                    layer keeps its own device copies of the ids it holds, so
                    its capacity C holds up to layers x C experts: --mpl-capacity
                    memory (default) sets C = budget slots // layers (the same
                    device bytes as our budget), slots sets C = min(budget
                    slots, experts). Null with the reason where the package is
                    not importable.

Figures per row:
  p50_ms, p90_ms    decode ms/token: time between consecutive logits calls of
                    the measured generate, each read after --timer-sync's
                    wait (device, the default: torch.cuda.synchronize, every
                    stream, the engine's background copies too; stream: the
                    compute stream only), the prefill step excluded;
                    with --repeats the median of the generates' p50s
                    (p50_runs_ms; p90 and the counters are the first's)
  tokens_equal      generated ids equal to the resident row's (accelerate:
                    its first --accelerate-tokens)
  hit_rate, bytes_moved, copies
                    over the decode steps only (counters read at the first
                    logits call and at the end). Engine: its hits / (hits +
                    misses); torch-by-hand: routed (layer, expert) found in a
                    slot; moe-policylang: routed (layer, expert) needing no
                    copy at use (its prefetched experts count as copies);
                    accelerate: no cache, hit rate null
  precision, recall engine rows: the controller's prediction scores
  host_us_per_layer over the measured generate's decode steps (first token on):
                    engine rows: the controller's host time per offloaded
                    layer (report()'s host_us_per_layer, also
                    engine_us_per_layer and sync_us_per_layer, taken over
                    those steps); torch-by-hand: Python time in its LRU
                    (acquire and release) per layer call, the routing sync
                    and compute launches excluded; null elsewhere
  ttft_ms           a separate generate with max_new_tokens=1 on a
                    --ttft-tokens prompt per batch row, synchronised;
                    ttft_floor_ms = max(resident's TTFT (the resident
                    prefill, timed after one untimed run of that shape),
                    distinct (layer, expert) the prompt routes x expert
                    bytes / raw H2D)
  x_resident        p50_ms / resident p50_ms (the faster of the resident row
                    and its rerun after the block, as the block's
                    resident_ref_p50_ms)
  x_adjacent        median of the row's --repeats measured p50s
                    (p50_runs_ms) over the median of as many resident
                    generates run right after it (resident_adjacent_runs_ms):
                    the host's speed drifts over a block; these are seconds
                    apart
  io_floor_ms       Belady's fewest loads (prefetch.integration.belady_misses
                    over the recorded routing, decode steps, capacity = budget
                    slots) x expert bytes / raw H2D GB/s / decode tokens;
                    floor_ms = max(resident ref p50, io_floor_ms); over_floor =
                    p50_ms / floor_ms
  raw H2D           bench.common.raw_copy_gbps, pinned copies of expert-sized
                    rows, measured when a model is built and after its rows;
                    the faster of the two
A row that cannot run reports null figures with a reason; rows not started
before --budget-s are null with that reason. During offloaded rows the
model's own GPU expert weights stay allocated (kept to restore the model for
the next row; nothing reads them): device memory is not what is measured.
After each block the resident row runs again to check the model was restored.

--smoke-cpu: tiny Qwen3-MoE, OLMoE and Mixtral configs (4 layers, 8 experts,
top-2, hidden 64) in float32 on the CPU, a few tokens, every row that can run
there (engine rows with the host backend, torch-by-hand without pinning,
accelerate and moe-policylang if importable; moe-policylang calls
torch.cuda.synchronize on the compute device, which is made a no-op for the
CPU device during its rows). It checks the logic; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import fmt, machine_info, percentile, raw_h2d_gbps, write_json  # noqa: E402
from bench.generate_figures import decode_counters, delta, settle  # noqa: E402
from bench.generate_model import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    ModelState,
    RoutingRecorder,
    RowSkipped,
    StepTimer,
    build_model,
    generate,
    make_sync,
    warm_lengths,
)
from bench.generate_modes import (  # noqa: E402
    _HOST_EXPERTS,
    ENGINE_ROWS,
    FIGURES,
    MPL_ROWS,
    ROWS,
    SHARE_FREE_ROWS,
    SHARE_ROWS,
    AccelerateMode,
    ByHandMode,
    EngineMode,
    PolicyLangMode,
    ResidentMode,
    cpu_sync_noop,
)
from bench.generate_report import explain_nulls, format_table, plot  # noqa: E402


class Block:
    """One model and batch: prompts, the resident reference and the routing."""

    def __init__(self, torch, model, state, batch, args, cuda, device, sync):
        self.torch, self.model, self.state, self.batch = torch, model, state, batch
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
        self.traces = {}  # share -> on-demand's recorded steps


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


def repeat_p50s(block: Block, mode, new_tokens: int) -> list:
    """--repeats: the measured generate again (counters and trace are the
    first one's); x_adjacent compares medians of the repeats."""
    runs = []
    for _ in range(max(0, block.args.repeats - 1)):
        again = StepTimer(block.timer_sync)
        generate(block.torch, block.model, block.prompt, new_tokens, block.sync, again)
        mode.new_sequence()
        steps = [b - a for a, b in zip(again.times, again.times[1:])]
        if steps:
            runs.append(statistics.median(steps) * 1e3)
    return runs


def measure_row(block: Block, row: str, mode, recorder, new_tokens: int, warm_tokens: int, out: dict) -> Measured:
    """The warm-up, measured, repeated and TTFT generates of `row` with its
    mode set up (the engine rows' routing trace goes to out["trace_steps"])."""
    torch, model, sync = block.torch, block.model, block.sync
    generate(torch, model, block.warm_prompt, warm_tokens, sync)
    mode.new_sequence()
    marks = {}

    def first():
        marks["counters"] = mode.counters()
        marks["calls"] = recorder.mark() if recorder else None

    timer = StepTimer(block.timer_sync, on_first=first, on_step=mode.on_step)
    mode.start_measuring()
    before = mode.counters()
    ids, t0, _ = generate(torch, model, block.prompt, new_tokens, sync, timer)
    after = mode.counters()
    accesses = recorder.distinct_accesses(marks["calls"]) if recorder else None
    extra = mode.extra()
    if isinstance(mode, EngineMode):
        out["trace_steps"] = mode.trace_steps(new_tokens)
    mode.new_sequence()
    runs = repeat_p50s(block, mode, new_tokens)
    if row == "resident":
        # The floor of every row's TTFT: not the process's first
        # prefill of this shape.
        generate(torch, model, block.ttft_prompt, 1, sync)
    _, s0, s1 = generate(torch, model, block.ttft_prompt, 1, sync)
    return Measured(timer, t0, ids, before, marks["counters"], after, accesses, extra, runs, s1 - s0)


def row_figures(m: Measured, out: dict) -> dict:
    """`out` with the figures of what `m` measured."""
    times = m.timer.times
    decode = [b - a for a, b in zip(times, times[1:])]
    p50 = statistics.median(decode) * 1e3 if decode else None
    out["p50_runs_ms"] = ([p50] if p50 is not None else []) + m.runs
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


def run_row(block: Block, row: str, share, trace=None) -> dict:
    """Sets up `row`, runs the warm-up, measured and TTFT generates, tears
    down and restores the model. Returns the figures."""
    torch, args = block.torch, block.args
    budget = None if share is None else int(share * block.state.total_bytes)
    new_tokens = args.accelerate_tokens if row == "accelerate-cpu-offload" else args.new_tokens
    warm_tokens = 1 if row == "accelerate-cpu-offload" else args.warmup_tokens
    out = {"budget_bytes": budget, "new_tokens": new_tokens}
    mode = None
    recorder = None
    try:
        with cpu_sync_noop(torch, row in MPL_ROWS and not block.cuda):
            mode = make_mode(block, row, budget, trace, out)
            if mode.accesses_from_routing:
                recorder = RoutingRecorder(block.model)
            measured = measure_row(block, row, mode, recorder, new_tokens, warm_tokens, out)
    finally:
        if recorder is not None:
            recorder.close()
        if mode is not None:
            with contextlib.suppress(Exception):
                mode.close()
        mode = None
        block.state.restore()
        gc.collect()
        if block.cuda:
            torch.cuda.empty_cache()
    return row_figures(measured, out)


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
        block.ttft_routed = sum(len(layer) for layer in rec.steps()[0])
    finally:
        rec.close()


def null_row(base: dict, reason: str) -> dict:
    row = dict(base)
    for key in FIGURES:
        row.setdefault(key, None)
    row["reason"] = reason
    return row


def build(torch, name, family, shape, args, cuda, device, dtype):
    """The model `name` and its state, what is known of it, and the first
    raw H2D reading (CUDA only)."""
    t_build = time.perf_counter()
    model = build_model(torch, family, shape, args.vocab, device, dtype)
    state = ModelState(model)
    build_s = time.perf_counter() - t_build
    raw = [raw_h2d_gbps(torch, state.expert_bytes, torch.cuda.current_device(), count=32)] if cuda else []
    info = {"family": family, "shape": shape, "vocab": args.vocab, "dtype": str(dtype).replace("torch.", ""),
            "layers": state.num_layers, "experts": state.num_experts, "top_k": model.config.num_experts_per_tok,
            "expert_bytes": state.expert_bytes, "total_expert_bytes": state.total_bytes,
            "default_experts_implementation": state.impl, "build_s": build_s}
    print(f"{name}: expert {state.expert_bytes / 2**20:.2f} MiB, all experts {state.total_bytes / 2**30:.2f} GiB, "
          f"vocab {args.vocab}, default experts implementation {state.impl!r}, built in {build_s:.1f} s"
          + (f", raw H2D {raw[0]:.1f} GB/s" if raw else ""), file=sys.stderr, flush=True)
    return model, state, info, raw


def row_plan(args) -> list:
    """(row, share) in the order a block runs them: the share-free rows,
    then each share's rows, accelerate last (it is slow and its tokens are
    few)."""
    wanted = [r for r in ROWS if r in args.rows]
    plan = []
    for r in wanted:
        if r in SHARE_FREE_ROWS:
            plan.append((r, None))
    for share in args.shares:
        plan.extend((r, share) for r in SHARE_ROWS if r in wanted)
    plan.sort(key=lambda p: p[0] == "accelerate-cpu-offload")
    return plan


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
        adjacent = [v for v in (resident_p50_now(block) for _ in range(repeats)) if v is not None]
        res["resident_adjacent_runs_ms"] = adjacent
        res["resident_adjacent_p50_ms"] = statistics.median(adjacent) if adjacent else None
        if res["resident_adjacent_p50_ms"] and res.get("p50_runs_ms"):
            res["x_adjacent"] = statistics.median(res["p50_runs_ms"]) / res["resident_adjacent_p50_ms"]
    if block.routing is not None and row in ENGINE_ROWS and steps is not None:
        res["routing_equals_resident"] = steps == block.routing[:len(steps)]


def run_planned_row(block: Block, name: str, row: str, share, started: float) -> dict:
    """One row of a block's plan: its figures, or null ones with the reason
    it did not run."""
    args, batch = block.args, block.batch
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
        res = run_row(block, row, share, trace)
    except RowSkipped as exc:
        return null_row(base, str(exc))
    except Exception as exc:  # noqa: BLE001 - a row that fails reports why; the others still run
        failed = null_row(base, f"failed: {type(exc).__name__}: {str(exc)[:300]}")
        print(f"  {name} b{batch} {row} failed: {exc!r}", file=sys.stderr, flush=True)
        return failed
    compare_to_resident(block, row, share, trace, res)
    r = {**base, **res}
    print(f"  {name} b{batch} {fmt(share) if share is not None else '-':>5} {row:<26} p50 "
          f"{fmt(r['p50_ms']):>9} ms  ttft {fmt(r['ttft_ms']):>9} ms  hit {fmt(r.get('hit_rate'))}  "
          f"equal {r['tokens_equal']}", file=sys.stderr, flush=True)
    return r


def run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, blocks, models_info):
    sync = make_sync(torch, cuda)
    model, state, info, raw = build(torch, name, family, shape, args, cuda, device, dtype)
    models_info[name] = info
    model_rows = []
    for batch in args.batches:
        block = Block(torch, model, state, batch, args, cuda, device, sync)
        # Note [Warm every sequence length]: the measured and TTFT shapes.
        warm_lengths(torch, model, [block.warm_prompt], args.new_tokens, sync)
        warm_lengths(torch, model, [block.warm_ttft_prompt], 1, sync)
        block_rows = [run_planned_row(block, name, row, share, started) for row, share in row_plan(args)]
        blocks.append(restore_check(block, name))
        model_rows.extend(block_rows)
    if cuda:
        raw.append(raw_h2d_gbps(torch, state.expert_bytes, torch.cuda.current_device(), count=32))
    info["raw_h2d_gbps_runs"] = raw
    info["raw_h2d_gbps"] = max(raw) if raw else None
    by_block = {}
    for r in model_rows:
        by_block.setdefault(r["batch"], []).append(r)
    for batch, block_rows in by_block.items():
        block = next(b for b in blocks if b["model"] == name and b["batch"] == batch)
        settle(block_rows, block, info)
    explain_nulls(model_rows, cuda)
    rows.extend(model_rows)
    _HOST_EXPERTS.pop(id(model), None)  # its page-locked copy goes with the model
    del model, state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def oracle_trace(block: Block, share):
    from prefetch.integration import RoutingTrace

    steps = block.traces.get(share)
    if steps is None and block.traces:
        steps = next(iter(block.traces.values()))
    if steps is None:
        return None
    return RoutingTrace(block.state.num_layers, block.state.num_experts, [list(map(list, s)) for s in steps])


def resident_p50_now(block: Block):
    """The resident model's decode p50 (ms) measured now, on the restored
    model; None if the model is not in its resident state."""
    try:
        block.state.check()
    except RuntimeError:
        return None
    timer = StepTimer(block.timer_sync)
    generate(block.torch, block.model, block.prompt, block.args.new_tokens, block.sync, timer)
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return statistics.median(decode) * 1e3 if decode else None


def restore_check(block: Block, name) -> dict:
    """The resident generate once more after the block's rows: the model must
    generate the same ids (the rows restored it)."""
    out = {"model": name, "batch": block.batch, "resident_p50_ms": block.resident_p50,
           "resident_ttft_ms": block.resident_ttft, "routing": block.routing, "traces": block.traces,
           "ttft_routed_experts": block.ttft_routed}
    if block.reference is None:
        out["restore_check"] = None
        return out
    try:
        block.state.check()
    except RuntimeError as exc:
        out["restore_check"] = False
        out["restore_reason"] = str(exc)
        return out
    timer = StepTimer(block.timer_sync)
    ids, _, _ = generate(block.torch, block.model, block.prompt, block.args.new_tokens, block.sync, timer)
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    out["restore_check"] = bool(block.torch.equal(ids, block.reference))
    out["resident_again_p50_ms"] = statistics.median(decode) * 1e3 if decode else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"of {list(MODELS)} (smoke: {list(SMOKE_MODELS)})")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--shares", type=float, nargs="+", default=None)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="resident always runs (every row is compared to it)")
    parser.add_argument("--new-tokens", type=int, default=None, help="measured tokens per row (default 64)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up generate (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length of the measured generate")
    parser.add_argument("--ttft-tokens", type=int, default=None, help="prompt length of the TTFT generate (512)")
    parser.add_argument("--accelerate-tokens", type=int, default=None, help="measured tokens of accelerate (4)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab size (default 32000; the real ones are larger)")
    parser.add_argument("--mpl-capacity", choices=["memory", "slots"], default="memory",
                        help="moe-policylang capacity: budget slots // layers (same device bytes) or budget slots")
    parser.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="PNG of ms/token per row per share")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measured generates per row, and resident generates right after it; x_adjacent is "
                             "the ratio of their medians (the host's speed drifts over seconds)")
    parser.add_argument("--timer-sync", choices=["device", "stream"], default="device",
                        help="what the per-token clock waits for: every stream of the GPU (default; the engine's "
                             "background copies too) or the compute stream only (what a caller reading tokens "
                             "waits for)")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny configs on the CPU in float32: checks the logic, measures nothing")
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    smoke = args.smoke_cpu
    table = SMOKE_MODELS if smoke else MODELS
    defaults = dict(models=list(table), batches=[2] if smoke else [1, 8], shares=[0.5] if smoke
                    else [0.1, 0.25, 0.5], new_tokens=4 if smoke else 64, warmup_tokens=2 if smoke else 8,
                    prompt_tokens=8 if smoke else 32, ttft_tokens=32 if smoke else 512,
                    accelerate_tokens=3 if smoke else 4, vocab=128 if smoke else 32000,
                    budget_s=300 if smoke else 540)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [m for m in args.models if m not in table]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(table)}")
    if "resident" not in args.rows:
        args.rows = ["resident", *args.rows]
    if args.new_tokens < 2 or args.accelerate_tokens < 2:
        parser.error("--new-tokens and --accelerate-tokens must be >= 2 (the decode figure excludes the prefill)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    cuda = not smoke and torch.cuda.is_available()
    report = {"benchmark": "BM6 generate", "machine": machine_info(), "smoke_cpu": smoke,
              "config": {k: getattr(args, k) for k in ("models", "batches", "shares", "rows", "new_tokens",
                                                        "warmup_tokens", "prompt_tokens", "ttft_tokens",
                                                        "accelerate_tokens", "vocab", "mpl_capacity", "budget_s",
                                                        "timer_sync", "repeats")},
              "transformers": transformers.__version__,
              "notes": [f"vocab reduced to {args.vocab} (the real models' are 50304 and 151936)",
                        "random weights; routing is the random model's, not a trained one's"],
              "models": {}, "blocks": [], "rows": None}
    if not smoke and not cuda:
        print("BM6 needs a CUDA device (or --smoke-cpu): not measured", file=sys.stderr)
        if args.json:
            write_json(args.json, report)
        return 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.monotonic()
    rows = []
    torch.set_grad_enabled(False)
    for name in args.models:
        family, shape = table[name]
        run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, report["blocks"],
                  report["models"])
    report["rows"] = rows
    report["wall_s"] = time.monotonic() - started
    print(format_table(rows))
    if args.plot:
        why = plot(rows, args.plot)
        report["plot"] = args.plot if why is None else None
        if why:
            report["plot_reason"] = why
            print(f"plot not made: {why}", file=sys.stderr)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
